"""Where a machine's cost model learns: its points and calibrations, in the profile cache.

Beside the machine's profile (ProfileCache.path): KEY.points.jsonl holds every point measured
on the machine, by any sweep into any DB (one JSON line each, appended under a lock: two sweeps
may write at once; no DB is read back or written for it); KEY.calibrations.json every
calibration version fitted to them, accepted or not (cost.learning). A sweep refits after a
point when the points are due, under a lock that a sweep finding it taken skips: the other
sweep is refitting. CODESIGN_LEARNING=0 turns learning off (benches, tests), as `codesign run
--no-learning` does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from codesign.config.loader import LinkSpec
from codesign.config.types import Job
from codesign.errors import PlanError
from codesign.outcome import OOM, SUCCEEDED, Outcome
from codesign.hardware.profiles import DeviceProfile, profile_id
from codesign.cost.learning import Calibration, Point, calibrated, due, raised, refit
from codesign.cost.plan import Plan, make_plan

if TYPE_CHECKING:
    from codesign.run.profile_cache import Machine, ProfileCache

log = logging.getLogger(__name__)
LEARNING_ENV = "CODESIGN_LEARNING"  # "0": no learning


def learning_enabled() -> bool:
    return os.environ.get(LEARNING_ENV, "1") != "0"


@dataclass
class Learner:
    """One machine's learning: its base profile (measured or built-in), the calibration of it in
    use, and the files they are kept in."""

    machine: Machine
    cache: ProfileCache
    base: DeviceProfile
    current: Calibration | None = None

    @classmethod
    def load(cls, machine: Machine, cache: ProfileCache, base: DeviceProfile) -> Learner:
        """The machine's learner, with its latest accepted calibration of this base profile."""
        learner = cls(machine, cache, base)
        learner.current = learner.latest(learner.versions())
        return learner

    @property
    def profile(self) -> DeviceProfile:
        """What prices this machine's jobs: the base profile under the calibration in use."""
        return calibrated(self.base, self.current)

    def file(self, suffix: str) -> Path:
        return learning_file(self.cache, self.machine, suffix)

    def latest(self, versions: Sequence[Calibration]) -> Calibration | None:
        base = profile_id(self.base)
        return next((v for v in reversed(versions) if v.accepted and v.base == base), None)

    def versions(self) -> list[Calibration]:
        return calibration_versions(self.cache, self.machine)

    def points(self) -> list[Point]:
        """Every point of the machine."""
        return read_points(self.file("points.jsonl"))

    def add(self, point: Point) -> None:
        """Append the point: one write of one line, under the file's lock."""
        path = self.file("points.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(json.dumps(point.to_dict()) + "\n")

    def learn(self, point: Point) -> bool:
        """Add the point and refit when due; True when the calibration in use changed (this
        refit's, or another sweep's accepted meanwhile)."""
        self.add(point)
        before = self.current
        with self._refitting() as mine:
            if mine:
                self._refit()
        return self.current != before

    def _refit(self) -> None:
        versions, points = self.versions(), self.points()
        base = profile_id(self.base)
        self.current = self.latest(versions)
        fitted = [v for v in versions if v.base == base and not v.memory_only]
        if due(points, fitted[-1].points if fitted else 0):
            found = refit(self.base, points, self.current, len(versions) + 1, time.time())
            log.info("calibration %d of the %s: held-out error %.1f%% against %.1f%%, %s", found.version,
                     self.machine, 100 * found.held_out_error, 100 * found.previous_error,
                     "accepted" if found.accepted else "rejected")
        else:
            found = raised(self.base, points, self.current, len(versions) + 1, time.time())
        if found is None:
            return
        self._save([*versions, found])
        if found.accepted:
            self.current = found

    @contextlib.contextmanager
    def _refitting(self) -> Iterator[bool]:
        """The machine's refit lock; False where another sweep holds it (it is refitting)."""
        path = self.file("calibrations.lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True

    def _save(self, versions: list[Calibration]) -> None:
        path = self.file("calibrations.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"machine": str(self.machine), "versions": [v.to_dict() for v in versions]}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(data, f, indent=1)
        os.replace(f.name, path)


def learning_file(cache: ProfileCache, machine: Machine, suffix: str) -> Path:
    return cache.root / f"{machine.key}.{suffix}"


def read_points(path: Path) -> list[Point]:
    """The points of a pool file, in the order they were added; a line that does not read (a crash
    mid-write) is skipped."""
    found = []
    with contextlib.suppress(FileNotFoundError), path.open() as f:
        for line in f:
            try:
                found.append(Point.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                log.warning("%s: an unreadable point skipped", path)
    return found


def calibration_versions(cache: ProfileCache, machine: Machine) -> list[Calibration]:
    """Every calibration version fitted on the machine, oldest first."""
    try:
        data = json.loads(learning_file(cache, machine, "calibrations.json").read_text())
    except FileNotFoundError:
        return []
    return [Calibration.from_dict(v) for v in data["versions"]]


def point_of(job: Job, outcome: Outcome, links: Sequence[LinkSpec], source: str, base: str) -> Point | None:
    """The attempt as a point: succeeded with a measured median and peak, or oom with a plan;
    None for any other (nothing measured, or no plan: Auto search that found none)."""
    metrics: dict[str, Any] = outcome.metrics
    measured = outcome.status == SUCCEEDED and metrics.get("median") and metrics.get("max_memory")
    if not (measured or outcome.status == OOM):
        return None
    try:
        plan = Plan.from_dict(outcome.chosen_plan) if outcome.chosen_plan else None
        plan = plan or (None if job.parallel.is_auto else make_plan(job))
    except PlanError:
        return None
    if plan is None:
        return None
    return Point(job, plan, tuple(links), outcome.status, metrics.get("median") if measured else None,
                 metrics.get("max_memory"), source, base)
