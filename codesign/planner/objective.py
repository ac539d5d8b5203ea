"""What "best" means where a plan is chosen: the fastest (time), the least joules per iteration
(energy), or Zeus's cost, eta * energy + (1 - eta) * max power * time; energy and cost within
an optional slowdown of the fastest plan. Auto search, `codesign plan` and the co-design
ranking order their plans with `ranked`; `frontier` is the time-energy Pareto set they print."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from codesign.config.types import ParallelSpec
from codesign.planner import power_limits
from codesign.planner.space import Candidate, by_rank
from codesign.cost.workload import Workload

ENERGY_REACH = 1.6  # without a slowdown bound: plans whose default joules are within this of the least get the knob


@dataclass(frozen=True)
class Objective:
    name: str = "time"
    max_slowdown: float | None = None  # share of the fastest plan's time (0.05: 5%); None: any
    eta: float = 0.5  # cost: the weight of energy against time (Zeus's eta knob)

    def score(self, c: Candidate, max_watts: float) -> float:
        """Lower is better; max_watts: every device of the cluster at its highest power limit."""
        e = c.estimate
        if self.name == "time":
            return e.seconds
        if self.name == "energy":
            return e.energy
        return self.eta * e.energy + (1 - self.eta) * max_watts * e.seconds


TIME = Objective()


def of_spec(parallel: ParallelSpec) -> Objective:
    """An Auto search spec's objective (a manual spec's plan is as written: time)."""
    return Objective(parallel.objective, parallel.max_slowdown, parallel.eta)


def ranked(candidates: Iterable[Candidate], objective: Objective, max_watts: float,
           settings: Callable[[Candidate], Sequence[Candidate]]) -> list[Candidate]:
    """The candidates best first by the objective: those that fit and are fast enough (each at
    every power setting `settings` prices) by score, then the rest as by_rank orders them. Time
    keeps by_rank's order and every plan at its default power."""
    ordered = by_rank(candidates)
    if objective.name == "time" or not ordered or not ordered[0].estimate.fits:
        return ordered
    fitting = [c for c in ordered if c.estimate.fits and not math.isnan(c.estimate.energy)]
    if not fitting:
        return ordered
    slowest = _slowest(fitting, objective)
    least = min(c.estimate.energy for c in fitting)
    reach = [c for c in fitting if c.estimate.seconds <= slowest
             and (objective.max_slowdown is not None or c.estimate.energy <= ENERGY_REACH * least)]
    eligible = [s for c in reach for s in settings(c) if s.estimate.seconds <= slowest]
    best = sorted(eligible, key=lambda c: (objective.score(c, max_watts), c.estimate.seconds))
    chosen = {id(c) for c in reach}
    return best + [c for c in ordered if id(c) not in chosen]


def order(priced: Iterable[Candidate], objective: Objective, w: Workload) -> list[Candidate]:
    """ranked() of plans priced against one workload, at the power settings its device accepts."""
    power = w.profile.power
    max_watts = w.cluster.num_devices * (power.limits[1] or power.compute) if power else 0.0

    def settings(c: Candidate) -> list[Candidate]:
        return [Candidate(c.plan, e) for e in power_limits.settings(w, c.plan, c.estimate)]

    return ranked(priced, objective, max_watts, settings)


def _slowest(fitting: Sequence[Candidate], objective: Objective) -> float:
    """The longest iteration the objective accepts: the fastest plan's, slowed by max_slowdown."""
    if objective.max_slowdown is None:
        return math.inf
    return fitting[0].estimate.seconds * (1 + objective.max_slowdown)


def frontier(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The fitting candidates no other beats in both time and energy, fastest first."""
    points = sorted((c for c in candidates if c.estimate.fits and not math.isnan(c.estimate.energy)),
                    key=lambda c: (c.estimate.seconds, c.estimate.energy))
    seconds, joules = (np.array([getattr(c.estimate, k) for c in points], dtype=float) for k in ("seconds", "energy"))
    return [c for c, on in zip(points, pareto(-seconds, -joules)) if on]

def pareto(params: np.ndarray, samples_per_s: np.ndarray) -> np.ndarray:
    """Candidates no other matches on both parameters and samples/s with one of them higher (any
    two figures where more is better: also samples/s and samples/J). Equal candidates share a
    mark: neither beats the other."""
    ok = np.flatnonzero(np.isfinite(samples_per_s))
    order = ok[np.lexsort((-samples_per_s[ok], -params[ok]))]  # most parameters first, then fastest
    speed, size = samples_per_s[order], params[order]
    best_before = np.maximum.accumulate(np.concatenate([[-np.inf], speed]))[:-1]
    new = np.concatenate([[True], (size[1:] != size[:-1]) | (speed[1:] != speed[:-1])])
    first = np.maximum.accumulate(np.where(new, np.arange(len(order)), 0))  # each run of equals' first
    marked = np.zeros(len(params), dtype=bool)
    marked[order[(speed > best_before)[first]]] = True
    return marked
