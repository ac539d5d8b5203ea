"""Step time and peak memory of every manual plan of a config, each job in its own process.

Runs the job body the orchestrator runs (compile first, warm-up steps excluded), records nothing,
and prints one row per job. Without GPUs, clusters with platform "cpu" or "auto" run on virtual
CPU devices; those figures compare plans on this machine, not GPUs.

    python bench/bench_plans.py                                  # bench/plans.toml (16 CPU devices)
    python bench/bench_plans.py -c codesign/models/zhen_gpu.toml # the seed model on GPUs
    python bench/bench_plans.py --both-schedules                 # pp > 1 under 1F1B and GPipe
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from codesign.errors import PlanError
from codesign.outcome import SUCCEEDED, Outcome
from codesign.cost.plan import make_plan, plan_name
from codesign.run.discovery import local_gpu_count
from codesign.run.local import LocalExecutor
from codesign.run.sweep import invalid_outcome
from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs
from codesign.config.types import SCHEDULES, Job

DEFAULT = Path(__file__).with_name("plans.toml")
HEADER = (f"{'plan':<40}{'mb':>4}{'status':>11}{'median ms':>11}{'p90 ms':>9}"
          f"{'peak MiB':>10}{'compile s':>11}{'samples/s':>11}  devices")


def variants(job: Job, both_schedules: bool) -> list[Job]:
    if not both_schedules or job.parallel.pp_dp_op[0] == 1:
        return [job]
    return [dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, pipeline_schedule=s))
            for s in SCHEDULES]


def run_one(job: Job, executor: LocalExecutor, timeout: float) -> Outcome:
    """The job body in its own process, as the sweep runs it, without the DB."""
    run = executor.start(job, timeout)
    while not (ended := executor.wait([run], 1.0)):
        pass
    return ended[0][1]


def name(job: Job) -> str:
    """The plan's name; the spec's summary where it describes no plan that can run."""
    try:
        return plan_name(make_plan(job))
    except PlanError:
        return job.parallel.summary()


def row(job: Job, executor: LocalExecutor, timeout: float) -> str:
    outcome = invalid_outcome(job) or run_one(job, executor, timeout)
    pp = job.parallel.pp_dp_op[0]
    head = f"{name(job):<40}{job.num_micro_batches:>4}{outcome.status:>11}"
    if outcome.status != SUCCEEDED:
        return f"{head}  {outcome.error.strip().splitlines()[-1][:120] if outcome.error else ''}"
    m = outcome.metrics
    stages = outcome.plan["stages"]
    devices = " | ".join(",".join(map(str, s["device_ids"])) for s in stages) if pp > 1 else "all"
    return (f"{head}{m['median'] * 1e3:>11.1f}{m['p90'] * 1e3:>9.1f}{m['max_memory'] / 2**20:>10.1f}"
            f"{m['compile_time']:>11.1f}{m['throughput']:>11.0f}  {devices}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default=str(DEFAULT), help="TOML config (default: bench/plans.toml).")
    parser.add_argument("--timeout", type=float, default=600, help="Seconds per job.")
    parser.add_argument("--both-schedules", action="store_true", help="Run pp > 1 jobs under 1F1B and GPipe.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = load_config(args.config)
    executor = LocalExecutor(cache_dir=None)  # no compilation cache: compile times are real
    print(f"{config.path}: {config.training}")
    print(HEADER, flush=True)
    for item in enumerate_jobs(config, Hosts.local(local_gpu_count())):
        if item.unavailable or item.job.parallel.is_auto:
            continue
        for job in variants(item.job, args.both_schedules):
            print(row(job, executor, args.timeout), flush=True)


if __name__ == "__main__":
    main()
