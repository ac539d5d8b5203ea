"""The cost model that learns: a machine's calibration, refitted from the attempts measured on it.

A point is one attempt measured on the machine: its job, the plan that ran, the links it was
priced with, its measured step time and peak, and how it ran. A refit fits the profile's
COMPONENTS (cost.calibration) and a time factor per plan kind (plan.stage_kind: each kind errs
on its own side) to the points that ran as the sweep prices plans (`comparable`), by least
squares of relative error drawn toward the base profile; it is kept only when its error on
held-out points (the newest third, priced by a fit to the older ones) is lower than the current
calibration's on the same points by more than their steps' own noise (`steps_noise`). Memory is
learned as an upper bound (an under-prediction is an OOM): a high quantile of the factor each
point's peak needs, taken by each refit over every point; between refits each new point raises
it alone (point_bound: one point priced, however large the pool). Pure (numpy, scipy, the cost
model); run.learning keeps the points and every version per machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.optimize import least_squares

from codesign.config.loader import LinkSpec
from codesign.config.types import Job
from codesign.outcome import OOM
from codesign.cost.calibration import COMPONENTS, FACTOR_BOUNDS, scaled
from codesign.cost.model import Workload, estimate
from codesign.hardware.profiles import Calibrated, DeviceProfile, profile_id
from codesign.cost.formulas import Estimate
from codesign.cost.plan import Plan, stage_kind

MIN_POINTS = 6  # measured points before the first refit: fewer pin no factor
GROWTH = 1.2  # refit once the points have grown by a fifth since the last fit (Ansor's rule)
HELD_OUT = 1 / 3  # the newest share of the points a refit is judged on
# How hard a refit draws each log factor toward the base profile (calibration.FACTOR_PRIOR is the
# probe fit's 0.03): measured steps on shared cores vary by 5-15% from one run to the next, and
# at 0.03 the refits followed that noise; at 0.3, recorded bench runs were priced better, in
# two-fold cross-validation and replayed in the order they ran (bench/RESULTS.md).
LEARNING_PRIOR = 0.3
EVIDENCE = 1.0  # standard errors by which a refit must beat the current calibration (errs_less)
# A refit fits the newest this many timed points: plenty for its few factors, the machine as it
# is now, and a refit that stays seconds long inside a sweep however large the pool grows.
REFIT_WINDOW = 300
MEMORY_QUANTILE = 0.95  # the memory bound covers this share of the points' peaks...
MEMORY_SLACK = 0.025  # ...to within this share: an under-prediction by more than 5% is the
# dangerous one (an OOM); giving the top peaks 2.5% predicts every other plan that much closer


@dataclass(frozen=True)
class Point:
    """One attempt measured on this machine: what prices it again, and how it ran beyond what the
    cost model prices (its job holds its precision, which the workload prices). Only a point
    that ran as the sweep prices plans fits time factors (`comparable`). None: not recorded (a
    point from before points said how they ran)."""

    job: Job
    plan: Plan  # the plan that ran: the toolkit's choice, or the manual spec's
    links: tuple[LinkSpec, ...]
    status: str  # "succeeded", or "oom": a memory point whose peak is above the device's memory
    seconds: float | None  # measured median seconds per iteration (None: oom)
    peak: float | None  # measured peak bytes per device
    source: str  # "DB#attempt id": which attempt of which DB it is (no DB is read back for it)
    base: str = ""  # the profile id of the machine's base profile when it was measured
    power_limits: tuple[tuple[int, float], ...] | None = ()  # watts per job device its guard set (none: full power)
    jobs_beside: int | None = 0  # the most jobs that ran beside it at once on its host
    devices: tuple[int, ...] = ()  # the GPU ids it ran on (none on CPU, or not recorded)
    engine: tuple[tuple[str, Any], ...] | None = None  # the engine options its steps were built with
    calibration: int | None = None  # the calibration version that priced it (0: the base profile)
    noise: float | None = None  # p90 / median - 1 of its measured steps: what a rerun may move its time by

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job.to_dict(), "plan": self.plan.to_dict(),
                "links": [dataclasses.asdict(link) for link in self.links], "status": self.status,
                "seconds": self.seconds, "peak": self.peak, "source": self.source, "base": self.base,
                "power_limits": _listed(self.power_limits), "jobs_beside": self.jobs_beside,
                "devices": list(self.devices), "engine": None if self.engine is None else dict(self.engine),
                "calibration": self.calibration, "noise": self.noise}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Point:
        limits, engine = data.get("power_limits"), data.get("engine")
        return cls(Job.from_dict(data["job"]), Plan.from_dict(data["plan"]),
                   tuple(LinkSpec(**link) for link in data["links"]), data["status"], data["seconds"],
                   data["peak"], data["source"], data.get("base", ""),
                   None if limits is None else tuple((int(d), float(w)) for d, w in limits),
                   data.get("jobs_beside"), tuple(data.get("devices") or ()),
                   None if engine is None else tuple(engine.items()), data.get("calibration"), data.get("noise"))


def _listed(pairs: tuple[tuple[Any, Any], ...] | None) -> list[list[Any]] | None:
    return None if pairs is None else [list(pair) for pair in pairs]


def comparable(points: Sequence[Point]) -> list[int]:
    """The points (their indices) that ran as the sweep prices plans: alone on their host, at full
    power, with the engine options of the newest point of their precision (the engine as it
    builds steps now; none recorded matches none). A point that does not say is not: its time
    may hold a power limit's or a neighbour's slowdown, which the time factors would absorb.
    Every point still bounds memory: neither changes a device's peak."""
    engines = {p.job.training.precision: p.engine for p in points}
    return [i for i, p in enumerate(points) if ran_alone(p) and p.engine == engines[p.job.training.precision]]


def ran_alone(point: Point) -> bool:
    """Alone on its host, at full power: as the sweep prices a plan."""
    return point.power_limits == () and point.jobs_beside == 0


def fitted_points(points: Sequence[Point]) -> list[int]:
    """The points (their indices) a refit fits time factors to: comparable ones with a measured time."""
    return [i for i in comparable(points) if points[i].seconds]


@dataclass(frozen=True)
class Calibration:
    """One version of a machine's calibration: what it scales, how well it did, and whether it was kept."""

    version: int
    base: str  # profile id of the profile it calibrates
    factors: tuple[tuple[str, float], ...]  # COMPONENTS -> factor, as calibration.scaled takes them
    plan_factors: tuple[tuple[str, float], ...]  # plan kind -> factor on its stages' seconds
    memory_factor: float  # on a stage's peak bytes
    points: int  # the machine's points when it was fitted (its time factors: the newest REFIT_WINDOW timed)
    # mean |predicted / measured - 1| over the newest HELD_OUT of its points, priced by a fit to
    # the older ones; and the previous calibration's (or base profile's) on them
    held_out_error: float
    previous_error: float
    accepted: bool
    created: float  # seconds since the epoch
    memory_only: bool = False  # the previous time factors, under a memory bound a measured peak raised
    noise: float = 0.0  # the held-out points' steps' noise, which its gain had to exceed (0: none measured)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "factors": dict(self.factors), "plan_factors": dict(self.plan_factors)}

    def summary(self) -> str:
        """One line: what it was fitted to, how it did against the previous, what it scales."""
        factors = ", ".join(f"{k} {f:.2f}" for k, f in (*self.factors, *self.plan_factors))
        if self.memory_only:
            return f"calibration {self.version}: memory x{self.memory_factor:.2f}, raised by a measured peak; {factors}"
        return (f"calibration {self.version}: {self.points} points, held-out error {self.held_out_error:.1%} "
                f"against {self.previous_error:.1%}, steps' noise {self.noise:.1%}, "
                f"{'accepted' if self.accepted else 'rejected'}; "
                f"memory x{self.memory_factor:.2f}; {factors}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        return cls(**{**data, "factors": tuple(data["factors"].items()),
                      "plan_factors": tuple(data["plan_factors"].items())})


def calibrated(base: DeviceProfile, calibration: Calibration | None) -> DeviceProfile:
    """The base profile as the calibration prices: its components scaled, its plan kinds' and
    memory factors set, its version named (so its profile id is its own)."""
    if calibration is None:
        return base
    layer = Calibrated(calibration.plan_factors, calibration.memory_factor, calibration.version)
    return dataclasses.replace(scaled(base, dict(calibration.factors)), calibration=layer)


def due(points: int, timed: int, last: int) -> bool:
    """Refit now: enough of the `points` timed, and they have grown by a fifth since the last fit
    (to `last` points; 0: none yet). Counts, not points: a sweep asks after every record."""
    return timed >= MIN_POINTS and points >= GROWTH * last


def counted(points: Sequence[Point]) -> tuple[int, int]:
    """(points, timed points a refit fits: fitted_points): what `due` takes."""
    return len(points), len(fitted_points(points))


def plan_kinds(plan: Plan) -> set[str]:
    """The kinds of the plan's stages: what the calibration keeps a time factor for."""
    return {stage_kind(len(plan.stages), s.dp, s.op, plan.num_micro_batches) for s in plan.stages}


class Priced:
    """Points priced again under any factors: each one's workload built once, at the base profile."""

    def __init__(self, base: DeviceProfile, points: Sequence[Point]):
        self.base, self.points = base, list(points)
        self.workloads = [Workload.of(p.job, base, p.links) for p in self.points]

    def estimates(self, profile: DeviceProfile, index: Sequence[int]) -> list[Estimate]:
        return [estimate(dataclasses.replace(self.workloads[i], profile=profile, stage_costs={}), self.points[i].plan)
                for i in index]

    def errors(self, profile: DeviceProfile, index: Sequence[int]) -> np.ndarray:
        """|predicted / measured - 1| of the points' step times."""
        predicted = np.array([e.seconds for e in self.estimates(profile, index)])
        return np.abs(predicted / np.array([self.points[i].seconds for i in index]) - 1)


def fit(priced: Priced, index: Sequence[int], start: Calibration | None = None, prior: float = LEARNING_PRIOR
        ) -> tuple[dict[str, float], dict[str, float]]:
    """(COMPONENTS factors, plan kind factors) by least squares of the points' relative time
    error, each log factor drawn toward 0 (the base profile) by `prior`."""
    kinds = sorted(set().union(*(plan_kinds(priced.points[i].plan) for i in index)))
    names = [*COMPONENTS, *kinds]
    begun = {**dict(start.factors), **dict(start.plan_factors)} if start else {}
    bounds = np.log(FACTOR_BOUNDS)
    x0 = np.clip(np.log([begun.get(k, 1.0) for k in names]), bounds[0] + 1e-6, bounds[1] - 1e-6)
    observed = np.array([priced.points[i].seconds for i in index])

    def profile(x: np.ndarray) -> DeviceProfile:
        factors = np.exp(x)
        return with_factors(priced.base, dict(zip(COMPONENTS, factors)), dict(zip(kinds, factors[len(COMPONENTS):])))

    def residuals(x: np.ndarray) -> np.ndarray:
        predicted = np.array([e.seconds for e in priced.estimates(profile(x), index)])
        return np.concatenate([predicted / observed - 1, np.sqrt(prior) * x])

    found = np.exp(least_squares(residuals, x0, bounds=bounds, diff_step=1e-3).x).tolist()
    return dict(zip(COMPONENTS, found)), dict(zip(kinds, found[len(COMPONENTS):]))


def needed_memory(base: DeviceProfile, point: Point, found: Estimate) -> float | None:
    """The memory factor the point's measured peak needs (an oom attempt's: above the device's memory)."""
    peak = max(point.peak or 0.0, base.memory + 1.0) if point.status == OOM else point.peak
    return peak / found.peak_bytes if peak and found.peak_bytes > 0 else None


def point_bound(base: DeviceProfile, point: Point) -> float | None:
    """The memory factor the point alone needs: its peak within MEMORY_SLACK of its prediction or
    under it, an oom attempt's plan over the device's memory; None where it measured no peak. A
    bound raised by it covers the highest peak since the last refit, which takes it back to the
    quantile of them all (memory_bound)."""
    needed = needed_memory(base, point, estimate(Workload.of(point.job, base, point.links), point.plan))
    if needed is None:
        return None
    return float(np.clip(needed if point.status == OOM else needed / (1 + MEMORY_SLACK), *FACTOR_BOUNDS))


def memory_bound(base: DeviceProfile, points: Sequence[Point]) -> float:
    """The memory factor that puts MEMORY_QUANTILE of the points' peaks within MEMORY_SLACK of
    their prediction or under it, and every oom attempt's plan over the device's memory; 1
    without points."""
    priced = Priced(base, points).estimates(base, range(len(points)))
    needed = [(needed_memory(base, p, e), p.status == OOM) for p, e in zip(points, priced)]
    peaks = [x for x, oom in needed if x is not None and not oom]
    ooms = [x for x, oom in needed if x is not None and oom]
    if not peaks and not ooms:
        return 1.0
    covered = np.quantile(peaks, MEMORY_QUANTILE, method="higher") / (1 + MEMORY_SLACK) if peaks else 1.0
    return float(np.clip(max([covered, *ooms]), *FACTOR_BOUNDS))


def refit(base: DeviceProfile, points: Sequence[Point], current: Calibration | None, version: int,
          now: float, prior: float = LEARNING_PRIOR, evidence: float = EVIDENCE,
          window: int = REFIT_WINDOW) -> Calibration:
    """A new calibration of the base profile from the newest `window` timed comparable points
    (fitted_points), judged forward: a fit to all but the newest HELD_OUT of them prices those,
    against the current calibration (None: the base profile) on the same points; kept, fitted
    again to all of them, only when it errs less there by more than their steps' noise (the
    points it will price next are new ones, not a random fold of old ones; a gain within the
    noise is a calibration chasing it). The memory bound covers every point."""
    timed = fitted_points(points)[-window:]
    priced = Priced(base, [points[i] for i in timed])
    held_out = max(2, round(HELD_OUT * len(timed)))
    older, newest = range(len(timed) - held_out), range(len(timed) - held_out, len(timed))
    factors, kinds = fit(priced, older, current, prior)
    found = priced.errors(with_factors(base, factors, kinds), newest)
    previous = priced.errors(calibrated(base, current), newest)
    noise = steps_noise([points[i] for i in timed[len(older):]])
    accepted = errs_less(found, previous, evidence, noise)
    if accepted:
        factors, kinds = fit(priced, range(len(timed)), current, prior)
    return Calibration(version, profile_id(base), tuple(factors.items()), tuple(kinds.items()),
                       memory_bound(base, points), len(points), float(found.mean()), float(previous.mean()),
                       accepted, now, noise=noise)


def errs_less(found: np.ndarray, previous: np.ndarray, evidence: float = EVIDENCE, noise: float = 0.0) -> bool:
    """Whether the same points' errors are lower under `found` than under `previous` by more than
    `noise` (their steps' own, steps_noise), with `evidence` standard errors of their paired
    differences to spare."""
    differences = found - previous
    spread = differences.std(ddof=1) / np.sqrt(len(differences)) if len(differences) > 1 else 0.0
    return bool(differences.mean() + evidence * spread < -noise)


def steps_noise(points: Sequence[Point]) -> float:
    """The median noise the points' steps measured (0 where none did): what a rerun of one may
    move its time by, so no gain in error below it is evidence."""
    measured = [p.noise for p in points if p.noise is not None]
    return float(np.median(measured)) if measured else 0.0


def with_factors(base: DeviceProfile, factors: dict[str, float], kinds: dict[str, float]) -> DeviceProfile:
    """The base profile with COMPONENTS factors and plan kinds' time factors, as a fit found them."""
    return dataclasses.replace(scaled(base, factors), calibration=Calibrated(tuple(kinds.items())))


def raised(base: DeviceProfile, bound: float | None, current: Calibration | None, version: int,
           now: float) -> Calibration | None:
    """The current calibration under a higher memory bound (point_bound of a new point), where
    the point needs one: an under-predicted peak is an OOM, so the bound rises at once, without
    waiting for a refit."""
    if bound is None or bound <= (current.memory_factor if current else 1.0):
        return None
    if current is None:
        return Calibration(version, profile_id(base), tuple(dict.fromkeys(COMPONENTS, 1.0).items()), (), bound, 0,
                           0.0, 0.0, True, now, memory_only=True)
    return dataclasses.replace(current, version=version, memory_factor=bound, created=now, memory_only=True)
