"""`codesign report`: the report of a results DB, written to a folder (pandas, matplotlib and
jinja2 imported on demand)."""

from __future__ import annotations

import argparse
import sys

from codesign.cli.common import command_parser, setup_logging

EXAMPLES = [
    ("codesign report -d results.db -o report", "report/report.html, its figures and CSVs"),
    ("codesign report --codesign codesign_rank.csv", "with the Co-design section of a `search --rank`"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("codesign report", "Write report.html (self-contained: opens offline), a PNG per "
                            "figure, summary.csv (the best plan per model and cluster) and plans.csv (every "
                            "plan, ranked).", EXAMPLES)
    parser.add_argument("-d", "--db", default="results.db", help="The sqlite3 results DB to report on.")
    parser.add_argument("-o", "--out", default="report", help="The folder to write into (created if needed).")
    parser.add_argument("--codesign", metavar="CSV", help="The CSV of `codesign search --rank` for the Co-design "
                                                          "section (default: codesign_rank.csv beside the DB, if any).")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from codesign.report.render import write_report

    written = write_report(args.db, args.out, args.codesign)
    print(f"codesign: report of {written.attempts} attempts: {written.html} ({len(written.figures)} figures), "
          f"summary.csv and plans.csv beside it", file=sys.stderr)
    return 0
