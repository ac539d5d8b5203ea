"""Where a machine's cost model learns: its points and calibrations, in the profile cache.

The store's contract (Optuna's journal storage is the model). Beside the machine's profile
(ProfileCache.path), every sweep on the machine, into any DB, shares:

- KEY.points.jsonl: every point measured on the machine, one JSON line each, only ever appended:
  one line at a time under KEY.points.jsonl.lock, flushed and fsynced before the lock is let go
  (run.durable). A point a sweep has added survives a crash of the sweep or of the machine. A
  reader takes no lock and skips a line that does not read (a torn last line: a crash
  mid-append, or a line being written), saying so once per file and process; the next append
  ends a torn line first, so that it alone is lost. No DB is read back or written for it. A
  point says how it ran (cost.learning.Point); a line written before points did reads with
  those fields None, not recorded: such a point bounds memory but fits no time factor.
- KEY.calibrations.json: every calibration version fitted to them, accepted or not, oldest
  first (cost.learning). Never edited: under KEY.calibrations.json.lock a writer reads the
  versions, appends one and replaces the file whole (a temporary file fsynced, renamed over
  it, the directory fsynced), then KEY.calibrations.json.bak the same way, its last good copy.
  A crash leaves each file old or new, whole. A reader takes no lock; where the file does not
  read (damaged, truncated), that is said once per file and process, and its last good copy
  prices, else the base profile; no command fails on it, and the next version written
  replaces it.
- Locks are lock files (O_CREAT | O_EXCL), which hold on NFS, where flock may not; one left by
  a crash is broken once stale.

Recording a point costs the sweep the same however large the pool: the point is appended, and
the memory bound raised, waiting for the calibrations' lock, where that point alone needs it (an
under-predicted peak is an OOM); the pool is not read. A refit reads the pool and takes seconds
(8-19 s at 300-1,200 points): it runs on a thread of its own (Refits) when the pool's count says
it may be due, holding KEY.refit.lock; a sweep finding it held skips the refit (the other sweep
is refitting). Its memory bound is written raised where a point added since it read the pool
needs more, read under the calibrations' lock, so that no raise, this sweep's or another's, is
lost. CODESIGN_LEARNING=0 turns learning off (benches, tests), as `codesign run --no-learning`
does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from codesign.config.loader import LinkSpec
from codesign.config.types import Job
from codesign.errors import PlanError
from codesign.outcome import OOM, SUCCEEDED, Outcome
from codesign.hardware.profiles import DeviceProfile, profile_id
from codesign.cost.learning import (Calibration, Point, calibrated, counted, due, point_bound, raised, ran_alone,
                                   refit)
from codesign.cost.plan import Plan, make_plan
from codesign.run.durable import append_line, claimed, lock_of, locked, write_atomically

if TYPE_CHECKING:
    from codesign.run.profile_cache import Machine, ProfileCache

log = logging.getLogger(__name__)
LEARNING_ENV = "CODESIGN_LEARNING"  # "0": no learning
REFIT_STALE = 300.0  # seconds: a refit takes seconds; a refit lock this old was left by a crash
UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError)  # what a damaged file raises
_warned: set[Path] = set()  # the files said to be damaged in this process


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
    # (points, timed points a refit fits) in the pool as last read, with its own since (None: not
    # read yet): what says a refit may be due without reading the pool. A point another adds
    # while a refit reads may be counted twice or not at all; the refit counts the pool itself.
    pool: tuple[int, int] | None = None

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

    def fitted(self, versions: Sequence[Calibration]) -> int:
        """The points the last refit of this base profile was fitted to (0: none yet)."""
        base = profile_id(self.base)
        return next((v.points for v in reversed(versions) if v.base == base and not v.memory_only), 0)

    def versions(self) -> list[Calibration]:
        return calibration_versions(self.cache, self.machine)

    def points(self) -> list[Point]:
        """Every point of the machine."""
        return read_points(self.file("points.jsonl"))

    def add(self, point: Point) -> None:
        """Append the point, durably, under the pool's lock."""
        path = self.file("points.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        append_line(path, json.dumps(point.to_dict()))
        if self.pool is not None:
            self.pool = (self.pool[0] + 1, self.pool[1] + bool(point.seconds and ran_alone(point)))

    def learn(self, point: Point) -> bool:
        """Add the point and raise the memory bound where it alone needs it; the pool is neither
        read nor priced (a refit is `refit`'s). True when the calibration in use changed (here,
        by a refit, or by another sweep meanwhile)."""
        before = self.current
        self.add(point)
        bound = point_bound(self.base, point)
        self._append(lambda current, version: raised(self.base, bound, current, version, time.time()))
        return self.current != before

    def refit_due(self) -> bool:
        """Whether a refit may be due, by the pool's count (not read yet: perhaps); reads no pool."""
        return self.pool is None or due(*self.pool, self.fitted(self.versions()))

    def refit(self) -> bool:
        """Refit when the pool makes one due, unless another sweep is refitting; True when a
        version was written. Seconds long: a sweep runs it on a thread of its own (Refits)."""
        with claimed(self.file("refit.lock"), REFIT_STALE) as mine:
            return mine and self._refit(self.points())

    def _refit(self, points: list[Point]) -> bool:
        """Fitted outside the calibrations' lock (it takes seconds), numbered, and its memory bound
        raised by the points added since, when it is written."""
        self.pool = counted(points)
        versions = self.versions()
        if not due(*self.pool, self.fitted(versions)):
            return False
        found = refit(self.base, points, self.latest(versions), len(versions) + 1, time.time())
        self._append(lambda current, version: dataclasses.replace(
            found, version=version, memory_factor=self._covering(found.memory_factor, len(points))))
        log.info("calibration of the %s: held-out error %.1f%% against %.1f%%, %s", self.machine,
                 100 * found.held_out_error, 100 * found.previous_error, "accepted" if found.accepted else "rejected")
        return True

    def _covering(self, bound: float, read: int) -> float:
        """The bound, raised where a point added after the first `read` needs more. Under the
        calibrations' lock: a point added later raises against the version written with it."""
        needed = (point_bound(self.base, p) for p in self.points()[read:])
        return max([bound, *(n for n in needed if n is not None)])

    def _append(self, new: Callable[[Calibration | None, int], Calibration | None]) -> None:
        """Under the calibrations' lock (waiting for it): the version `new` makes of the latest
        accepted one and the next number, if any, written after every version; then the latest
        accepted one in use (this, or another sweep's)."""
        path = self.file("calibrations.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(lock_of(path)):
            versions = self.versions()
            found = new(self.latest(versions), len(versions) + 1)
            if found is not None:
                versions.append(found)
                self._save(versions)
            self.current = self.latest(versions)  # under the lock: a refit's thread and the sweep's in turn

    def _save(self, versions: list[Calibration]) -> None:
        """Replace the versions' file, then its last good copy, each whole."""
        path = self.file("calibrations.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"machine": str(self.machine), "versions": [v.to_dict() for v in versions]}, indent=1)
        write_atomically(path, text)
        write_atomically(backup_of(path), text)


class Refits:
    """A sweep's refits, one at a time, each on a thread of its own: no job waits on one, and the
    sweep goes on timing its jobs meanwhile. The sweep says when one may start (`start`)."""

    def __init__(self, learners: Mapping[str, Learner]):
        self.learners = learners  # platform -> learner, as the sweep's pricing holds them
        self.due: set[str] = set()  # platforms whose new points may have made a refit due
        self.thread: threading.Thread | None = None

    def added(self, platform: str) -> None:
        """The platform's learner has a new point: a refit may now be due."""
        learner = self.learners.get(platform)
        if learner is not None and learner.refit_due():
            self.due.add(platform)

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def pending(self) -> bool:
        """A refit runs, or is due to."""
        return self.busy or bool(self.due)

    def start(self) -> None:
        """Start a due refit, unless one runs."""
        if self.busy or not self.due:
            return
        learner = self.learners.get(self.due.pop())
        if learner is not None:
            self.thread = threading.Thread(target=refit_logged, args=(learner,), name="codesign-refit", daemon=True)
            self.thread.start()

    def wait(self, seconds: float | None = None) -> None:
        """Wait for the running refit to end, `seconds` at most (None: however long it takes)."""
        if self.thread is not None:
            self.thread.join(seconds)


def refit_logged(learner: Learner) -> None:
    """A refit on its thread: a failure is logged, and the calibration in use stays."""
    try:
        learner.refit()
    except Exception:
        log.warning("the cost model of the %s could not refit:\n%s", learner.machine, traceback.format_exc())


def learning_file(cache: ProfileCache, machine: Machine, suffix: str) -> Path:
    return cache.root / f"{machine.key}.{suffix}"


def backup_of(path: Path) -> Path:
    return path.with_name(f"{path.name}.bak")


def read_points(path: Path) -> list[Point]:
    """The points of a pool file, in the order they were added; a line that does not read (a crash
    mid-write) is skipped, said once per file and process."""
    found, skipped = [], 0
    with contextlib.suppress(FileNotFoundError), path.open() as f:
        for line in f:
            try:
                found.append(Point.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                skipped += 1
    if skipped:
        _warn_once(path, "%s: %d unreadable point(s) skipped (a crash mid-append leaves one)", path, skipped)
    return found


def calibration_versions(cache: ProfileCache, machine: Machine) -> list[Calibration]:
    """Every calibration version fitted on the machine, oldest first. Where the file does not
    read (said once), its last good copy's, else none: the base profile prices."""
    path = learning_file(cache, machine, "calibrations.json")
    try:
        return read_versions(path)
    except FileNotFoundError:
        return []
    except UNREADABLE as err:
        kept = last_good(path)
        fallback = f"its last good copy ({len(kept)} version(s))" if kept else "the base profile"
        _warn_once(path, "%s does not read (%s: %s); pricing by %s until the next calibration replaces it",
                   path, type(err).__name__, err, fallback)
        return kept


def read_versions(path: Path) -> list[Calibration]:
    return [Calibration.from_dict(v) for v in json.loads(path.read_text())["versions"]]


def last_good(path: Path) -> list[Calibration]:
    """The versions of the file's last good copy; none where it has none that reads."""
    try:
        return read_versions(backup_of(path))
    except UNREADABLE:  # FileNotFoundError among them
        return []


def _warn_once(path: Path, message: str, *args: Any) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning(message, *args)


def point_of(job: Job, outcome: Outcome, links: Sequence[LinkSpec], source: str, base: str) -> Point | None:
    """The attempt as a point: succeeded with a measured median and peak, or oom with a plan;
    None for any other (nothing measured, or no plan: Auto search that found none). It says how
    it ran as the outcome recorded it (how_it_ran)."""
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
                 metrics.get("max_memory"), source, base, **how_it_ran(metrics))


def how_it_ran(metrics: dict[str, Any]) -> dict[str, Any]:
    """Point's fields of how an attempt ran, from its outcome's metrics: the power limits its
    guard set (gpu_power.record; none given, or not set: full power), the jobs beside it (the
    sweep's count; None where no sweep counted), its GPUs, its engine options (the job body's),
    the calibration that priced it (0: the base profile; None: not priced) and its steps' noise
    (how far the slowest tenth ran above their median)."""
    power = metrics.get("power") or {}
    limits = tuple(sorted((int(d), float(w)) for d, w in power["limits"].items())) if power.get("applied") else ()
    engine = metrics.get("engine_options")
    priced = metrics.get("prediction")
    median, p90 = metrics.get("median"), metrics.get("p90")
    return {"power_limits": limits, "jobs_beside": metrics.get("jobs_beside"),
            "devices": tuple(metrics.get("gpu_ids") or ()), "engine": None if engine is None else tuple(engine.items()),
            "calibration": None if priced is None else priced.get("calibration") or 0,
            "noise": max(p90 / median - 1, 0.0) if median and p90 else None}
