"""`codesign plan`: every plan of each (model, cluster, micro-batches) ranked by predicted time
(or energy, or cost) with its time-energy frontier; runs nothing. Platforms and profiles
resolve exactly as the sweep's do."""

from __future__ import annotations

import argparse
import sys

from codesign.cli.common import command_parser, config_arguments, positive_int, setup_logging
from codesign.cli.session import session
from codesign.config.loader import load_config
from codesign.config.types import OBJECTIVES

EXAMPLES = [
    ("codesign plan -c my.toml --top 3", "the 3 best plans of each job (and the config's manual ones)"),
    ("codesign plan -c my.toml --objective energy --max-slowdown 5 --top 1",
     "the least-energy plan within 5% of the fastest, and the time-energy frontier"),
    ("codesign plan -c my.toml --format csv > plans.csv", "every plan, for a spreadsheet"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("codesign plan", "Rank every plan of each (model, cluster, micro-batches) by "
                                             "predicted time; run nothing.", EXAMPLES)
    config_arguments(parser, "Results DB whose measured profiles of other machines to use.")
    parser.add_argument("--top", metavar="K", type=positive_int,
                        help="Only the K best plans of each (model, cluster, micro-batches), and the manual ones.")
    parser.add_argument("--format", choices=("table", "csv"), default="table")
    parser.add_argument("--objective", choices=OBJECTIVES,
                        help="Order every block by it: time, energy (joules per iteration) or cost (Zeus's eta-weighted "
                             "energy and time); energy and cost also price GPU power limits (default: each Auto search "
                             "spec's own objective, time for manual plans).")
    parser.add_argument("--max-slowdown", metavar="PCT", type=percent,
                        help="With --objective energy or cost: only plans at most PCT percent slower than the fastest.")
    parser.add_argument("--eta", type=weight, default=0.5, help="With --objective cost: the weight of energy against "
                                                                 "time, from 0 to 1 (default: %(default)s).")
    return parser


def percent(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0, got {text}")
    return value / 100


def weight(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a weight from 0 to 1, got {text}")
    return value


def main(argv: list[str]) -> int:
    from codesign.planner import listing

    from codesign.planner.objective import Objective

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.objective in (None, "time") and args.max_slowdown is not None:
        parser.error("--max-slowdown applies to --objective energy or cost")
    objective = Objective(args.objective, args.max_slowdown, args.eta) if args.objective else None
    setup_logging(args.verbose, "codesign: %(message)s")
    config = load_config(args.config)
    with session(config, args.db, config.ray.address) as here:  # a [ray] cluster's nodes, as the sweep sees them
        hosts, book = here.hosts, here.profiles.book
    write = listing.write_csv if args.format == "csv" else listing.write_table
    rows = write(listing.plan_rows(config, book, args.top, hosts, objective), sys.stdout)
    print(f"codesign: {rows} plans priced", file=sys.stderr)
    return 0
