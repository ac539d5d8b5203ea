"""Does a teaching sweep of other models leave two sweeps priced no worse? (issue 55)

Measures this machine's CPU profile once (`codesign profile`, as a user's first sweep on a new
machine does) into two fresh profile caches, "cold" and "taught". On the taught cache, learning
on, runs the teaching sweep: bench/learning_cpu.toml's 36 jobs (three small models, in
bench_learning's planned order). Then two sweeps, bench/learning_tiny.toml's 10 jobs and
bench/learning_cpu_other.toml's 24 (other models than the teaching sweep's), each job run on the
cold cache and then on the taught one before the next job starts (the machine's drift is
shared, not compared), learning on in both, every cache and sweep into a DB of its own. Prints,
for the two sweeps together and for each: the measured attempts, the median time error
|predicted / measured - 1| (the prediction recorded before the job ran) cold and taught and
their ratio, the steps' measured noise (the run-to-run difference of the same job's measured
median between the cold and the taught run; the median of the attempts' own p90 / median - 1)
and a verdict; then the calibration versions that priced each sweep on each cache. Goal
(issue 55): after the teaching sweep the two sweeps are priced no worse than cold, within the
steps' measured noise: "taught within noise of cold: yes" where the taught median error is at
most the cold one plus the run-to-run difference. Figures only: it asserts nothing.

    python bench/bench_teaching.py                    # about 20 minutes on two idle cores
    python bench/bench_teaching.py --out DIR          # keep the DBs and the caches in DIR
    python bench/bench_teaching.py --jobs 2 --teach 2 # a smoke run: two jobs per sweep, two taught
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_calibrations import noisiness
from bench_learning import BENCH, FIRST, OTHER, measured_base, paired, run_to_run, time_errors
from codesign.config.hosts import Hosts
from codesign.report.tables import calibration_version
from codesign.run.learning import calibration_versions
from codesign.run.profile_cache import ProfileCache, this_machine

TINY = BENCH / "learning_tiny.toml"


def median_of(values: list[float] | np.ndarray) -> float:
    """The median, nan where nothing was measured (a smoke run's failed job must still print)."""
    return float(np.median(values)) if len(values) else float("nan")


def steps_noise(rows: list[dict]) -> float:
    """The median of the measured attempts' own step noise, p90 / median - 1, as learning judges gains by it."""
    return median_of(noisiness([r for r in rows if r["median"] and r["p90"]]))


def priced_by(rows: list[dict]) -> str:
    """The calibration version that priced each attempt in turn, runs of one version as `v xN`."""
    versions = [calibration_version(r["all_configs"]) for r in rows]
    return ", ".join(f"{v} x{len(list(run))}" for v, run in itertools.groupby(versions)) or "nothing priced"


def fitted(cache: Path) -> str:
    """How many calibrations the cache's machine holds: what learning fitted on it."""
    versions = calibration_versions(ProfileCache(cache), this_machine("cpu", Hosts.local(0)))
    return f"{sum(v.accepted for v in versions)} accepted / {len(versions)}"


def print_pair(name: str, cold: list[dict], taught: list[dict]) -> None:
    """Cold against taught on the same jobs: their errors, the noise they sit on, and the verdict."""
    cold_error, taught_error = median_of(time_errors(cold)), median_of(time_errors(taught))
    noise = run_to_run(cold, taught)
    within = "yes" if taught_error <= cold_error + noise else "no"
    print(f"{name}: measured {len(time_errors(cold))} cold / {len(time_errors(taught))} taught; median time error "
          f"cold {cold_error:.1%}, taught {taught_error:.1%}, taught / cold {taught_error / cold_error:.2f}; "
          f"run-to-run {noise:.1%}; steps' noise {steps_noise(cold):.1%} cold / {steps_noise(taught):.1%} taught; "
          f"taught within noise of cold: {within}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="Keep the DBs and profile caches here (default: a temp folder).")
    parser.add_argument("--seed", type=int, default=55, help="Seed of the jobs' shuffled order.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds before a job is killed.")
    parser.add_argument("--jobs", type=int, help="Run only the first N jobs of each of the two sweeps.")
    parser.add_argument("--teach", type=int, help="Run only the first N jobs of the teaching sweep.")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="codesign-bench-teaching-"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("CODESIGN_PROFILE", "CODESIGN_LEARNING"):  # the cache is used, learning on as each run says
        os.environ.pop(name, None)
    cold, taught = out / "cache-cold", out / "cache-taught"
    began, load = time.monotonic(), os.getloadavg()[0]
    base = measured_base([cold, taught])
    (teaching,) = paired(FIRST, [(out / "teaching.db", taught, True)], args.seed, args.timeout, args.teach)
    sweeps = {config.name: paired(config, [(out / f"{config.stem}-cold.db", cold, True),
                                           (out / f"{config.stem}-taught.db", taught, True)],
                                  args.seed, args.timeout, args.jobs)
              for config in (TINY, OTHER)}
    print(f"bench_teaching: base profile {base}; {time.monotonic() - began:.0f} s wall, load {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; DBs and caches in {out}")
    print(f"teaching sweep ({FIRST.name}, taught cache): {len(teaching)} attempts, {len(time_errors(teaching))} "
          f"measured, median time error {median_of(time_errors(teaching)):.1%}; priced by {priced_by(teaching)}")
    print_pair("both sweeps", *(sum(runs, []) for runs in zip(*sweeps.values())))
    for name, (cold_rows, taught_rows) in sweeps.items():
        print_pair(name, cold_rows, taught_rows)
        print(f"{name} priced by calibrations (none: the base profile): cold {priced_by(cold_rows)}; "
              f"taught {priced_by(taught_rows)}")
    print(f"calibrations fitted: cold cache {fitted(cold)}; taught cache {fitted(taught)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
