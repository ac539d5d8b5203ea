"""CSV exports of the results DB for spreadsheets (no sqlite3 binary needed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from codesign.errors import StoreError
from codesign.outcome import FINAL_STATUSES, SUCCEEDED
from codesign.store.database import Store

SELECTIONS = {
    "all": FINAL_STATUSES,  # every finished attempt, with a result or an error
    "succeeded": (SUCCEEDED,),
}


def export_csv(db: str | Path, out: str | Path, which: str) -> int:
    """Write the chosen attempts with the DB's own column names; returns the row count."""
    if not Path(db).exists():
        raise StoreError(f"{db}: no results DB here; run codesign first")
    store = Store(db, read_only=True)
    try:
        frame = pd.DataFrame(store.attempts(SELECTIONS[which]), columns=store.attempt_columns())
    finally:
        store.close()
    frame.to_csv(out, index=False)
    return len(frame)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codesign.store.export", description=__doc__)
    parser.add_argument("which", choices=sorted(SELECTIONS))
    parser.add_argument("-d", "--db", default="results.db")
    parser.add_argument("-o", "--out", help="CSV path (default results_<which>.csv)")
    args = parser.parse_args(argv)
    try:
        rows = export_csv(args.db, args.out or f"results_{args.which}.csv", args.which)
    except StoreError as err:
        print(f"codesign: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {rows} rows to {args.out or f'results_{args.which}.csv'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
