"""How hard should a refit hold to the base profile? Replays recorded bench_learning runs.

Each DIR is a `bench/bench_learning.py --out DIR` run: its learning cache keeps every point it
measured, in the order they ran, and the profile it started from (none kept: the built-in CPU
profile). For each prior (cost.learning.LEARNING_PRIOR is the one in use) it prints, per
run:
- two-fold: the median |predicted / measured - 1| of every point priced by a fit to the other
  half (even and odd points), the base profile's beside it;
- in order: the points priced as a sweep would have priced them, each by the calibration in use
  when it ran (refits when due, judged as cost.learning.refit judges), the median error of
  the first sweep's thirds and of all the points.
The same measured points under each prior, so the comparison carries no run-to-run noise of its
own; the runs' own noise is in bench/RESULTS.md.

--synthetic NOISE...: no run, a simulation of the learner alone. bench_learning's jobs, in its
order, "measured" on a made-up machine: the built-in CPU profile with each of its components
and each plan kind's time scaled by a random factor (log-normal, the spread --truth-spread),
each step time then times log-normal noise of each NOISE (0.01: 1%). The learner's model can
express that machine exactly, so what it shows is how far noise alone keeps the learner from
it: the same goals as bench_learning's, per noise level and per made-up machine (--seeds).

    python bench/learning_replay.py /tmp/bl/run1 /tmp/bl/run2 --priors 0.03 0.3 1
    python bench/learning_replay.py --synthetic 0.01 0.03 0.09 --seeds 3
    python bench/learning_replay.py --time-refits 300 600 1200   # seconds of one refit per pool size
    python bench/learning_replay.py --time-records 300 1200      # a record's memory bound per pool size
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import numpy as np

from codesign.config.loader import load_config
from codesign.cost.calibration import COMPONENTS
from codesign.cost.model import Workload, estimate
from codesign.hardware.profiles import BUILTIN, DeviceProfile
from codesign.cost.learning import (EVIDENCE, LEARNING_PRIOR, REFIT_WINDOW, Calibration, Point, Priced, calibrated,
                                       counted, due, fit, memory_bound, plan_kinds, point_bound, refit,
                                       with_factors)
from codesign.cost.plan import make_plan
from codesign.run.learning import read_points

FIRST_SWEEP = 36  # bench_learning's first sweep; the rest are its second


def recorded(run: Path) -> tuple[DeviceProfile, list[Point]]:
    """The run's base profile and its timed points, in the order they were measured."""
    cache = run / "cache-learning"
    (pool,) = cache.glob("*.points.jsonl")
    points = read_points(pool)
    kept = cache / pool.name.replace(".points.jsonl", ".json")
    base = DeviceProfile.from_dict(json.loads(kept.read_text())["profile"]) if kept.exists() else BUILTIN["cpu"]
    # bench_learning ran its jobs one at a time, at full power: points recorded before points said so ran so
    alone = {"power_limits": (), "jobs_beside": 0}
    return base, [p if p.jobs_beside is not None else dataclasses.replace(p, **alone) for p in points if p.seconds]


def two_fold(base: DeviceProfile, points: list[Point], prior: float) -> tuple[float, float]:
    """(median error of each half priced by a fit to the other, the base profile's median error)."""
    priced = Priced(base, points)
    halves = [range(0, len(points), 2), range(1, len(points), 2)]
    errors = []
    for fitted, priced_half in (halves, halves[::-1]):
        factors, kinds = fit(priced, fitted, prior=prior)
        errors.append(priced.errors(with_factors(base, factors, kinds), priced_half))
    return float(np.median(np.concatenate(errors))), float(np.median(priced.errors(base, range(len(points)))))


def in_order(base: DeviceProfile, points: list[Point], prior: float, evidence: float) -> np.ndarray:
    """Each point's error as priced by the calibration in use when it ran."""
    priced = Priced(base, points)
    current: Calibration | None = None
    last, errors = 0, []
    for i in range(len(points)):
        if due(*counted(points[:i]), last):
            found = refit(base, points[:i], current, i, 0.0, prior, evidence)
            last, current = i, (found if found.accepted else current)
        errors.append(priced.errors(calibrated(base, current), [i])[0])
    return np.array(errors)


def synthetic(noise: float, spread: float, seed: int) -> tuple[DeviceProfile, list[Point]]:
    """The built-in CPU profile and bench_learning's jobs measured on a made-up machine (see above)."""
    from bench_learning import FIRST, OTHER, planned_jobs

    base, random = BUILTIN["cpu"], np.random.default_rng(seed)
    jobs = [(item.job, make_plan(item.job), load_config(str(config)).links) for config in (FIRST, OTHER)
            for item in planned_jobs(config, 49)]
    kinds = sorted(set().union(*(plan_kinds(plan) for _, plan, _ in jobs)))
    truth = with_factors(base, dict(zip(COMPONENTS, np.exp(random.normal(0, spread, len(COMPONENTS))))),
                     dict(zip(kinds, np.exp(random.normal(0, spread / 2, len(kinds))))))
    points = []
    for i, (job, plan, links) in enumerate(jobs):
        found = estimate(Workload.of(job, truth, links), plan)
        points.append(Point(job, plan, tuple(links), "succeeded",
                            found.seconds * float(np.exp(random.normal(0, noise))), found.peak_bytes, f"synthetic#{i}"))
    return base, points


def print_synthetic(noises: list[float], spread: float, seeds: int, prior: float, evidence: float) -> None:
    for noise, seed in itertools.product(noises, range(seeds)):
        base, points = synthetic(noise, spread, seed)
        errors = in_order(base, points, prior, evidence)
        first, _, last = (float(np.median(part)) for part in np.array_split(errors[:FIRST_SWEEP], 3))
        other = float(np.median(np.array_split(errors[FIRST_SWEEP:], 3)[0]))
        unfitted = float(np.median(Priced(base, points).errors(base, range(len(points)))))
        print(f"synthetic, noise {noise:.0%}, machine {seed} (base profile off by {unfitted:.1%}), prior {prior:g}, "
              f"evidence {evidence:g}: first sweep by thirds {first:.1%} / .. / {last:.1%}, last / first "
              f"{last / first:.2f}; second sweep's first third {other:.1%}, {other / last:.2f}x the last")


def time_refits(sizes: list[int], prior: float, evidence: float, window: int | None) -> None:
    """Wall seconds of one refit of a pool of each size (made-up machine 0's points at 5% noise, repeated)."""
    base, points = synthetic(0.05, 0.25, 0)
    for size in sizes:
        pool = (points * (size // len(points) + 1))[:size]
        began = time.perf_counter()
        refit(base, pool, None, 1, 0.0, prior, evidence, window or size)
        print(f"refit of {size} points (window {window or size}): {time.perf_counter() - began:.1f} s")


def time_records(sizes: list[int]) -> None:
    """Wall seconds of a recorded point's memory bound at each pool size: the pool's, as every
    record priced it before 441a473, against the new point's alone, as it does now."""
    base, points = synthetic(0.05, 0.25, 0)
    for size in sizes:
        pool = (points * (size // len(points) + 1))[:size]
        began = time.perf_counter()
        memory_bound(base, pool)
        middle = time.perf_counter()
        point_bound(base, pool[-1])
        print(f"memory bound at {size} points: the pool's {middle - began:.2f} s, "
              f"the new point's alone {1e3 * (time.perf_counter() - middle):.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="bench_learning.py --out folders")
    parser.add_argument("--synthetic", nargs="+", type=float, default=[], metavar="NOISE",
                        help="Simulate the learner on made-up machines at these noise levels (0.01: 1%%).")
    parser.add_argument("--seeds", type=int, default=3, help="Made-up machines per noise level.")
    parser.add_argument("--truth-spread", type=float, default=0.25,
                        help="Log-normal spread of the made-up machines' component factors (plan kinds': half).")
    parser.add_argument("--time-refits", nargs="+", type=int, default=[], metavar="POINTS",
                        help="Time one refit of a pool of each size, with the window in use and with none.")
    parser.add_argument("--time-records", nargs="+", type=int, default=[], metavar="POINTS",
                        help="Time a recorded point's memory bound at each pool size: the pool's, and its own.")
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
        if args.synthetic:
            print_synthetic(args.synthetic, args.truth_spread, args.seeds, prior, evidence)
        for window in (REFIT_WINDOW, None) if args.time_refits else ():
            time_refits(args.time_refits, prior, evidence, window)
    time_records(args.time_records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
