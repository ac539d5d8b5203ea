"""Pricing devices that share cores: virtual CPU devices, and the host launching their programs,
run on one machine's cores and memory system.

Every term the cost model adds or scales for them lives here, each behind the one condition
`DeviceProfile.shares_cores`. Devices of their own (GPUs) get the identity from every function:
their prices never depend on this module's figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from codesign.planner.device_profiles import DeviceProfile

if TYPE_CHECKING:  # cost imports this module; these are only its types
    from codesign.planner.cost import StageCost
    from codesign.planner.plan import Plan
    from codesign.planner.power import Busy


def fixed_share(p: DeviceProfile, busy: int, op: int) -> float:
    """Each of `busy` devices' speed for the fixed costs per call of a program on an op group of
    `op` devices. On shared cores those costs (thread wake-ups, each op's dispatch) overlap on
    the host's cores where the devices meet at op's collectives, not where they run
    independently as the speed-up probe's do; elsewhere they run at the devices' share."""
    share = p.share(busy)
    if op > 1 and p.shares_cores and p.cores:
        return max(share, min(1.0, p.cores / busy))
    return share


def memory_share(p: DeviceProfile, busy: int) -> float:
    """Each of `busy` devices' share of the memory system: virtual CPU devices share one (an Adam
    update over 8 devices' replicas takes 8 times one's), GPUs each have their own."""
    return 1.0 / busy if p.shares_cores and busy > 1 else 1.0


def call_cost(p: DeviceProfile, devices: int) -> float:
    """The host's seconds to launch one program on `devices` devices: on shared cores one
    execution per device; GPUs' launches are asynchronous, one per program."""
    return p.dispatch * (devices if p.shares_cores else 1)


def lockstep(p: DeviceProfile, op: int) -> float:
    """How much longer a stage's compute takes when its devices meet at op's collectives between
    its computations, on cores they share: each op group waits at every one for its slowest
    device, so the devices cannot fill each other's stalls as independent ones do (dp 2 x op 2
    against dp 4, and dp 4 x op 2, dp 2 x op 4 against dp 8, on virtual CPU devices). Devices of
    their own lose nothing here; their collectives are priced as such."""
    return 1.0 + p.lockstep * (op - 1) if p.shares_cores else 1.0


def remat_fixed(p: DeviceProfile, fixed):
    """The forward's fixed costs a recomputing backward does not pay again: on shared cores the
    recomputation runs inside the backward's own program; a GPU launches its kernels again."""
    return fixed if p.shares_cores else 0.0


def program_overheads(p: DeviceProfile, overheads):
    """Of a micro-batch's fixed costs per call (forward and backward), what a fused step of several
    micro-batches pays once: on shared cores they are costs of running a program (the probe's
    intercept: its thread pool, its buffers), paid once however many micro-batches its loop
    accumulates; a GPU pays them per kernel launch, every micro-batch."""
    return overheads if p.shares_cores else 0.0


def copies(p: DeviceProfile, nbytes, busy: int):
    """Seconds to move nbytes through the memory system, each of `busy` devices at its share: the
    copies XLA:CPU makes around its collectives (profile.sync_traffic, 0 on a GPU)."""
    return nbytes / (p.bandwidth * memory_share(p, busy))


def pipeline_floor(p: DeviceProfile, plan: Plan, stages: Sequence[StageCost], busy: int,
                   host: float = 0.0) -> float:
    """A pipeline on shared cores is no faster than all its stages' work packed onto their
    aggregate speed (each stage's seconds with every device busy, weighted by its share of the
    devices) plus the `host` seconds of its launches, which run on the same cores. Its stages' many
    small programs, each waking its devices' threads while the others' run, do not pack
    perfectly: the work takes 1 + contention x (busy - 1) times its packed seconds. On devices of
    their own it never binds: 0."""
    if not p.shares_cores:
        return 0.0
    return packed_bound(plan, stages, busy, host, p.contention)


def packed_bound(plan: Plan, stages: Sequence[StageCost], busy: int, host: float = 0.0,
                 contention: float = 0.0) -> float:
    """pipeline_floor's figure for any profile (what it is on shared cores)."""
    packed = sum(len(stage.device_ids) / busy * (plan.num_micro_batches * (c.forward + c.backward) + c.update)
                 for stage, c in zip(plan.stages, stages))
    return host + (1 + contention * (busy - 1)) * packed


def host_energy(p: DeviceProfile, stages: Sequence[Busy], seconds):
    """Joules of an iteration on shared cores: the host draws its idle watts throughout and its
    busy watts (by what its devices do) while any stage works, its stages' seconds packed onto
    the iteration's (they share the cores, so together they are busy at most all of it). The
    power model is the host's, not a device's. None on devices of their own."""
    if not p.shares_cores:
        return None
    power = p.power
    busy = sum(s.seconds for s in stages)
    extra = sum((power.compute - power.idle) * s.compute + (power.memory - power.idle) * s.memory
                + (power.communication - power.idle) * s.communication for s in stages)
    packed = np.minimum(1.0, seconds / np.maximum(busy, 1e-30))
    return power.idle * seconds + extra * packed
