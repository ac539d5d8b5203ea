"""How many calibrations price a tiny sweep, and how far they swing (issue 55, item 4).

Runs bench/learning_tiny.toml's 10 CPU jobs with `codesign` on a fresh profile cache, learning
on, as a new user's first sweep: priced by the built-in CPU profile (manual jobs measure none),
or by a measured one copied from `--base DIR`. Prints, per run:
- the calibration versions fitted (accepted / all), the one that priced each job in turn, how
  many distinct profiles did (the base profile counts as one; a memory bound raised by a peak
  is a version of its own with the time factors before it) and how many sets of time factors;
- each job's error as priced before it ran, the swing (the calibration at the end prices the
  same jobs against what the sweep recorded, as `codesign plan` would after it) and the steps'
  noise (p90 / median - 1 of each job's measured steps, as its point carries it);
- replayed: the run's points refitted again in the order they ran, as the sweep refits them,
  judged with the steps' noise and without it (the rule before): the same measurements under
  either rule, so the comparison carries no run-to-run noise of its own.
Then, over the runs, how far the same job's measured median moved from run to run.

    python bench/bench_calibrations.py --runs 2          # five minutes on two cores
    python bench/bench_calibrations.py --base DIR        # DIR/codesign/profiles holds a measured profile
    python bench/bench_calibrations.py --replay DIR...   # no run: print the runs of earlier --out DIRs again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from codesign.config.hosts import Hosts
from codesign.cost.learning import Calibration, Point, Priced, calibrated, counted, due, refit
from codesign.hardware.profiles import BUILTIN, DeviceProfile
from codesign.run.learning import calibration_versions, read_points
from codesign.run.profile_cache import ProfileCache, profiles_for, this_machine
from codesign.run.reprice import prediction
from codesign.store.database import Store

BENCH = Path(__file__).resolve().parent
TINY = BENCH / "learning_tiny.toml"


@dataclasses.dataclass(frozen=True)
class Run:
    """An --out run: its DB and its profile cache."""

    where: Path

    @property
    def cache(self) -> ProfileCache:
        return ProfileCache(self.where / "cache" / "codesign" / "profiles")

    @property
    def db(self) -> Path:
        return self.where / "tiny.db"

    def rows(self) -> list[dict[str, Any]]:
        """Its succeeded attempts, in the order they ran."""
        store = Store(self.db)
        try:
            return [r for r in store.attempts(["succeeded"]) if r["predicted_time"]]
        finally:
            store.close()

    def repriced(self, rows: list[dict[str, Any]]) -> np.ndarray:
        """The rows' predicted seconds as the machine's latest calibration prices them now."""
        store = Store(self.db)
        try:
            book = profiles_for(Hosts.local(0), store, cache=self.cache).book
            return np.array([prediction(r, book)[0]["predicted_time"] for r in rows])
        finally:
            store.close()


def codesign(*args: str, cache: Path) -> None:
    subprocess.run([sys.executable, "-m", "codesign", *args], env={**os.environ, "XDG_CACHE_HOME": str(cache)},
                   check=True)


def fresh_cache(base: Path | None, where: Path) -> Path:
    """A cache with nothing learned: empty, or with the measured profiles of `base`."""
    target = where / "codesign" / "profiles"
    target.mkdir(parents=True)
    for path in (base / "codesign" / "profiles").iterdir() if base else ():
        if path.suffix == ".json" and not path.name.endswith(".calibrations.json"):
            shutil.copy(path, target / path.name)
    return where


def one_run(config: Path, base: Path | None, where: Path) -> Run:
    codesign("-c", str(config), "-d", str(where / "tiny.db"), cache=fresh_cache(base, where / "cache"))
    return Run(where)


def summary(run: Run) -> str:
    """What priced the run's jobs, how well, and how far the calibration at the end moves them."""
    rows = run.rows()
    versions = calibration_versions(run.cache, this_machine("cpu", Hosts.local(0)))
    recorded = np.array([r["predicted_time"] for r in rows])
    error = recorded / np.array([r["median"] for r in rows]) - 1
    swing = run.repriced(rows) / recorded - 1
    priced = [json.loads(r["all_configs"])["prediction"]["calibration"] or 0 for r in rows]
    timed = time_versions(versions)
    return (f"{len(rows)} jobs; calibrations fitted {sum(v.accepted for v in versions)} accepted / {len(versions)}; "
            f"priced by {len({r['profile_id'] for r in rows})} profiles (calibrations {' '.join(map(str, priced))}), "
            f"time factors of {len({timed.get(c, c) for c in priced})}; error before it ran "
            f"{np.median(np.abs(error)):.1%} median ({error.min():+.0%} to {error.max():+.0%}); swing "
            f"{swing.min():+.0%} to {swing.max():+.0%}; steps' noise {np.median(noisiness(rows)):.1%} median")


def noisiness(rows: list[dict[str, Any]]) -> list[float]:
    return [r["p90"] / r["median"] - 1 for r in rows]  # as run.learning.point_of carries it


def time_versions(versions: list[Calibration]) -> dict[int, int]:
    """Each accepted version -> the version whose time factors it prices with: its own, or, for a
    memory bound raised by a peak, those it kept (0: the base profile's)."""
    found, timed = {}, 0
    for v in versions:
        if v.accepted:
            timed = timed if v.memory_only else v.version
            found[v.version] = timed
    return found


def replayed(run: Run) -> str:
    """The run's points refitted in order under each rule: time calibrations, and the swing."""
    base, points = recorded_points(run)
    said = []
    for rule, pool in (("noise", points), ("no noise", [dataclasses.replace(p, noise=None) for p in points])):
        priced, last = in_order(base, pool)
        before = Priced(base, pool).estimates
        now = np.array([e.seconds for e in before(calibrated(base, last), range(len(pool)))])
        then = np.array([before(calibrated(base, c), [i])[0].seconds for i, c in enumerate(priced)])
        said.append(f"{rule}: time factors of {len({c.version if c else 0 for c in priced})}, swing "
                    f"{(now / then - 1).min():+.0%} to {(now / then - 1).max():+.0%}")
    return "replayed with " + "; with ".join(said)


def recorded_points(run: Run) -> tuple[DeviceProfile, list[Point]]:
    """The run's base profile and its points, as they ran: one at a time, at full power, each with
    its steps' noise (from its attempt, for points recorded before points said so)."""
    machine = this_machine("cpu", Hosts.local(0))
    pool = read_points(run.cache.root / f"{machine.key}.points.jsonl")
    rows = run.rows()
    noise = {f"{run.db.resolve()}#{r['id']}": n for r, n in zip(rows, noisiness(rows))}
    return run.cache.load(machine) or BUILTIN["cpu"], [
        dataclasses.replace(p, power_limits=(), jobs_beside=0, noise=noise.get(p.source)) if p.jobs_beside is None
        else p for p in pool]


def in_order(base: DeviceProfile, points: list[Point]) -> tuple[list[Calibration | None], Calibration | None]:
    """The time calibration pricing each point as a sweep refits (when due, before the point),
    and the one in use at the end."""
    current, last, priced = None, 0, []
    for i in range(len(points) + 1):
        if due(*counted(points[:i]), last):
            found = refit(base, points[:i], current, i, 0.0)
            last, current = i, found if found.accepted else current
        priced.append(current)
    return priced[:-1], current


def show(run: Run) -> None:
    print(f"{run.where}: {summary(run)}\n  {replayed(run)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=TINY)
    parser.add_argument("--base", type=Path, help="price by the measured profile of this XDG cache dir's codesign/profiles")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, help="keep the DBs and caches here")
    parser.add_argument("--replay", nargs="+", type=Path, default=[], metavar="DIR",
                        help="Run nothing: print the runs of these earlier --out DIRs (their run1, run2...).")
    args = parser.parse_args()
    for name in ("CODESIGN_PROFILE", "CODESIGN_LEARNING"):  # as a user runs it: the cache's profile, learning
        os.environ.pop(name, None)
    runs = [Run(d) for out in args.replay for d in sorted(out.glob("run*"))]
    for run in runs:
        show(run)
    out = args.out or Path(tempfile.mkdtemp(prefix="codesign-bench-calibrations-"))
    for i in range(0 if args.replay else args.runs):
        runs.append(one_run(args.config, args.base, out / f"run{i + 1}"))
        show(runs[-1])
    medians = [{r["job_key"]: r["median"] for r in run.rows()} for run in runs]
    moved = [abs(m[k] / medians[0][k] - 1) for m in medians[1:] for k in m if k in medians[0]]
    if moved:
        print(f"run to run: the same job's median moved {np.median(moved):.1%} (median of {len(moved)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
