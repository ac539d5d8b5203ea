"""How hard should a refit hold to the base profile? Replays recorded bench_learning runs.

Each DIR is a `bench/bench_learning.py --out DIR` run: its learning cache keeps every point it
measured, in the order they ran, and the profile it started from (none kept: the built-in CPU
profile). For each prior (planner.learning.LEARNING_PRIOR is the one in use) it prints, per
run:
- two-fold: the median |predicted / measured - 1| of every point priced by a fit to the other
  half (even and odd points), the base profile's beside it;
- in order: the points priced as a sweep would have priced them, each by the calibration in use
  when it ran (refits when due, judged as planner.learning.refit judges), the median error of
  the first sweep's thirds and of all the points.
The same measured points under each prior, so the comparison carries no run-to-run noise of its
own; the runs' own noise is in bench/RESULTS.md.

    python bench/learning_replay.py /tmp/bl/run1 /tmp/bl/run2 --priors 0.03 0.3 1
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from codesign.planner.device_profiles import BUILTIN, DeviceProfile
from codesign.planner.learning import EVIDENCE, LEARNING_PRIOR, Calibration, Point, Priced, _profile, calibrated, due, fit, refit

FIRST_SWEEP = 36  # bench_learning's first sweep; the rest are its second


def recorded(run: Path) -> tuple[DeviceProfile, list[Point]]:
    """The run's base profile and its timed points, in the order they were measured."""
    cache = run / "cache-learning"
    (pool,) = cache.glob("*.points.jsonl")
    points = [Point.from_dict(json.loads(line)) for line in pool.read_text().splitlines()]
    kept = cache / pool.name.replace(".points.jsonl", ".json")
    base = DeviceProfile.from_dict(json.loads(kept.read_text())["profile"]) if kept.exists() else BUILTIN["cpu"]
    return base, [p for p in points if p.seconds]


def two_fold(base: DeviceProfile, points: list[Point], prior: float) -> tuple[float, float]:
    """(median error of each half priced by a fit to the other, the base profile's median error)."""
    priced = Priced(base, points)
    halves = [range(0, len(points), 2), range(1, len(points), 2)]
    errors = []
    for fitted, priced_half in (halves, halves[::-1]):
        factors, kinds = fit(priced, fitted, prior=prior)
        errors.append(priced.errors(_profile(base, factors, kinds), priced_half))
    return float(np.median(np.concatenate(errors))), float(np.median(priced.errors(base, range(len(points)))))


def in_order(base: DeviceProfile, points: list[Point], prior: float, evidence: float) -> np.ndarray:
    """Each point's error as priced by the calibration in use when it ran."""
    priced = Priced(base, points)
    current: Calibration | None = None
    last, errors = 0, []
    for i in range(len(points)):
        if due(points[:i], last):
            found = refit(base, points[:i], current, i, 0.0, prior, evidence)
            last, current = i, (found if found.accepted else current)
        errors.append(priced.errors(calibrated(base, current), [i])[0])
    return np.array(errors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="bench_learning.py --out folders")
    parser.add_argument("--priors", nargs="+", type=float, default=[0.03, LEARNING_PRIOR])
    parser.add_argument("--evidence", nargs="+", type=float, default=[EVIDENCE],
                        help="Standard errors by which a refit must beat the current calibration.")
    args = parser.parse_args()
    found = {run: recorded(run) for run in args.runs}
    for prior, evidence in itertools.product(args.priors, args.evidence):
        for run, (base, points) in found.items():
            cv, unfitted = two_fold(base, points, prior)
            errors = in_order(base, points, prior, evidence)
            thirds = " / ".join(f"{np.median(part):.1%}" for part in np.array_split(errors[:FIRST_SWEEP], 3))
            print(f"prior {prior:g}, evidence {evidence:g}, {run}: {len(points)} points; two-fold {cv:.1%} (base profile {unfitted:.1%}); "
                  f"in order: first sweep by thirds {thirds}, all {np.median(errors):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
