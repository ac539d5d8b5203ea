"""`python -m codesign`: wires config -> jobs -> store -> executor; maps errors to exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TextIO

from codesign import search
from codesign.config import DEFAULT_CONFIG, Config, load_config
from codesign.devices import local_gpu_count
from codesign.errors import UserError
from codesign.jobs import PlannedJob, enumerate_jobs
from codesign.store import Store

EXIT_USAGE = 2
log = logging.getLogger("codesign")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codesign", description="ZHEN codesign toolkit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-D", "--dry-run", action="store_true",
                        help="Do not run. Only print what settings would run (and which are skipped).")
    parser.add_argument("-c", "--config", default=str(DEFAULT_CONFIG), help="The path to the configuration.")
    parser.add_argument("-d", "--db", default="results.db",
                        help="The path to the sqlite3 database file. All the results will be saved there.")
    parser.add_argument("--search-model", action="store_true",
                        help="Print candidate model specs as TOML [[model]] tables instead of running.")
    parser.add_argument("--manual-job-timeout", type=float, default=600,
                        help="The timeout threshold in seconds for jobs using manual stage.")
    parser.add_argument("--retry-failed", action="store_true",
                        help="Retry jobs whose recorded attempts all failed.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Log each job's progress.")
    search.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # stdout piped into `head` and closed: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.search_model:
            return search.run(args, sys.stdout)
        config = load_config(args.config)
        planned = list(enumerate_jobs(config, _gpu_count(config)))
        if args.dry_run:
            print_dry_run(planned, args.db, args.retry_failed, sys.stdout)
            return 0
        return run(planned, args)
    except UserError as err:
        print(f"codesign: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _gpu_count(config: Config) -> int:
    """Probe for GPUs only when some cluster could use them."""
    return local_gpu_count() if any(c.platform != "cpu" for c in config.clusters) else 0


def run(planned: list[PlannedJob], args: argparse.Namespace) -> int:
    from codesign.executor import LocalExecutor
    from codesign.orchestrator import run_sweep

    store = Store(args.db)
    cache_dir = str(Path(args.db).resolve().parent / "jax_cache")
    try:
        summary = run_sweep(planned, store, LocalExecutor(cache_dir), args.retry_failed,
                            args.manual_job_timeout)
    finally:
        store.close()
    for line in summary.lines():
        print(f"codesign: {line}", file=sys.stderr)
    return 0


def print_dry_run(planned: list[PlannedJob], db: str, retry_failed: bool, out: TextIO) -> None:
    """A table of every enumerated job and what a real run would do with it; writes nothing."""
    import pandas as pd

    store = Store.open_if_exists(db)
    rows = []
    for i, item in enumerate(planned, 1):
        if item.unavailable:
            action = "unavailable"
        else:
            action = store.decide(item.key, retry_failed) if store else "run"
        rows.append({"#": i, "model": item.job.model.summary(), "cluster": item.job.cluster.summary(),
                     "parallel": item.job.parallel.summary(), "micro_batches": item.job.num_micro_batches,
                     "global_batch": item.job.global_batch, "key": item.key[:12], "action": action})
    if store:
        store.close()
    frame = pd.DataFrame(rows)
    out.write(frame.to_string(index=False) + "\n\n" if rows else "no jobs match\n")
    counts = frame["action"].value_counts().to_dict() if rows else {}
    out.write(f"{len(rows)} jobs: " + ", ".join(f"{counts.get(a, 0)} {a}" for a in
                                                 ("run", "skip", "running", "unavailable")) + "\n")
    reasons = sorted({item.unavailable for item in planned if item.unavailable})
    for reason in reasons:
        out.write(f"unavailable: {reason}\n")
