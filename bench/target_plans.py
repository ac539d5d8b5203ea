"""Every plan of a config compiled for GPUs that are only described: XLA's deviceless compile
(the CUDA build of JAX, `.[gpu]`; no GPU needed) of each job's programs on its cluster's hosts of
the target's GPUs.

    python bench/target_plans.py                                    # bench/target_plans.toml: every plan kind, 8 H100s
    python bench/target_plans.py -c tests/data/user-configs/config.toml   # the users' plans, 1 to 64 GPUs

gpu_check.sh runs on one GPU, so it never compiles a plan's collectives. This says, where no GPU
is, whether XLA:GPU compiles each dp, op, ZeRO-2 and pipeline plan of the config (what a job runs:
engine.step.compile_single_stage, engine.pipeline.compile_pipeline), the collectives its
programs hold, and its peak per device as XLA plans it against the GPU's memory and as the cost
model predicts it (by the built-in profile of the target's GPUs). An Auto search job
compiles the plan it chooses by the built-in profile of the target's GPUs (a sweep with a
measured profile may choose another). Nothing is autotuned, so compile times are not a
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
from typing import Any

import numpy as np
from bench_step import TARGETS, target_devices, target_value
from jax.sharding import Mesh

from codesign.engine import pipeline, programs
from codesign.engine import step as single_stage
from codesign.planner.auto import choose_plan
from codesign.cost.model import Workload, estimate
from codesign.cost.plan import MESH_AXES, Plan, make_plan
from codesign.hardware.profiles import ProfileBook
from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs
from codesign.config.types import Job

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
NO_TRITON_GEMMS = "--xla_gpu_enable_triton_gemm=false"
_COLLECTIVE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")  # an instruction's opcode, its shape a tuple or not


def config_jobs(config_path: Path) -> list[Job]:
    """The config's jobs, each on GPUs."""
    config = load_config(config_path)
    hosts = Hosts(tuple([max(c.num_devices_per_host for c in config.clusters)] * max(c.num_hosts for c in config.clusters)),
                  one_process_per_host=True)
    return [dataclasses.replace(planned.job, platform="gpu") for planned in enumerate_jobs(config, hosts)]


def job_plan(job: Job) -> tuple[Plan, str]:
    """The job's plan, and for Auto search the stages it chose (dp x op each)."""
    if not job.parallel.is_auto:
        return make_plan(job), ""
    plan = choose_plan(job, ProfileBook()).best().plan
    return plan, " -> " + "|".join(f"{s.dp}x{s.op}" for s in plan.stages)


def compiled_programs(job: Job, plan: Plan, devices: np.ndarray) -> tuple[list[tuple[str, Any]], int]:
    """The plan's compiled programs, by name, on `devices` (the cluster's, host-major), and its
    predicted peak bytes per device."""
    meshes = [Mesh(devices[list(s.device_ids)].reshape(s.dp, s.op), MESH_AXES) for s in plan.stages]
    if len(meshes) == 1:
        compiled = single_stage.compile_single_stage(job, plan, meshes[0]).compiled
        return [("step", compiled)], programs.compiled_memory(compiled).get("peak", 0)
    built = pipeline.compile_pipeline(job, plan, meshes)
    return [(f"stage {s.index} {kind}", program) for s in built.stages
            for kind, program in (("forward", s.forward), ("backward", s.backward), ("update", s.update))
            ], built.memory["peak"]


def collective_columns(found: Counter) -> str:
    return " ".join(f"{found[op]:>{len(op)}}" for op in COLLECTIVES)


def job_rows(job: Job, devices_for: Callable[[int, int], np.ndarray], memory: int, each: bool = False) -> list[str]:
    """The job's line: its plan's programs, their collectives by kind, its peak per device and
    whether that fits `memory`; or why it did not compile. With `each`, a line per program after
    it. devices_for(hosts, per_host): the devices."""
    p = job.parallel
    name = (f"{job.cluster.num_hosts}x{job.cluster.num_devices_per_host} {p.summary()} mb{job.num_micro_batches}"
            f"{' zero2' if p.zero2 else ''} {p.description[:20]!r}")
    start = time.perf_counter()
    try:
        plan, chosen = job_plan(job)
        name += chosen
        compiled, peak = compiled_programs(job, plan, devices_for(job.cluster.num_hosts, job.cluster.num_devices_per_host))
    except Exception as err:  # noqa: BLE001 - a plan that does not compile is this script's finding
        return [f"{name:<66} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"]
    found = {program: Counter(_COLLECTIVE.findall(c.as_text())) for program, c in compiled}
    predicted = estimate(Workload.of(job, ProfileBook().for_job(job)), plan).peak_bytes
    row = (f"{name:<66} {len(compiled):>8} {time.perf_counter() - start:>9.1f} "
           f"{collective_columns(sum(found.values(), Counter()))} {peak / 2**30:>8.2f} {'yes' if peak <= memory else 'no':>4}"
           f" {predicted / 2**30:>13.2f} {predicted / peak:>8.2f}")
    return [row] + [f"  {program:<64} {'':>18} {collective_columns(c)}" for program, c in found.items() if each]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=Path(__file__).with_suffix(".toml"))
    parser.add_argument("--target", choices=sorted(TARGETS), default="h100")
    parser.add_argument("--programs", action="store_true", help="a line per compiled program: a pipeline "
                        "stage's forward, backward and update, or the one step")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_TRITON_GEMMS}"  # read when the compiler starts
    memory = target_value(args.target, "device_memory_size")
    jobs = config_jobs(args.config)
    print(f"# {len(jobs)} jobs of {args.config}, compiled for {args.target} GPUs "
          f"({memory / 2**30:.1f} GiB each; no device attached, nothing autotuned)")
    print(f"{'job':<66} programs compile s " + " ".join(COLLECTIVES) + " peak GiB fits predicted GiB pred/XLA",
          flush=True)
    for job in jobs:
        rows = job_rows(job, lambda hosts, per_host: np.array(target_devices(args.target, hosts, per_host)), memory,
                        args.programs)
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
