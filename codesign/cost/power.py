"""Joules of an iteration, and what a power limit does to its time and joules.

A device draws its PowerModel's watts by what it does (compute-bound, memory- or launch-bound,
in collectives) while busy, and its idle watts the rest of the iteration: bubbles, waits for
other stages, devices the plan leaves unused. A power limit lowers the clock until the work's
draw fits under it: a busy device's floor (its draw at the lowest clock) plus the rest, which
goes as the cube of the clock (C V^2 f, the voltage following the clock across the DVFS range).
Compute-bound time grows as 1 / clock; memory-bound time barely moves (MEMORY_CLOCK_SHARE of
it follows the clock); collectives keep theirs. Pure arithmetic; at no limit, fields may be
numpy arrays (the co-design ranking prices many models at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from codesign.hardware.device import Devices
from codesign.hardware.profiles import DeviceProfile, PowerModel

CLOCK_EXPONENT = 3.0
LOWEST_CLOCK = 0.3  # of the highest: below it a limit no longer lowers the draw
MEMORY_CLOCK_SHARE = 0.2  # of memory-bound time, what stretches with 1 / clock


@dataclass(frozen=True)
class Busy:
    """One stage's devices in an iteration: how many, and the seconds each spends on each kind
    of work (the rest of the iteration it idles)."""

    devices: int
    compute: Any
    memory: Any
    communication: Any

    @property
    def seconds(self) -> Any:
        return self.compute + self.memory + self.communication


def clock_at(power: PowerModel, watts: float, limit: float | None) -> float:
    """The clock (1: full) at which work drawing `watts` at full clock stays under `limit`."""
    if limit is None or limit >= watts:
        return 1.0
    floor = power.floor or power.idle
    share = max(limit - floor, 0.0) / (watts - floor)
    return max(LOWEST_CLOCK, share ** (1 / CLOCK_EXPONENT))


def draw(power: PowerModel, watts: float, clock: float) -> float:
    """Watts of work drawing `watts` at full clock, run at `clock`."""
    floor = power.floor or power.idle
    return floor + (watts - floor) * clock ** CLOCK_EXPONENT


def stretched(power: PowerModel, busy: Busy, limit: float | None) -> Busy:
    """The stage's busy seconds under a power limit."""
    compute, memory = clock_at(power, power.compute, limit), clock_at(power, power.memory, limit)
    return Busy(busy.devices, busy.compute / compute,
                busy.memory * (1 + MEMORY_CLOCK_SHARE * (1 / memory - 1)), busy.communication)


def device_joules(power: PowerModel, busy: Busy, seconds: Any, limit: float | None = None) -> Any:
    """One device of the stage over an iteration of `seconds`, under `limit` (None: none)."""
    run = stretched(power, busy, limit)
    idle = np.maximum(seconds - run.seconds, 0.0)
    compute = draw(power, power.compute, clock_at(power, power.compute, limit))
    memory = draw(power, power.memory, clock_at(power, power.memory, limit))
    talk = power.communication if limit is None else min(power.communication, limit)
    return compute * run.compute + memory * run.memory + talk * run.communication + power.idle * idle


def iteration_joules(hw: Devices, stages: Sequence[Busy], seconds: Any, devices: int,
                     limits: Sequence[float | None] | None = None) -> Any:
    """Every device of the cluster over one iteration: each stage's devices busy and idle, the
    devices no stage uses idle throughout; NaN where the profile has no power model."""
    power = hw.profile.power
    if power is None:
        return np.nan * seconds
    shared = hw.host_energy(stages, seconds)
    if shared is not None:
        return shared
    limits = limits or [None] * len(stages)
    unused = devices - sum(s.devices for s in stages)
    return (sum(s.devices * device_joules(power, s, seconds, limit) for s, limit in zip(stages, limits))
            + unused * power.idle * seconds)


def can_limit(profile: DeviceProfile) -> bool:
    """Whether the device accepts power limits at all (GPUs; not virtual CPU devices)."""
    return profile.power is not None and profile.power.limits[1] > 0 and not profile.shares_cores
