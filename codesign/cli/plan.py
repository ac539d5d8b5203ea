"""`codesign plan`: every plan of each (model, cluster, micro-batches) ranked by predicted time;
runs nothing. Platforms and profiles resolve exactly as the sweep's do."""

from __future__ import annotations

import argparse
import sys

from codesign.cli.common import command_parser, config_arguments, positive_int, setup_logging
from codesign.cli.session import session
from codesign.config.loader import load_config

EXAMPLES = [
    ("codesign plan -c my.toml --top 3", "the 3 best plans of each job (and the config's manual ones)"),
    ("codesign plan -c my.toml --format csv > plans.csv", "every plan, for a spreadsheet"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("codesign plan", "Rank every plan of each (model, cluster, micro-batches) by "
                                             "predicted time; run nothing.", EXAMPLES)
    config_arguments(parser, "Results DB whose measured profiles of other machines to use.")
    parser.add_argument("--top", metavar="K", type=positive_int,
                        help="Only the K best plans of each (model, cluster, micro-batches), and the manual ones.")
    parser.add_argument("--format", choices=("table", "csv"), default="table")
    return parser


def main(argv: list[str]) -> int:
    from codesign.planner import listing

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose, "codesign: %(message)s")
    config = load_config(args.config)
    with session(config, args.db, config.ray.address) as here:  # a [ray] cluster's nodes, as the sweep sees them
        hosts, book = here.hosts, here.profiles.book
    write = listing.write_csv if args.format == "csv" else listing.write_table
    rows = write(listing.plan_rows(config, book, args.top, hosts), sys.stdout)
    print(f"codesign: {rows} plans priced", file=sys.stderr)
    return 0
