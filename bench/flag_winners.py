"""gpu_check part 8's last run: every XLA flag set whose bf16 step beat part 1's, together.

A GPU run is rare (15 minutes a session, drawn by chance), so the run that finds two flag sets
that each help also times them together, with the whole-leaf row where part 1 found it faster,
instead of leaving the combination to the next lease. Reads bench_step's printed rows:

    python bench/flag_winners.py BATCH PART1_ROWS SET_ROWS...   # prints "ROW FLAGS..." or nothing

PART1_ROWS: part 1's bf16 output (rows `project`, maybe `project-whole-leaf`); each SET_ROWS: a
flag set's output, its first line "# XLA_FLAGS +FLAGS".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HEADER = "# XLA_FLAGS +"
LEAF_ROW = "project-whole-leaf"


def step_ms(text: str, row: str, batch: int) -> float | None:
    """The bf16 step time of `row` at `batch` in bench_step's printed table (its fourth column)."""
    for line in text.splitlines():
        fields = line.split()
        if fields[:3] == [row, "bf16", str(batch)] and len(fields) > 3:
            try:
                return float(fields[3])
            except ValueError:
                return None
    return None


def combined(batch: int, part1: str, sets: list[str]) -> tuple[str, list[str]] | None:
    """(row, flag sets) to time together, or None where fewer than two changes beat part 1's step."""
    base = step_ms(part1, "project", batch)
    if base is None:
        return None
    leaf = step_ms(part1, LEAF_ROW, batch)
    row = LEAF_ROW if leaf is not None and leaf < base else "project"
    winners = []
    for text in sets:
        flags = text.splitlines()[0].removeprefix(HEADER).strip() if text.startswith(HEADER) else ""
        found = step_ms(text, "project", batch)
        if flags and found is not None and found < base:
            winners.append(flags)
    return (row, winners) if len(winners) + (row == LEAF_ROW) >= 2 else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batch", type=int, help="the batch whose bf16 rows are compared")
    parser.add_argument("part1", type=Path, help="part 1's bf16 output")
    parser.add_argument("sets", type=Path, nargs="*", help="each flag set's output")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    found = combined(args.batch, args.part1.read_text(), [s.read_text() for s in args.sets])
    if found:
        print(found[0], *found[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
