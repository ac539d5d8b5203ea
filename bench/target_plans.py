"""Every manual plan of a config compiled for GPUs that are only described: XLA's deviceless compile
(the CUDA build of JAX, `.[gpu]`; no GPU needed) of each job's programs on its cluster's hosts of
the target's GPUs.

    python bench/target_plans.py                                    # bench/target_plans.toml: every plan kind, 8 H100s
    python bench/target_plans.py -c tests/data/user-configs/config.toml   # the users' plans, on 2 and 8 hosts

gpu_check.sh runs on one GPU, so it never compiles a plan's collectives. This says, where no GPU
is, whether XLA:GPU compiles each dp, op, ZeRO-2 and pipeline plan of the config (what a job runs:
engine.step.compile_single_stage, engine.pipeline.compile_pipeline), the collectives its
programs hold, and its predicted peak per device against the GPU's memory. Auto search jobs are
left out: their plan is chosen when they run. Nothing is autotuned, so compile times are not a
GPU's, and every matmul goes to cuBLAS (NO_TRITON_GEMMS): without autotuning XLA finds no Triton
tiling for some GEMMs ("Couldn't find output tile sizes"), a failure of the deviceless compile,
not of the plan. One row per job as it is compiled; prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_step import TARGETS, target_devices
from jax.sharding import Mesh

from codesign.engine import pipeline, programs
from codesign.engine import step as single_stage
from codesign.planner.plan import MESH_AXES, Plan, make_plan
from codesign.spec.config import load_config
from codesign.spec.hosts import Hosts
from codesign.spec.jobs import enumerate_jobs
from codesign.spec.types import Job

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
NO_TRITON_GEMMS = "--xla_gpu_enable_triton_gemm=false"
_COLLECTIVE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")  # an instruction's opcode, its shape a tuple or not


def manual_jobs(config_path: Path) -> list[Job]:
    """The config's jobs whose plan is given, each on GPUs."""
    config = load_config(config_path)
    hosts = Hosts(tuple([max(c.num_devices_per_host for c in config.clusters)] * max(c.num_hosts for c in config.clusters)),
                  one_process_per_host=True)
    return [dataclasses.replace(planned.job, platform="gpu") for planned in enumerate_jobs(config, hosts)
            if not planned.job.parallel.is_auto]


def compiled_programs(job: Job, plan: Plan, devices: np.ndarray) -> tuple[list, int]:
    """The plan's compiled programs on `devices` (the cluster's, host-major), and its predicted
    peak bytes per device."""
    meshes = [Mesh(devices[list(s.device_ids)].reshape(s.dp, s.op), MESH_AXES) for s in plan.stages]
    if len(meshes) == 1:
        compiled = single_stage.compile_single_stage(job, plan, meshes[0]).compiled
        return [compiled], programs.compiled_memory(compiled).get("peak", 0)
    built = pipeline.compile_pipeline(job, plan, meshes)
    return [p for s in built.stages for p in (s.forward, s.backward, s.update)], built.memory["peak"]


def job_row(job: Job, devices_for: Callable[[int, int], np.ndarray], memory: int) -> str:
    """The job's line: its plan's programs, their collectives by kind, its peak per device and
    whether that fits `memory`; or why it did not compile. devices_for(hosts, per_host): the devices."""
    p = job.parallel
    name = (f"{job.cluster.num_hosts}x{job.cluster.num_devices_per_host} {p.summary()} mb{job.num_micro_batches}"
            f"{' zero2' if p.sharding_options.get('prefer_reduce_scatter') else ''} {p.description[:20]!r}")
    start = time.perf_counter()
    try:
        devices = devices_for(job.cluster.num_hosts, job.cluster.num_devices_per_host)
        compiled, peak = compiled_programs(job, make_plan(job), devices)
    except Exception as err:  # noqa: BLE001 - a plan that does not compile is this script's finding
        return f"{name:<66} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    found = Counter(op for c in compiled for op in _COLLECTIVE.findall(c.as_text()))
    return (f"{name:<66} {len(compiled):>8} {time.perf_counter() - start:>9.1f} "
            + " ".join(f"{found[op]:>{len(op)}}" for op in COLLECTIVES)
            + f" {peak / 2**30:>8.2f} {'yes' if peak <= memory else 'no':>4}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=Path(__file__).with_suffix(".toml"))
    parser.add_argument("--target", choices=sorted(TARGETS), default="h100")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_TRITON_GEMMS}"  # read when the compiler starts
    memory = int(re.search(r"device_memory_size: (\d+)", TARGETS[args.target].read_text()).group(1))
    jobs = manual_jobs(args.config)
    print(f"# {len(jobs)} manual jobs of {args.config}, compiled for {args.target} GPUs "
          f"({memory / 2**30:.1f} GiB each; no device attached, nothing autotuned)")
    print(f"{'job':<66} programs compile s " + " ".join(COLLECTIVES) + " peak GiB fits", flush=True)
    for job in jobs:
        print(job_row(job, lambda hosts, per_host: np.array(target_devices(args.target, hosts, per_host)), memory),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
