"""CSV exports of the results DB for spreadsheets (no sqlite3 binary needed)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from codesign.csv_cells import safe_frame
from codesign.errors import StoreError
from codesign.outcome import FINAL_STATUSES, SUCCEEDED
from codesign.store.database import Store
from codesign.store.schema import REPRICED_COLUMNS

SELECTIONS = {
    "all": FINAL_STATUSES,  # every finished attempt, with a result or an error
    "succeeded": (SUCCEEDED,),
}


def export_csv(db: str | Path, out: str | Path, which: str) -> int:
    """Write the chosen attempts with the DB's own column names, then their latest repricing's
    (REPRICED_COLUMNS: after them, so that a spreadsheet's columns stay where they were); returns
    the row count."""
    if not Path(db).exists():
        raise StoreError(f"{db}: no results DB here; run codesign first")
    store = Store(db, read_only=True)
    try:
        frame = pd.DataFrame(store.attempts_repriced(SELECTIONS[which]),
                             columns=[*store.attempt_columns(), *REPRICED_COLUMNS])
    finally:
        store.close()
    safe_frame(frame).to_csv(out, index=False)
    return len(frame)
