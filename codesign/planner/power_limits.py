"""The power knob: a priced plan again under GPU power limits, one for every device (as Zeus
sets it) or one per pipeline stage (Perseus's per-stage frequencies, set as limits).

A limit stretches each stage's compute-bound seconds (cost.power); a pipeline's iteration is
simulated again with its stages stretched (cost.timeline), so a stage off the critical path
slows into its bubbles for free. Per-stage limits are searched stage by stage, a step at a
time, keeping each step that saves joules without lengthening the iteration: with a handful of
stages and steps, the schedule's own simulation is the exact judge (a DAG solver such as
lowtime would need the schedule restated as its graph).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from codesign.cost.model import Workload, plan_stage
from codesign.cost.formulas import Estimate, StageCost
from codesign.cost.plan import Plan
from codesign.cost.power import can_limit, iteration_joules, stretched
from codesign.cost.timeline import simulate

PLAN_WIDE_STEPS = 6  # plan-wide limits priced, evenly from the highest to the lowest
STAGE_STEPS = 12  # per-stage limits a stage may step down through, highest first
KEEP_TIME = 1e-3  # per-stage limits may lengthen the iteration by at most this share (rounding)


def under_limits(w: Workload, plan: Plan, found: Estimate, limits: Sequence[float]) -> Estimate:
    """The plan's estimate with each stage's devices under its power limit (watts)."""
    power = w.profile.power
    stretch = [stretched(power, b, limit) for b, limit in zip(found.busy, limits)]
    if len(plan.stages) == 1:
        seconds = found.seconds + stretch[0].compute - found.busy[0].compute
    else:
        n = sum(len(s.device_ids) for s in plan.stages)
        slower = [_slowed(plan_stage(w, plan, s, n), new.seconds / old.seconds if old.seconds else 1.0)
                  for s, (new, old) in enumerate(zip(stretch, found.busy))]
        seconds = max(simulate(w, plan, slower)[0])
    energy = iteration_joules(w.hw, found.busy, seconds, found.devices, limits)
    return dataclasses.replace(found, seconds=float(seconds), energy=float(energy), power_limits=tuple(limits))


def _slowed(cost: StageCost, factor: float) -> StageCost:
    return dataclasses.replace(cost, forward=cost.forward * factor, backward=cost.backward * factor,
                               update=cost.update * factor)


def plan_wide(w: Workload, plan: Plan, found: Estimate) -> list[Estimate]:
    """The plan under each of a few limits for all its devices (the highest is the default)."""
    low, high = w.profile.power.limits
    return [under_limits(w, plan, found, [limit] * len(plan.stages))
            for limit in np.linspace(high, low, PLAN_WIDE_STEPS)[1:]]


def per_stage(w: Workload, plan: Plan, found: Estimate) -> Estimate | None:
    """The least-energy per-stage limits that leave the iteration as long as it was (within
    KEEP_TIME); None for one stage, or where no stage can slow for free."""
    if len(plan.stages) == 1:
        return None
    low, high = w.profile.power.limits
    steps = np.linspace(high, low, STAGE_STEPS)
    level = [0] * len(plan.stages)
    best, longest = found, found.seconds * (1 + KEEP_TIME)
    order = np.argsort([b.seconds for b in found.busy])  # the most idle stage first
    moved = True
    while moved:
        moved = False
        for s in order:
            if level[s] + 1 == STAGE_STEPS:
                continue
            trial = [*level[:s], level[s] + 1, *level[s + 1:]]
            priced = under_limits(w, plan, found, [float(steps[i]) for i in trial])
            if priced.seconds <= longest and priced.energy < best.energy:
                level, best, moved = trial, priced, True
    return best if best is not found else None


def settings(w: Workload, plan: Plan, found: Estimate) -> list[Estimate]:
    """The plan at its default power and at each setting of the knob the device accepts."""
    if not can_limit(w.profile) or not found.busy:
        return [found]
    stages = per_stage(w, plan, found)
    return [found, *plan_wide(w, plan, found), *([stages] if stages else [])]


def by_device(plan: Plan, found: Estimate) -> dict[int, float]:
    """The limits a job runs its plan under, per job device id ({}: the devices' defaults)."""
    return {d: float(limit) for stage, limit in zip(plan.stages, found.power_limits) for d in stage.device_ids}
