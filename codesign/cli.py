"""`codesign` (and `python -m codesign`): one program, verbs as subcommands; maps errors to exit codes.

`codesign run` wires config -> jobs -> store -> executor. The earlier toolkit's command lines
keep working: without a subcommand the arguments are run's (`python -m codesign -c X`), and
`--search-model` is `codesign search`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, TextIO

from codesign import __version__
from codesign.errors import ConfigError, UserError
from codesign.config.loader import DEFAULT_CONFIG, Config, load_config
from codesign.config.hosts import Hosts, platform_for
from codesign.config.jobs import PlannedJob, enumerate_jobs
from codesign.store.database import Decision, Store

if TYPE_CHECKING:
    from codesign.run.profile_cache import Profiles
    from codesign.run.sweep import Executor, SweepSummary

EXIT_USAGE = 2
EXIT_JOBS_FAILED = 3  # the sweep finished, but some jobs failed, timed out or went `oom`
GLOBAL_FLAGS = ("-v", "--verbose")
log = logging.getLogger("codesign")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="Log progress (a sweep: each job's output).")
    return parser


def _config_arguments(parser: argparse.ArgumentParser, db_help: str) -> None:
    parser.add_argument("-c", "--config", default=str(DEFAULT_CONFIG), help="The path to the configuration.")
    parser.add_argument("-d", "--db", default="results.db", help=db_help)


def build_run_parser(prog: str = "codesign run") -> argparse.ArgumentParser:
    parser = _parser(prog, "Run every job of a config that the results DB has not recorded yet.")
    parser.add_argument("-D", "--dry-run", action="store_true",
                        help="Do not run. Only print what settings would run (and which are skipped).")
    _config_arguments(parser, "The path to the sqlite3 database file. All the results will be saved there.")
    parser.add_argument("--manual-job-timeout", type=_positive_seconds, default=600,
                        help="The timeout threshold in seconds for jobs using manual stage.")
    parser.add_argument("--retry-failed", action="store_true",
                        help="Retry jobs whose recorded attempts all failed.")
    parser.add_argument("--ray-address", metavar="ADDRESS",
                        help="Run jobs on a Ray cluster: HOST:PORT of its head, 'auto' (the cluster "
                             "`ray start` made here) or 'local' (start one for this run). "
                             "Overrides [ray] address of the config.")
    parser.add_argument("--max-concurrent", metavar="N", type=_positive_int,
                        help="Jobs running at once. Default: on Ray, [ray] max_concurrent (else as many as the "
                             "cluster's resources allow); here, GPU jobs side by side on disjoint GPUs and CPU "
                             "jobs one at a time. 1: every job alone.")
    return parser


def build_search_parser(prog: str = "codesign search") -> argparse.ArgumentParser:
    from codesign.zhen import search

    parser = _parser(prog, "Print candidate model specs as TOML [[model]] tables (the space's size on stderr).")
    parser.add_argument("--search-model", action="store_true", help=argparse.SUPPRESS)  # the earlier spelling
    search.add_arguments(parser)
    g = parser.add_argument_group(
        "co-design ranking", "With --rank: every candidate within --param-tolerance of the base (after "
        "--num-layers/--uniform-kind; no draw) gets the plan Auto search would choose on each cluster of the "
        "config; the top K per cluster are printed as [[model]] tables with their plans, every candidate "
        "goes to the CSV.")
    g.add_argument("--rank", action="store_true", help="Rank the candidates by their best plan on each cluster.")
    _config_arguments(g, "Results DB: measured profiles to price with, and where --run-top records its jobs.")
    g.add_argument("--top", metavar="K", type=_positive_int, default=5, help="Candidates printed per cluster.")
    g.add_argument("--csv", metavar="PATH", default="codesign_rank.csv",
                   help="Every candidate with its figures (`codesign report --codesign PATH` draws it).")
    g.add_argument("--run-top", metavar="N", type=int, default=0,
                   help="Run the N best of each cluster (Auto search jobs, recorded in the DB) and compare the "
                        "measured ranking with the predicted one.")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """`codesign --help`: the program and its commands."""
    parser = argparse.ArgumentParser(
        prog="codesign", description="Co-design a ZHEN model with its distributed training plan. Without a "
        "command, the arguments are `run`'s; --search-model is `search`.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="Log progress.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, about) in COMMANDS.items():
        commands.add_parser(name, help=about, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background (run.sh)
    try:
        return dispatch(argv)
    except UserError as err:
        print(f"codesign: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("codesign: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # stdout piped into `head` and closed: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def dispatch(argv: list[str]) -> int:
    """`codesign [-v] COMMAND ARGS`, or the earlier toolkit's flags alone (run's, or search's)."""
    leading = 0
    while leading < len(argv) and argv[leading] in GLOBAL_FLAGS:
        leading += 1
    rest = argv[leading:]
    if rest and rest[0] in COMMANDS:
        return COMMANDS[rest[0]][0](argv[:leading] + rest[1:])
    if rest and rest[0] in ("-h", "--help", "--version"):
        build_parser().parse_args(rest)
    if "--search-model" in argv:
        return search_main(argv, prog="codesign")
    return run_main(argv, prog="codesign")


def _logging(verbose: bool, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr, format=fmt)


def search_main(argv: list[str], prog: str = "codesign search") -> int:
    """`codesign search`: candidate [[model]] tables on stdout."""
    from codesign.zhen import search

    args = build_search_parser(prog).parse_args(argv)
    _logging(args.verbose)
    if not args.rank:
        return search.run(args, sys.stdout)
    return _rank_main(args)


def _rank_main(args: argparse.Namespace) -> int:
    """`codesign search --rank`: the ranking's TOML on stdout, its CSV, and with --run-top the
    winners run (priced by the profiles the sweep will use: measured first where it would be)."""
    from codesign.planner import ranking
    from codesign.zhen import search

    if args.run_top < 0:
        raise ConfigError("command line", "search --rank", "--run-top",
                          f"expected an integer >= 0, got {args.run_top}")
    config, query = load_config(args.config), search.search_from_args(args)
    hosts = _hosts(config, None)  # ranked, and with --run-top run, on this machine
    profiles = _profiles(hosts, args.db, None)
    check_devices(config, profiles.book)
    platform_of = functools.partial(platform_for, hosts=hosts)
    for platform in {platform_of(c) for c in config.clusters} - {"sim"} if args.run_top else ():
        profiles.measured_for(platform)
    found, rankings = ranking.rank(query, config, profiles.book, platform_of, args.top)
    ranking.write_toml(found, rankings, args.top, sys.stdout)
    measured, code = _run_top(found, rankings, args, config, hosts, profiles) if args.run_top else ({}, 0)
    rows = ranking.write_csv(found, rankings, args.csv, measured)
    print(f"codesign: {len(found):,} candidates on {len(rankings)} cluster(s): {rows:,} rows in {args.csv}",
          file=sys.stderr)
    return code


def _run_top(found, rankings, args: argparse.Namespace, config: Config, hosts: Hosts,
             profiles: Profiles) -> tuple[dict, int]:
    """Run the --run-top best of each ranking as a sweep (codesign run's path) and print how the
    prediction ranked them: ((ranking, candidate) -> (measured samples/s, job key), the sweep's exit code)."""
    from codesign.planner import ranking
    from codesign.config.jobs import job_key

    picked = {(t, c): ranked.target.job(found.model(c), config.training)
              for t, ranked in enumerate(rankings) for c in map(int, ranked.top(args.run_top))}
    planned = list(dict.fromkeys(PlannedJob(job) for job in picked.values()))
    run_args = argparse.Namespace(db=args.db, retry_failed=False, manual_job_timeout=600, ray_address=None,
                                  verbose=args.verbose, max_concurrent=None)
    executor = _executor(args.db, None, hosts, run_args)
    code = run(planned, run_args, executor, None, config, profiles)
    store = Store(args.db)
    try:
        speed = {row["job_key"]: row["throughput"] for row in store.attempts()
                 if row["status"] == "succeeded" and row["throughput"]}
    finally:
        store.close()
    measured = {tc: (speed.get(job_key(job), float("nan")), job_key(job)) for tc, job in picked.items()}
    for t, ranked in enumerate(rankings):
        ran = [(ranked.global_batch / ranked.seconds[c], measured[t, c][0]) for tt, c in picked if tt == t]
        figures = ranking.agreement(*zip(*ran)) if ran else {}
        print(f"codesign: {ranked.target.describe()}: {ranking.agreement_line(figures)}", file=sys.stderr)
    return measured, code


def run_main(argv: list[str], prog: str = "codesign run") -> int:
    """`codesign run`: the sweep (or, with -D, the table of what it would do)."""
    args = build_run_parser(prog).parse_args(argv)
    _logging(args.verbose)
    config = load_config(args.config)
    address = args.ray_address or config.ray.address
    with _ray_session(address):
        hosts = _hosts(config, address)
        profiles = _profiles(hosts, args.db, address)
        check_devices(config, profiles.book)
        planned = list(enumerate_jobs(config, hosts))
        if args.dry_run:
            print_dry_run(planned, args.db, args.retry_failed, sys.stdout)
            return 0
        executor = _executor(args.db, address, hosts, args)
        return run(planned, args, executor, _max_concurrent(args, config, address), config, profiles)


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
    from codesign.run import discovery

    if address:
        return discovery.ray_hosts(address)
    return discovery.local_hosts(any(c.platform in ("gpu", "auto") for c in config.clusters))


def _profiles(hosts: Hosts, db: str, address: str | None) -> Profiles:
    """The profiles a command prices with: built-in, the DB's measured copies, this machine's cache."""
    from codesign.run.profile_cache import profiles_for

    store = Store.open_if_exists(db)
    try:
        return profiles_for(hosts, store, on_ray=bool(address), jax_cache=_jax_cache(db))
    finally:
        if store:
            store.close()


def check_devices(config: Config, book) -> None:
    """A simulated cluster must name a device kind the cost model has a profile for."""
    for i, cluster in enumerate(config.clusters):
        if cluster.is_simulated and not book.known(cluster.device):
            raise ConfigError(config.path, f"[[cluster_spec]] #{i + 1}", "device",
                              f"unknown device kind {cluster.device!r}; known kinds: {', '.join(book.kinds)} "
                              f"(or run `codesign profile` on the device)")


def _jax_cache(db: str) -> str:
    """JAX's compilation cache for the jobs: JAX's own JAX_COMPILATION_CACHE_DIR where the user
    set one (one cache for every DB), else jax_cache/ beside the DB."""
    return _jax_cache_in(Path(db).resolve().parent)


def _jax_cache_in(folder: Path) -> str:
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(folder / "jax_cache")


def _executor(db: str, address: str | None, hosts: Hosts, args: argparse.Namespace) -> Executor:
    if address:
        from codesign.run.ray_cluster import RayExecutor

        return RayExecutor(_jax_cache(db))
    from codesign.run.local import LocalExecutor

    return LocalExecutor(_jax_cache(db), gpus=range(hosts.gpus[0]), cpu_slots=args.max_concurrent or 1,
                         stream=args.verbose)


def _max_concurrent(args: argparse.Namespace, config: Config, address: str | None) -> int | None:
    """The flag, else on Ray the config's cap or none (its resources decide); here, the executor's
    rules (GPU jobs on disjoint GPUs, CPU jobs one at a time)."""
    if args.max_concurrent:
        return args.max_concurrent
    return config.ray.max_concurrent if address else None


def run(planned: list[PlannedJob], args: argparse.Namespace, executor: Executor,
        max_concurrent: int | None, config: Config, profiles: Profiles) -> int:
    """The sweep; SIGINT or SIGTERM kills the running jobs, records them and exits 128 + signal;
    exit 3 when some job failed, timed out or went `oom`."""
    from codesign.run.sweep import Pricing, Stopped, run_sweep, signals_stop_the_sweep

    store = Store(args.db)
    try:
        with signals_stop_the_sweep() as stop:
            logs = Path(args.db).resolve().parent / "logs"
            summary = run_sweep(planned, store, executor, args.retry_failed, args.manual_job_timeout,
                                max_concurrent, Pricing(profiles, config.links), logs, stop)
        keys = {item.key for item in planned}
        rows = [row for row in store.attempts() if row["job_key"] in keys]
    except Stopped as stop:
        print(f"codesign: stopped by {stop}; the running jobs were killed and recorded as interrupted",
              file=sys.stderr)
        return stop.exit_code
    finally:
        store.close()
    _print_summary(summary, rows, args.db)
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


def plan_main(argv: list[str]) -> int:
    """`codesign plan -c CONFIG [--top K] [--format table|csv]`: rank every plan, run nothing.
    Platforms and profiles resolve exactly as the sweep's do."""
    from codesign.planner import listing

    parser = _parser("codesign plan", "Rank every plan of each (model, cluster, micro-batches) by predicted "
                                      "time; run nothing.")
    _config_arguments(parser, "Results DB whose measured profiles of other machines to use.")
    parser.add_argument("--top", metavar="K", type=_positive_int,
                        help="Only the K best plans of each (model, cluster, micro-batches), and the manual ones.")
    parser.add_argument("--format", choices=("table", "csv"), default="table")
    args = parser.parse_args(argv)
    _logging(args.verbose, "codesign: %(message)s")
    config = load_config(args.config)
    with _ray_session(config.ray.address):  # a [ray] cluster's nodes, as the sweep sees them
        hosts = _hosts(config, config.ray.address)
        book = _profiles(hosts, args.db, config.ray.address).book
    check_devices(config, book)
    write = listing.write_csv if args.format == "csv" else listing.write_table
    rows = write(listing.plan_rows(config, book, args.top, hosts), sys.stdout)
    print(f"codesign: {rows} plans priced", file=sys.stderr)
    return 0


def profile_main(argv: list[str]) -> int:
    """`codesign profile`: measure this machine's devices for the cost model, kept in the user's
    cache (shared by every DB and by `codesign plan`), and print the profile as JSON."""
    import json

    from codesign.run import discovery
    from codesign.run.profile_cache import ProfileCache, measure, this_machine

    parser = _parser("codesign profile", profile_main.__doc__)
    parser.add_argument("--platform", choices=("cpu", "gpu"), help="Which devices to profile (default: the "
                                                                   "GPUs where JAX sees some, else the CPU).")
    parser.add_argument("--timeout", type=_positive_seconds, default=600, help="Seconds before giving up.")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    hosts = discovery.local_hosts(args.platform != "cpu")
    platform = args.platform or ("gpu" if hosts.gpus[0] else "cpu")
    if platform == "gpu" and not hosts.gpus[0]:
        raise UserError("--platform gpu: JAX sees no GPU on this machine")
    cache = ProfileCache()
    profile = measure(this_machine(platform, hosts), cache, _jax_cache_in(cache.root), timeout=args.timeout)
    if profile is None:
        return 1
    print(f"codesign: kept in {cache.path(this_machine(platform, hosts))}; `codesign reprice -d DB` re-prices "
          "a DB's attempts with it", file=sys.stderr)
    json.dump(profile.to_dict(), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def reprice_main(argv: list[str]) -> int:
    """`codesign reprice -d DB`: re-price the DB's recorded attempts with the profiles at hand
    now (after `codesign profile`, or a new release's cost model); measurements stay as they are."""
    from codesign.run.reprice import reprice

    parser = _parser("codesign reprice", reprice_main.__doc__)
    parser.add_argument("-d", "--db", default="results.db", help="The results DB whose attempts to re-price.")
    parser.add_argument("-c", "--config", help="A config whose [links] price the attempts that recorded no links "
                                               "(priced by an older codesign); the others keep their own.")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    if not Path(args.db).exists():
        raise UserError(f"{args.db}: no results DB here")
    links = load_config(args.config).links if args.config else ()
    from codesign.run.discovery import local_hosts

    store = Store(args.db)
    try:
        rows = store.attempts()
        hosts = local_hosts(any(row["platform"] == "gpu" for row in rows))
        changed = reprice(store, rows, _profiles(hosts, args.db, None).book, links)
    finally:
        store.close()
    print(f"codesign: re-priced {changed} attempts of {args.db}", file=sys.stderr)
    return 0


def report_main(argv: list[str]) -> int:
    """`codesign report`: the report of a results DB, written to a folder (pandas, matplotlib and
    jinja2 imported on demand)."""
    parser = _parser("codesign report", "Write report.html (self-contained: opens offline), a PNG per figure, "
                                        "summary.csv (the best plan per model and cluster) and plans.csv "
                                        "(every plan, ranked).")
    parser.add_argument("-d", "--db", default="results.db", help="The sqlite3 results DB to report on.")
    parser.add_argument("-o", "--out", default="report", help="The folder to write into (created if needed).")
    parser.add_argument("--codesign", metavar="CSV", help="The CSV of `codesign search --rank` for the Co-design "
                                                          "section (default: codesign_rank.csv beside the DB, if any).")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    from codesign.report.render import write_report

    written = write_report(args.db, args.out, args.codesign)
    print(f"codesign: report of {written.attempts} attempts: {written.html} ({len(written.figures)} figures), "
          f"summary.csv and plans.csv beside it", file=sys.stderr)
    return 0


def export_main(argv: list[str]) -> int:
    """`codesign export all|succeeded`: a results DB's attempts as CSV, with the DB's column names,
    for spreadsheets (no sqlite3 program needed)."""
    from codesign.store.export import SELECTIONS, export_csv

    parser = _parser("codesign export", export_main.__doc__)
    parser.add_argument("which", choices=sorted(SELECTIONS),
                        help="all: every finished attempt, with a result or an error; succeeded: those that did.")
    parser.add_argument("-d", "--db", default="results.db")
    parser.add_argument("-o", "--out", help="CSV path (default results_<which>.csv)")
    args = parser.parse_args(argv)
    out = args.out or f"results_{args.which}.csv"
    rows = export_csv(args.db, out, args.which)
    print(f"wrote {rows} rows to {out}", file=sys.stderr)
    return 0


# `codesign NAME ARGS`: NAME -> (what runs it, its line in `codesign --help`)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "run": (run_main, "run every job of a config not yet recorded (the default command)"),
    "plan": (plan_main, "rank every plan by predicted time; run nothing"),
    "profile": (profile_main, "measure this machine's devices for the cost model"),
    "reprice": (reprice_main, "re-price a DB's recorded attempts with the profiles at hand"),
    "report": (report_main, "write the report of a results DB"),
    "export": (export_main, "write a results DB's attempts as CSV"),
    "search": (search_main, "print candidate model specs as TOML"),
}
