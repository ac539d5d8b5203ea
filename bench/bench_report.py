"""Speed of `codesign report` and of the sweep summary on a large results DB.

Goal (issue 14): a DB of 10,000 attempts reports in under 10 s. The DB is written through the
Store (claim, finish) with every final status, retries, tracebacks and all_configs of a realistic
size, on tmpfs when there is one (building it is not what is measured). Prints figures; asserts nothing.

    python bench/bench_report.py                 # 10,000 attempts
    python bench/bench_report.py -n 2000 --keep /tmp/big   # keep the DB and the report there
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from codesign.outcome import Outcome
from codesign.report.render import write_report
from codesign.report.tables import sweep_summary
from codesign.config.jobs import job_key
from codesign.config.types import (
    AUTO_SEARCH,
    ClusterSpec,
    Job,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
)
from codesign.store.database import Store

CLUSTERS = [ClusterSpec(1, n, "NVLink", "gpu") for n in (1, 2, 4, 8)] + [ClusterSpec(2, 8, "EFAx4", "gpu")]
FAILURES = [("failed", "Traceback (most recent call last):\n  File \"job.py\", line 1\nRuntimeError: boom"),
            ("timeout", "job exceeded its 600 s timeout"),
            ("oom", "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2G"),
            ("invalid", "global batch 64 is not divisible by num_micro_batches = 3"),
            ("interrupted", "orchestrator stopped while the job ran")]


# a sweep's handful of models (12), each on every cluster: 60 groups of about 170 plans at 10,000 attempts
MODELS = [ModelSpec(features, 160, 20, layers, (mixers,) * layers)
          for features in (256, 512) for layers in (2, 4)
          for mixers in (("ATTENTION", "LINEAR", "ATTENTION", "DOT"), ("DOT", "LINEAR"), ("CONVOLUTION",))]


def random_job(rng: random.Random, i: int) -> Job:
    model = rng.choice(MODELS)
    cluster = rng.choice(CLUSTERS)
    n = cluster.num_devices
    pp = rng.choice([p for p in (1, 2, 4) if n % p == 0])
    op = rng.choice([o for o in (1, 2, 4) if (n // pp) % o == 0])
    description = AUTO_SEARCH if rng.random() < 0.05 else rng.choice(
        ("data parallel", "operator parallel", "pipeline", "dp x op", "zero-2"))
    micro_batches = rng.choice((1, 2, 4, 8))
    parallel = ParallelSpec(description, (micro_batches,), num_auto_layers=pp, remat_layer=rng.random() < 0.3,
                            pp_dp_op=None if description == AUTO_SEARCH else (pp, n // pp // op, op),
                            auto_sharding_option=(("prefer_reduce_scatter", True),) if description == "zero-2" else ())
    return Job(model, cluster, TrainingSpec(8, 10, seed=i), parallel, micro_batches, cluster.platform)


def plan_record(rng: random.Random) -> dict:
    """What the engine writes into all_configs["plan"]: per-parameter shardings, a few KB."""
    params = {f"layer_{i}/mixer_{j}/fc/kernel": "P(None, 'op')" for i in range(4) for j in range(4)}
    return {"stages": [{"device_ids": list(range(8)), "mesh": {"dp": 4, "op": 2},
                        "shardings": {"params": params, "opt_state": params}}],
            "predicted_memory": {"peak": rng.randint(2**20, 2**34)}}


def build(path: Path, attempts: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    store = Store(path)
    written, i = 0, 0
    while written < attempts:
        job = random_job(rng, i)
        i += 1
        key = job_key(job)
        tries = 2 if rng.random() < 0.05 else 1
        for attempt in range(tries):
            attempt_id = store.claim(key, job, retry_failed=True)
            succeeded = rng.random() < 0.8 and attempt == tries - 1
            store.finish(attempt_id, outcome(rng, job) if succeeded else Outcome(*rng.choice(FAILURES), duration=1.0))
            written += 1
    store.close()


def outcome(rng: random.Random, job: Job) -> Outcome:
    avg = rng.uniform(0.002, 0.2)
    metrics = {"avg": avg, "median": avg * 0.99, "p90": avg * 1.1, "throughput": job.global_batch / avg,
               "compile_time": rng.uniform(1, 30), "max_memory": rng.randint(2**20, 2**34),
               "predicted_time": avg * rng.uniform(0.8, 1.2), "predicted_memory": rng.randint(2**20, 2**34),
               "energy_per_iter": rng.uniform(10, 500) if rng.random() < 0.5 else None,
               "device_kind": "NVIDIA H100 80GB HBM3"}
    return Outcome("succeeded", metrics=metrics, plan=plan_record(rng), duration=avg * 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--attempts", type=int, default=10_000)
    parser.add_argument("--keep", type=Path, help="Write the DB and the report in this folder and keep them.")
    args = parser.parse_args()
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        build(where / "bench.db", args.attempts)
        print(f"built a DB of {args.attempts:,} attempts in {time.perf_counter() - start:.1f} s", flush=True)

        start, cpu = time.perf_counter(), time.process_time()
        written = write_report(where / "bench.db", where / "report")
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        size = written.html.stat().st_size / 2**20
        print(f"codesign report: {seconds:.2f} s wall, {cpu:.2f} s CPU for {written.attempts:,} attempts "
              f"({len(written.figures)} figures, report.html {size:.1f} MiB); goal < 10 s "
              f"(wall exceeds CPU when the machine is shared)")

        store = Store(where / "bench.db", read_only=True)
        start = time.perf_counter()
        rows = store.attempts()
        table = sweep_summary(rows)
        print(f"sweep summary: {time.perf_counter() - start:.2f} s for {len(rows):,} attempts "
              f"({len(table.splitlines()) - 1} model x cluster rows), reading the DB included")
        store.close()


if __name__ == "__main__":
    main()
