"""What the HTML template shows: sections of notes, images and tables whose cells are formatted text.

`render` builds the sections; this module owns how a frame becomes a table of (CSS class, text)
cells, so every section formats its numbers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from codesign.report import fmt

Column = tuple[str, str, Callable[[Any], str]]  # header, frame column, formatter
OPEN_GROUPS = 8  # ranked tables shown unfolded; the rest fold (<details>)


@dataclass
class Table:
    columns: list[str]
    rows: list[list[tuple[str, str]]]  # cells: (CSS class, text)
    caption: str = ""
    fold: bool = False  # shown in a <details>, open or not
    open: bool = True


@dataclass
class Image:
    file: str
    uri: str
    alt: str


@dataclass
class Section:
    anchor: str
    title: str
    note: str
    empty: str = ""
    images: list[Image] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


def ms(seconds: Any) -> str:
    return fmt.scaled(seconds, 1e-3)


def mib(num_bytes: Any) -> str:
    return fmt.scaled(num_bytes, 2.0 ** 20)


def table(frame: pd.DataFrame, columns: list[Column], caption: str = "") -> Table:
    return Table([header for header, _, _ in columns], rows(frame, columns), caption)


def group_tables(plans_: pd.DataFrame, columns: list[Column]) -> list[Table]:
    """One folding table per (model, cluster), in the frame's order; the first OPEN_GROUPS unfolded."""
    groups: dict[tuple[str, str], list[list[tuple[str, str]]]] = {}
    for key, row in zip(zip(plans_["model"], plans_["cluster"]), rows(plans_, columns)):
        groups.setdefault(key, []).append(row)
    return [Table([header for header, _, _ in columns], rows_, f"{model} | {cluster}", fold=True,
                  open=i < OPEN_GROUPS)
            for i, ((model, cluster), rows_) in enumerate(groups.items())]


def rows(frame: pd.DataFrame, columns: list[Column]) -> list[list[tuple[str, str]]]:
    """Every cell formatted with its CSS class (numbers right-aligned, statuses coloured), the frame
    converted once (not per group: thousands of plans)."""
    records = frame[list(dict.fromkeys(c for _, c, _ in columns))].to_dict("records")
    classes = ["text" if format_ is fmt.text else "num" for _, _, format_ in columns]
    out = []
    for record in records:
        cells = [format_(record[column]) for _, column, format_ in columns]
        out.append([(f"text status-{text}" if header == "status" else css, text)
                    for (header, _, _), css, text in zip(columns, classes, cells)])
    return out
