"""`codesign export all|succeeded`: a results DB's attempts as CSV, with the DB's column names,
for spreadsheets (no sqlite3 program needed)."""

from __future__ import annotations

import argparse
import sys

from codesign.cli.common import command_parser

EXAMPLES = [
    ("codesign export all -d results.db", "every finished attempt, to results_all.csv"),
    ("codesign export succeeded -o ok.csv", "only the attempts that succeeded, to ok.csv"),
]


def build_parser() -> argparse.ArgumentParser:
    from codesign.store.export import SELECTIONS

    parser = command_parser("codesign export", "Write a results DB's attempts as CSV, with the DB's column "
                            "names, for spreadsheets (no sqlite3 program needed).", EXAMPLES)
    parser.add_argument("which", choices=sorted(SELECTIONS),
                        help="all: every finished attempt, with a result or an error; succeeded: those that did.")
    parser.add_argument("-d", "--db", default="results.db")
    parser.add_argument("-o", "--out", help="CSV path (default results_<which>.csv)")
    return parser


def main(argv: list[str]) -> int:
    from codesign.store.export import export_csv

    args = build_parser().parse_args(argv)
    out = args.out or f"results_{args.which}.csv"
    rows = export_csv(args.db, out, args.which)
    print(f"wrote {rows} rows to {out}", file=sys.stderr)
    return 0
