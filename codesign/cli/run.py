"""`codesign run` (the default command): every job of a config that the results DB has not
recorded yet, or with -D the table of what it would do. `search --run-top` runs its winners
through the same sweep."""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from codesign.cli.common import (EXIT_JOBS_FAILED, command_parser, config_arguments, positive_int,
                                 positive_seconds, setup_logging)
from codesign.cli.session import MANUAL_JOB_TIMEOUT, RunOptions, Session, session
from codesign.config.jobs import PlannedJob, enumerate_jobs
from codesign.config.loader import load_config
from codesign.store.database import Decision, Store

if TYPE_CHECKING:
    from codesign.run.sweep import SweepSummary

EXAMPLES = [
    ("codesign run -c my.toml --dry-run", "the table of jobs, and which a run would skip; runs nothing"),
    ("codesign run -c my.toml -d results.db", "run what results.db has not recorded yet"),
    ("codesign -c my.toml --retry-failed --max-concurrent 1",
     "the earlier toolkit's spelling; rerun the failed jobs, each alone"),
]


def build_parser(prog: str = "codesign run") -> argparse.ArgumentParser:
    parser = command_parser(prog, "Run every job of a config that the results DB has not recorded yet.", EXAMPLES)
    parser.add_argument("-D", "--dry-run", action="store_true",
                        help="Do not run. Only print what settings would run (and which are skipped).")
    config_arguments(parser, "The path to the sqlite3 database file. All the results will be saved there.")
    parser.add_argument("--manual-job-timeout", type=positive_seconds, default=MANUAL_JOB_TIMEOUT,
                        help="The timeout threshold in seconds for jobs using manual stage.")
    parser.add_argument("--retry-failed", action="store_true",
                        help="Retry jobs whose recorded attempts all failed.")
    parser.add_argument("--ray-address", metavar="ADDRESS",
                        help="Run jobs on a Ray cluster: HOST:PORT of its head, 'auto' (the cluster "
                             "`ray start` made here) or 'local' (start one for this run). "
                             "Overrides [ray] address of the config.")
    parser.add_argument("--max-concurrent", metavar="N", type=positive_int,
                        help="Jobs running at once. Default: on Ray, [ray] max_concurrent (else as many as the "
                             "cluster's resources allow); here, GPU jobs side by side on disjoint GPUs and CPU "
                             "jobs one at a time. 1: every job alone.")
    parser.add_argument("--no-learning", action="store_true",
                        help="Price with this machine's profile as it is: do not refit its calibration from "
                             "the attempts measured here, nor use the one fitted before.")
    return parser


def main(argv: list[str], prog: str = "codesign run") -> int:
    """The sweep (or, with -D, the table of what it would do)."""
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.verbose)
    config = load_config(args.config)
    with session(config, args.db, args.ray_address or config.ray.address, not args.no_learning) as here:
        planned = list(enumerate_jobs(config, here.hosts))
        if args.dry_run:
            print_dry_run(planned, args.db, args.retry_failed, sys.stdout)
            return 0
        options = RunOptions(retry_failed=args.retry_failed, manual_job_timeout=args.manual_job_timeout,
                             max_concurrent=args.max_concurrent, verbose=args.verbose)
        return sweep(planned, here, options)


def sweep(planned: list[PlannedJob], here: Session, options: RunOptions) -> int:
    """The sweep; SIGINT or SIGTERM kills the running jobs, records them and exits 128 + signal;
    exit 3 when some job failed, timed out or went `oom`."""
    from codesign.run.sweep import Pricing, Stopped, run_sweep, signals_stop_the_sweep

    executor = here.executor(options)
    store = Store(here.db)
    try:
        with signals_stop_the_sweep() as stop:
            logs = Path(here.db).resolve().parent / "logs"
            summary = run_sweep(planned, store, executor, options.retry_failed, options.manual_job_timeout,
                                here.max_concurrent(options), Pricing(here.profiles, here.config.links), logs, stop)
        keys = {item.key for item in planned}
        rows = [row for row in store.attempts() if row["job_key"] in keys]
    except Stopped as stop:
        print(f"codesign: stopped by {stop}; the running jobs were killed and recorded as interrupted",
              file=sys.stderr)
        return stop.exit_code
    finally:
        store.close()
    _print_summary(summary, rows, here.db)
    return EXIT_JOBS_FAILED if summary.failures else 0


def _print_summary(summary: SweepSummary, rows: list[dict], db: str) -> None:
    for line in summary.lines():
        print(f"codesign: {line}", file=sys.stderr)
    if not any(row["status"] in ("succeeded", "simulated") for row in rows):
        return
    from codesign.report.tables import sweep_summary

    table = sweep_summary(rows)
    if table:
        print("codesign: best plan per model and cluster, from every recorded attempt of this config's jobs "
              f"(this run's and earlier ones'; `codesign report -d {db}` for the full report):\n{table}",
              file=sys.stderr)


def print_dry_run(planned: list[PlannedJob], db: str, retry_failed: bool, out: TextIO) -> None:
    """A table of every enumerated job and what a real run would do with it; writes nothing."""
    store = Store.open_if_exists(db)
    columns = ("#", "model", "cluster", "parallel", "micro_batches", "global_batch", "key", "action")
    rows, actions = [], collections.Counter()
    for i, item in enumerate(planned, 1):
        decision = (Decision("unavailable") if item.unavailable
                    else store.decide(item.key, retry_failed) if store else Decision("run"))
        actions[decision.action] += 1
        job = item.job
        rows.append((str(i), job.model.summary(), job.cluster.summary(), job.parallel.summary(),
                     str(job.num_micro_batches), str(job.global_batch), item.key[:12], str(decision)))
    if store:
        store.close()
    out.write(fixed_width(columns, rows) + "\n\n" if rows else "no jobs match\n")
    out.write(f"{len(rows)} jobs: " + ", ".join(f"{actions[a]} {a}" for a in
                                                 ("run", "skip", "running", "unavailable")) + "\n")
    for reason in sorted({item.unavailable for item in planned if item.unavailable}):
        out.write(f"unavailable: {reason}\n")


def fixed_width(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Right-aligned columns, as DataFrame.to_string prints them, at a tenth of its cost on
    100,000 rows (a dry run of a big config)."""
    table = [columns, *rows]
    widths = [max(map(len, column)) for column in zip(*table)]
    return "\n".join(" ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table)
