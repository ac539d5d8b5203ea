"""`codesign search` (the earlier toolkit's --search-model): candidate model specs as TOML
[[model]] tables; with --rank, ranked by their best plan on each cluster of a config, and with
--run-top the winners run to compare the measured ranking with the predicted one."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING

from codesign.cli.common import command_parser, config_arguments, positive_int, setup_logging
from codesign.cli.session import RunOptions, Session, session
from codesign.config.hosts import platform_for
from codesign.config.jobs import PlannedJob
from codesign.config.loader import load_config
from codesign.errors import ConfigError
from codesign.store.database import Store

if TYPE_CHECKING:
    from codesign.planner.ranking import Candidates, Ranking

EXAMPLES = [
    ("codesign search --max-similar 20 > models.toml", "20 models of about the base spec's parameter count"),
    ("codesign search --rank -c my.toml --top 3", "the 3 best candidates per cluster of my.toml, with their plans"),
    ("codesign search --rank -c my.toml --run-top 2 -d results.db",
     "run the 2 best of each cluster and compare measured with predicted"),
]


def build_parser(prog: str = "codesign search") -> argparse.ArgumentParser:
    from codesign.zhen import search

    parser = command_parser(prog, "Print candidate model specs as TOML [[model]] tables (the space's size on "
                                  "stderr).", EXAMPLES)
    parser.add_argument("--search-model", action="store_true", help=argparse.SUPPRESS)  # the earlier spelling
    search.add_arguments(parser)
    g = parser.add_argument_group(
        "co-design ranking", "With --rank: every candidate within --param-tolerance of the base (after "
        "--num-layers/--uniform-kind; no draw) gets the plan Auto search would choose on each cluster of the "
        "config; the top K per cluster are printed as [[model]] tables with their plans, every candidate "
        "goes to the CSV.")
    g.add_argument("--rank", action="store_true", help="Rank the candidates by their best plan on each cluster.")
    config_arguments(g, "Results DB: measured profiles to price with, and where --run-top records its jobs.")
    g.add_argument("--top", metavar="K", type=positive_int, default=5, help="Candidates printed per cluster.")
    g.add_argument("--csv", metavar="PATH", default="codesign_rank.csv",
                   help="Every candidate with its figures (`codesign report --codesign PATH` draws it).")
    g.add_argument("--head-dims", metavar="LIST", default="64,80,96,128",
                   help="A transformer base (the config's first [[model]]): the head dimensions its shapes take.")
    g.add_argument("--run-top", metavar="N", type=int, default=0,
                   help="Run the N best of each cluster (Auto search jobs, recorded in the DB) and compare the "
                        "measured ranking with the predicted one.")
    return parser


def main(argv: list[str], prog: str = "codesign search") -> int:
    """Candidate [[model]] tables on stdout."""
    from codesign.zhen import search

    args = build_parser(prog).parse_args(argv)
    setup_logging(args.verbose)
    if not args.rank:
        return search.run(args, sys.stdout)
    return _rank(args)


def _rank(args: argparse.Namespace) -> int:
    """`--rank`: the ranking's TOML on stdout, its CSV, and with --run-top the winners run
    (priced by the profiles the sweep will use: measured first where it would be)."""
    from codesign.planner import ranking
    from codesign.zhen import search

    if args.run_top < 0:
        raise ConfigError("command line", "search --rank", "--run-top",
                          f"expected an integer >= 0, got {args.run_top}")
    config = load_config(args.config)
    shapes = _transformer_shapes(config, args)
    query = None if shapes else search.search_from_args(args)
    with session(config, args.db, None) as here:  # ranked, and with --run-top run, on this machine
        platform_of = functools.partial(platform_for, hosts=here.hosts)
        for platform in {platform_of(c) for c in config.clusters} - {"sim"} if args.run_top else ():
            here.profiles.measured_for(platform)
        if shapes:
            found, rankings = shapes, ranking.rank_shapes(shapes, config, here.profiles.book, platform_of)
        else:
            found, rankings = ranking.rank(query, config, here.profiles.book, platform_of, args.top)
        ranking.write_toml(found, rankings, args.top, sys.stdout)
        measured, code = (_run_top(found, rankings, args.run_top, here, RunOptions(verbose=args.verbose))
                          if args.run_top else ({}, 0))
    rows = ranking.write_csv(found, rankings, args.csv, measured)
    print(f"codesign: {len(found):,} candidates on {len(rankings)} cluster(s): {rows:,} rows in {args.csv}",
          file=sys.stderr)
    return code


def _transformer_shapes(config, args: argparse.Namespace):
    """With a transformer as the config's first [[model]], its shapes within --param-tolerance
    (the ZHEN space's flags then do not apply); None for a ZHEN config, whose base the flags give."""
    from codesign.transformer import search as shapes

    base = config.models[0]
    if base.family != "transformer":
        return None
    try:
        dims = tuple(int(d) for d in args.head_dims.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise ConfigError("command line", "search --rank", "--head-dims",
                          f"expected comma-separated integers >= 1, got {args.head_dims!r}")
    if not args.param_tolerance > 0:
        raise ConfigError("command line", "search --rank", "--param-tolerance",
                          f"expected a positive number, got {args.param_tolerance!r}")
    return shapes.Shapes(base, tuple(shapes.shapes(base, args.param_tolerance, dims)))


def _run_top(found: Candidates, rankings: list[Ranking], top: int, here: Session,
             options: RunOptions) -> tuple[dict, int]:
    """Run the `top` best of each ranking as a sweep (codesign run's path) and print how the
    prediction ranked them: ((ranking, candidate) -> (measured samples/s, job key), the sweep's exit code)."""
    from codesign.cli.run import sweep
    from codesign.config.jobs import job_key
    from codesign.planner import ranking

    picked = {(t, c): ranked.target.job(found.model(c), here.config.training)
              for t, ranked in enumerate(rankings) for c in map(int, ranked.top(top))}
    planned = list(dict.fromkeys(PlannedJob(job) for job in picked.values()))
    code = sweep(planned, here, options)
    store = Store(here.db)
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
