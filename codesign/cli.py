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
from typing import TYPE_CHECKING, Callable, Iterator, TextIO

from codesign.errors import ConfigError, UserError
from codesign.planner.profiles import ProfileBook
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
        epilog="Other commands: codesign plan -h, codesign profile -h, codesign report -h.",
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
    argv = sys.argv[1:] if argv is None else list(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background (run.sh)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return SUBCOMMANDS[argv[0]](argv[1:])
        return _main(argv)
    except UserError as err:
        print(f"codesign: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("codesign: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # stdout piped into `head` and closed: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.search_model:
        return search.run(args, sys.stdout)
    config = load_config(args.config)
    check_devices(config, _book(args.db))
    address = args.ray_address or config.ray.address
    with _ray_session(address):
        planned = list(enumerate_jobs(config, _hosts(config, address)))
        if args.dry_run:
            print_dry_run(planned, args.db, args.retry_failed, sys.stdout)
            return 0
        return run(planned, args, _executor(args.db, address), _max_concurrent(args, config, address), config)


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
    return Hosts.local(local_gpu_count() if any(c.platform in ("gpu", "auto") for c in config.clusters) else 0)


def _book(db: str) -> ProfileBook:
    """Built-in profiles and those measured into the DB (read only; no DB, no measured ones)."""
    from codesign.run.profiling import load_book

    store = Store.open_if_exists(db)
    try:
        return load_book(store)
    finally:
        if store:
            store.close()


def check_devices(config: Config, book: ProfileBook) -> None:
    """A simulated cluster must name a device kind the cost model has a profile for."""
    for i, cluster in enumerate(config.clusters):
        if cluster.is_simulated and not book.known(cluster.device):
            raise ConfigError(config.path, f"[[cluster_spec]] #{i + 1}", "device",
                              f"unknown device kind {cluster.device!r}; known kinds: {', '.join(book.kinds)} "
                              f"(or run `codesign profile` on the device)")


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
        max_concurrent: int | None, config: Config) -> int:
    """The sweep; SIGINT or SIGTERM kills the running jobs, records them and exits 128 + signal."""
    from codesign.report.tables import sweep_summary
    from codesign.run.profiling import ensure_profiles
    from codesign.run.sweep import Pricing, Stopped, run_sweep, signals_stop_the_sweep

    store = Store(args.db)
    try:
        book = ensure_profiles(store, planned)
        with signals_stop_the_sweep():
            summary = run_sweep(planned, store, executor, args.retry_failed, args.manual_job_timeout,
                                max_concurrent, Pricing(book, config.links))
        keys = {item.key for item in planned}
        table = sweep_summary([row for row in store.attempts() if row["job_key"] in keys])
    except Stopped as stop:
        print(f"codesign: stopped by {stop}; the running jobs were killed and recorded as interrupted",
              file=sys.stderr)
        return stop.exit_code
    finally:
        store.close()
    for line in summary.lines():
        print(f"codesign: {line}", file=sys.stderr)
    if table:
        print("codesign: best plan per model and cluster, from every recorded attempt of this config's jobs "
              f"(this run's and earlier ones'; `codesign report -d {args.db}` for the full report):\n{table}",
              file=sys.stderr)
    return 0


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


def plan_main(argv: list[str]) -> int:
    """`codesign plan -c CONFIG [--top K] [--format table|csv]`: rank every plan, run nothing."""
    from codesign.planner import report

    parser = argparse.ArgumentParser(prog="codesign plan", description=plan_main.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-c", "--config", default=str(DEFAULT_CONFIG), help="The path to the configuration.")
    parser.add_argument("-d", "--db", default="results.db", help="Results DB whose measured profiles to use.")
    parser.add_argument("--top", metavar="K", type=_positive_int,
                        help="Only the K best plans of each (model, cluster, micro-batches), and the manual ones.")
    parser.add_argument("--format", choices=("table", "csv"), default="table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="codesign: %(message)s")
    config = load_config(args.config)
    book = _book(args.db)
    check_devices(config, book)
    write = report.write_csv if args.format == "csv" else report.write_table
    rows = write(report.plan_rows(config, book, args.top), sys.stdout)
    print(f"codesign: {rows} plans priced", file=sys.stderr)
    return 0


def profile_main(argv: list[str]) -> int:
    """`codesign profile [-d DB] [--platform cpu|gpu]`: measure this machine's devices for the
    cost model and keep the profile in the DB (replacing one of the same kind and versions)."""
    import json

    from codesign.planner.profiles import library_versions
    from codesign.run.profiling import measure

    parser = argparse.ArgumentParser(prog="codesign profile", description=profile_main.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-d", "--db", default="results.db", help="The results DB to keep the profile in.")
    parser.add_argument("--platform", choices=("cpu", "gpu"),
                        default="gpu" if local_gpu_count() else "cpu", help="Which devices to profile.")
    args = parser.parse_args(argv)
    profile = measure(args.platform)
    store = Store(args.db)
    try:
        store.save_profile(profile.kind, library_versions(), args.platform, profile.to_dict())
    finally:
        store.close()
    json.dump(profile.to_dict(), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def report_main(argv: list[str]) -> int:
    """`codesign report`: imported on demand (pandas, matplotlib, jinja2)."""
    from codesign.report.command import main as report

    return report(argv)


# `codesign NAME ARGS`: NAME -> what runs it; anything else is the sweep's flags
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "plan": plan_main, "profile": profile_main, "report": report_main}
