"""Cells of every CSV codesign writes, safe to open in a spreadsheet: a text cell that a
spreadsheet would run as a formula gets a leading quote (OWASP's advice on CSV injection), so
an error text or a name from a DB or a config cannot run there. Numbers stay numbers."""

from __future__ import annotations

from typing import Any

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: Any) -> Any:
    """The value as a CSV cell: text starting like a formula behind a quote, else as it is
    (numbers, and text that reads as a signed number: "-0.25")."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not _signed_number(value):
        return "'" + value
    return value


def safe_frame(frame: Any) -> Any:
    """A pandas DataFrame with safe_cell applied to its cells that are not numbers."""
    text = frame.select_dtypes(exclude="number").columns
    return frame.assign(**{column: frame[column].map(safe_cell) for column in text})


def _signed_number(text: str) -> bool:
    if not text.startswith(("+", "-")):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True
