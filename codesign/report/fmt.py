"""How numbers read in the report and the sweep summary: a few significant digits, units in the header.
An absent value reads "-", never 0."""

from __future__ import annotations

import math
import numbers
from typing import Any

MISSING = "-"


def number(value: Any, digits: int = 4) -> str:
    """4 significant digits; a large value in full with thousands separators (12,346, not 1.235e+04)."""
    if not _present(value):
        return MISSING
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def scaled(value: Any, unit: float) -> str:
    """number() of value / unit: seconds as ms (1e-3), bytes as MiB (2**20)."""
    return number(value / unit) if _present(value) else MISSING


def ratio(value: Any) -> str:
    return f"{value:.2f}x" if _present(value) else MISSING


def percent(value: Any) -> str:
    return f"{100 * value:.1f}%" if _present(value) else MISSING


def integer(value: Any) -> str:
    return f"{value:.0f}" if _present(value) else MISSING


def text(value: Any) -> str:
    return value if isinstance(value, str) and value else MISSING


def _present(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
