"""`python -m codesign`: wires config -> jobs -> store -> executor; maps errors to exit codes."""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, TextIO

from codesign.errors import UserError
from codesign.spec.config import DEFAULT_CONFIG, Config, load_config
from codesign.spec.hosts import Hosts, local_gpu_count, ray_hosts
from codesign.spec.jobs import PlannedJob, enumerate_jobs
from codesign.store.database import Decision, Store
from codesign.zhen import search

if TYPE_CHECKING:
    from codesign.run.sweep import Executor

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
    parser.add_argument("--ray-address", metavar="ADDRESS",
                        help="Run jobs on a Ray cluster: HOST:PORT of its head, 'auto' (the cluster "
                             "`ray start` made here) or 'local' (start one for this run). "
                             "Overrides [ray] address of the config.")
    parser.add_argument("--max-concurrent", metavar="N", type=_positive_int,
                        help="Jobs running at once. Default: [ray] max_concurrent on Ray (else as many "
                             "as the cluster's resources allow), 1 without Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Log each job's progress.")
    search.add_arguments(parser)
    return parser


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background (run.sh)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("codesign: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
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
        address = args.ray_address or config.ray.address
        with _ray_session(address):
            planned = list(enumerate_jobs(config, _hosts(config, address)))
            if args.dry_run:
                print_dry_run(planned, args.db, args.retry_failed, sys.stdout)
                return 0
            return run(planned, args, _executor(args.db, address), _max_concurrent(args, config, address))
    except UserError as err:
        print(f"codesign: error: {err}", file=sys.stderr)
        return EXIT_USAGE


@contextlib.contextmanager
def _ray_session(address: str | None) -> Iterator[None]:
    """Connected to the Ray cluster for the whole command when there is an address."""
    if not address:
        yield
        return
    try:
        from codesign.run import ray_cluster
    except ImportError as err:
        raise UserError(f"running on Ray needs it installed (pip install 'codesign[ray]'): {err}") from None
    ray_cluster.connect(address)
    try:
        yield
    finally:
        ray_cluster.disconnect()


def _hosts(config: Config, address: str | None) -> Hosts:
    """The Ray cluster's nodes, or this machine (probed for GPUs only when a cluster could use them)."""
    if address:
        return ray_hosts(address)
    return Hosts.local(local_gpu_count() if any(c.platform != "cpu" for c in config.clusters) else 0)


def _executor(db: str, address: str | None) -> Executor:
    cache_dir = str(Path(db).resolve().parent / "jax_cache")
    if address:
        from codesign.run.ray_cluster import RayExecutor

        return RayExecutor(cache_dir)
    from codesign.run.local import LocalExecutor

    return LocalExecutor(cache_dir)


def _max_concurrent(args: argparse.Namespace, config: Config, address: str | None) -> int | None:
    """The flag, else on Ray the config's cap or none (its resources decide); one at a time locally."""
    if args.max_concurrent:
        return args.max_concurrent
    return config.ray.max_concurrent if address else 1


def run(planned: list[PlannedJob], args: argparse.Namespace, executor: Executor,
        max_concurrent: int | None) -> int:
    """The sweep; SIGINT or SIGTERM kills the running jobs, records them and exits 128 + signal."""
    from codesign.run.sweep import Stopped, run_sweep, signals_stop_the_sweep

    store = Store(args.db)
    try:
        with signals_stop_the_sweep():
            summary = run_sweep(planned, store, executor, args.retry_failed, args.manual_job_timeout,
                                max_concurrent)
    except Stopped as stop:
        print(f"codesign: stopped by {stop}; the running jobs were killed and recorded as interrupted",
              file=sys.stderr)
        return stop.exit_code
    finally:
        store.close()
    for line in summary.lines():
        print(f"codesign: {line}", file=sys.stderr)
    return 0


def print_dry_run(planned: list[PlannedJob], db: str, retry_failed: bool, out: TextIO) -> None:
    """A table of every enumerated job and what a real run would do with it; writes nothing."""
    import pandas as pd

    store = Store.open_if_exists(db)
    rows, actions = [], collections.Counter()
    for i, item in enumerate(planned, 1):
        decision = (Decision("unavailable") if item.unavailable
                    else store.decide(item.key, retry_failed) if store else Decision("run"))
        actions[decision.action] += 1
        rows.append({"#": i, "model": item.job.model.summary(), "cluster": item.job.cluster.summary(),
                     "parallel": item.job.parallel.summary(), "micro_batches": item.job.num_micro_batches,
                     "global_batch": item.job.global_batch, "key": item.key[:12], "action": str(decision)})
    if store:
        store.close()
    out.write(pd.DataFrame(rows).to_string(index=False) + "\n\n" if rows else "no jobs match\n")
    out.write(f"{len(rows)} jobs: " + ", ".join(f"{actions[a]} {a}" for a in
                                                 ("run", "skip", "running", "unavailable")) + "\n")
    reasons = sorted({item.unavailable for item in planned if item.unavailable})
    for reason in reasons:
        out.write(f"unavailable: {reason}\n")
