"""`codesign reprice -d DB`: re-price the DB's recorded attempts with the profiles at hand now
(after `codesign profile`, or a new release's cost model); measurements, and what each measured
attempt predicted before it ran, stay as they are: the new predictions sit beside them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from codesign.cli.common import command_parser, setup_logging
from codesign.cli.session import profiles
from codesign.config.loader import load_config
from codesign.errors import UserError
from codesign.store.database import Store

EXAMPLES = [
    ("codesign reprice -d results.db", "after `codesign profile`, or after upgrading codesign"),
    ("codesign reprice -d old.db -c my.toml", "an older DB whose attempts recorded no links: price them with my.toml's"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("codesign reprice", "Re-price a results DB's recorded attempts with the profiles at "
                            "hand now (after `codesign profile`, or a new release's cost model). Measurements, and "
                            "what each measured attempt predicted before it ran, stay as they are: each new "
                            "prediction joins table repricings, saying whether the calibration that made it was "
                            "fitted to that attempt (in-sample). A simulated attempt's prediction, its only "
                            "result, is replaced.", EXAMPLES)
    parser.add_argument("-d", "--db", default="results.db", help="The results DB whose attempts to re-price.")
    parser.add_argument("-c", "--config", help="A config whose [links] price the attempts that recorded no links "
                                               "(priced by an older codesign); the others keep their own.")
    return parser


def main(argv: list[str]) -> int:
    from codesign.run.discovery import local_hosts
    from codesign.run.reprice import fitted_calibrations, reprice

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    if not Path(args.db).exists():
        raise UserError(f"{args.db}: no results DB here")
    links = load_config(args.config).links if args.config else ()
    store = Store(args.db)
    try:
        rows = store.attempts()
        hosts = local_hosts(any(row["platform"] == "gpu" for row in rows))
        found = profiles(hosts, args.db, None)
        done = reprice(store, rows, found.book, links, fitted_calibrations(found.learners.values()))
    finally:
        store.close()
    print(f"codesign: re-priced {done.total} attempts of {args.db}: {done}", file=sys.stderr)
    return 0
