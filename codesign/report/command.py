"""`codesign report [-d results.db] [-o report/]`: the report of a results DB, written to a folder."""

from __future__ import annotations

import argparse
import sys

from codesign.report.render import write_report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codesign report", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write report.html (self-contained: opens offline), a PNG per figure, summary.csv "
                    "(the best plan per model and cluster) and plans.csv (every plan, ranked).")
    parser.add_argument("-d", "--db", default="results.db", help="The sqlite3 results DB to report on.")
    parser.add_argument("-o", "--out", default="report", help="The folder to write into (created if needed).")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    written = write_report(args.db, args.out)
    print(f"codesign: report of {written.attempts} attempts: {written.html} ({len(written.figures)} figures), "
          f"summary.csv and plans.csv beside it", file=sys.stderr)
    return 0
