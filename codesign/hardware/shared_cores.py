"""Devices that share cores: virtual CPU devices, and the host launching their programs, run on
one machine's cores and memory system.

One implementation of the hardware interface (hardware.device.Devices): every term the cost
model adds or scales for shared cores is an answer here, where devices of their own answer with
the identity. Their collectives are XLA:CPU's rings over the profile's local link.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from codesign.hardware import collectives
from codesign.hardware.device import Devices


class SharedCores(Devices):
    shares_cores = True

    def fixed_share(self, busy: int, op: int) -> float:
        """Each of `busy` devices' speed for the fixed costs per call of a program on an op group of
        `op` devices: those costs (thread wake-ups, each op's dispatch) overlap on the host's
        cores where the devices meet at op's collectives, not where they run independently as
        the speed-up probe's do; elsewhere they run at the devices' share."""
        p, share = self.profile, self.profile.share(busy)
        if op > 1 and p.shared.cores:
            return max(share, min(1.0, p.shared.cores / busy))
        return share

    def memory_share(self, busy: int) -> float:
        """Each of `busy` devices' share of the one memory system (an Adam update over 8 devices'
        replicas takes 8 times one's)."""
        return 1.0 / busy if busy > 1 else 1.0

    def call_cost(self, devices: int) -> float:
        """The host's seconds to launch one program: one execution per device."""
        return self.profile.dispatch * devices

    def lockstep(self, op: int) -> float:
        """How much longer a stage's compute takes when its devices meet at op's collectives
        between its computations: each op group waits at every one for its slowest device, so
        the devices cannot fill each other's stalls as independent ones do (dp 2 x op 2 against
        dp 4, and dp 4 x op 2, dp 2 x op 4 against dp 8, on virtual CPU devices)."""
        return 1.0 + self.profile.shared.lockstep * (op - 1)

    def remat_fixed(self, fixed: Any) -> Any:
        """The recomputation runs inside the backward's own program: its fixed costs are not paid again."""
        return fixed

    def program_overheads(self, overheads: Any) -> Any:
        """Costs of running a program (the probe's intercept: its thread pool, its buffers), paid
        once however many micro-batches its loop accumulates."""
        return overheads

    def pipeline_floor(self, plan: Any, stages: Sequence[Any], busy: int, host: float = 0.0) -> float:
        """A pipeline is no faster than all its stages' work packed onto their aggregate speed plus
        the `host` seconds of its launches, which run on the same cores. Its stages' many small
        programs, each waking its devices' threads while the others' run, do not pack perfectly:
        the work takes 1 + contention x (busy - 1) times its packed seconds."""
        return packed_bound(plan, stages, busy, host, self.profile.shared.contention)

    def host_energy(self, stages: Sequence[Any], seconds: Any) -> Any:
        """Joules of an iteration: the host draws its idle watts throughout and its busy watts (by
        what its devices do) while any stage works, its stages' seconds packed onto the
        iteration's (they share the cores, so together they are busy at most all of it). The
        power model is the host's, not a device's."""
        power = self.profile.power
        busy = sum(s.seconds for s in stages)
        extra = sum((power.compute - power.idle) * s.compute + (power.memory - power.idle) * s.memory
                    + (power.communication - power.idle) * s.communication for s in stages)
        packed = np.minimum(1.0, seconds / np.maximum(busy, 1e-30))
        return power.idle * seconds + extra * packed

    def collective(self, kind: str, nbytes: Any, hosts: int, per_host: int, calls: Any = 1) -> Any:
        """Rings over the local link: inside each host first, then across hosts on the per-host
        share (1/per_host of the bytes)."""
        inside = collectives.ring(kind, nbytes, per_host, self.intra, calls)
        if hosts <= 1:
            return inside
        return inside + collectives.ring(kind, nbytes / per_host, hosts, self.inter, calls)

    def within_host_source(self) -> str:
        return f"rings over the profile's link {self.intra}"

    def point_to_point(self, nbytes: Any, across_hosts: bool, senders: int = 1) -> Any:
        link = self.inter if across_hosts else self.intra
        return link.latency + nbytes / link.bandwidth


def packed_bound(plan: Any, stages: Sequence[Any], busy: int, host: float = 0.0, contention: float = 0.0) -> float:
    """pipeline_floor's figure for any profile: each stage's seconds with every device busy,
    weighted by its share of the devices, plus the host's launches."""
    packed = sum(len(stage.device_ids) / busy * (plan.num_micro_batches * (c.forward + c.backward) + c.update)
                 for stage, c in zip(plan.stages, stages))
    return host + (1 + contention * (busy - 1)) * packed
