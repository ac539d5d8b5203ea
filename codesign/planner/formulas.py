"""The cost model's value types and formulas: alpha-beta collectives, the roofline of one mixer
call, Adam and gradient accumulation as memory traffic. Pure Python; planner.cost feeds them."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from codesign.planner.device_profiles import DeviceProfile, Link, Points, interpolated

PARAM_BYTES = 4  # master weights, gradients and Adam's moments stay fp32 under bf16
ADAM_TRAFFIC = 8  # param-sized arrays read or written by one update: p, g, m, v in; p, m, v, zeroed g out
ACCUMULATE_TRAFFIC = 3  # gradient-sized arrays per accumulated micro-batch: its gradients and the sum in, the sum out
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2}


# -- value types -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Memory:
    """Peak bytes per device, by what holds them."""

    params: float = 0
    grads: float = 0
    adam: float = 0
    activations: float = 0  # what the in-flight micro-batches keep for their backward
    workspace: float = 0  # batch data, scratch of the largest program

    @property
    def total(self) -> float:
        return self.params + self.grads + self.adam + self.activations + self.workspace

    def as_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in ("params", "grads", "adam", "activations", "workspace")}


@dataclass(frozen=True)
class StageCost:
    """One stage per micro-batch (forward, backward), per iteration (update), and its memory."""

    forward: float
    backward: float
    update: float
    communication: dict[str, float]  # collective -> seconds per iteration, included in the above
    memory: Memory
    overheads: float = 0.0  # of forward and backward, the fixed costs per call (Compute.overheads)
    memory_bound: Any = 0.0  # seconds per iteration of memory traffic and fixed costs per call,
    # included in the above: the time a lower clock does not stretch (planner.power)

    def calibrated(self, time: float, memory: float) -> StageCost:
        """Its seconds times `time`, its bytes times `memory` (a calibration's factors, planner.learning)."""
        if time == 1 and memory == 1:
            return self
        held = Memory(*(getattr(self.memory, f.name) * memory for f in dataclasses.fields(Memory)))
        return dataclasses.replace(
            self, forward=self.forward * time, backward=self.backward * time, update=self.update * time,
            communication={k: v * time for k, v in self.communication.items()}, overheads=self.overheads * time,
            memory_bound=self.memory_bound * time, memory=held)


@dataclass(frozen=True)
class Estimate:
    """A priced plan: seconds per iteration with their breakdown, peak bytes per device."""

    seconds: float
    compute: tuple[float, ...]  # per stage: forward + backward of all its micro-batches
    communication: dict[str, float]  # per collective kind, summed over stages
    bubble: float  # the step's time the busiest stage waits
    optimizer: float
    memory: Memory  # of the stage with the highest peak
    device_memory: int
    energy: float = float("nan")  # joules per iteration, every device of the cluster (NaN: no power model)
    busy: tuple = ()  # per stage, a power.Busy: what its devices do, to price it under power limits
    devices: int = 0  # of the cluster, used by the plan or idle
    power_limits: tuple = ()  # watts per stage's devices the iteration is priced under; (): none set

    @property
    def peak_bytes(self) -> int:
        return int(self.memory.total)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device_memory

    def breakdown(self) -> dict[str, object]:
        """What all_configs and `codesign plan` show."""
        return {"seconds": self.seconds, "compute_per_stage": list(self.compute),
                "communication": dict(self.communication), "bubble": self.bubble,
                "optimizer": self.optimizer, "memory": self.memory.as_dict(),
                "peak_bytes": self.peak_bytes, "fits": self.fits, "energy": self.energy,
                "power_limits": list(self.power_limits)}


@dataclass(frozen=True)
class Compute:
    """One micro-batch's compute through some layers on a submesh, summed layer by layer before
    the stage's lockstep and remat (cost.finish). Fields are seconds, or arrays of them where many
    models are priced at once (planner.fast_pass)."""

    forward: Any = 0.0
    backward: Any = 0.0
    fixed: Any = 0.0  # the forward's fixed costs per call
    overheads: Any = 0.0  # the fixed costs per call of forward and backward
    all_reduce: Any = 0.0  # op's collectives: the outputs' all-reduce (batch on dp)
    all_gather: Any = 0.0  # or the weights' all-gather and reduce-scatter (batch on op)
    traffic: Any = 0.0  # of forward and backward, the seconds of memory traffic

    def __add__(self, other: Compute) -> Compute:
        return Compute(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple:
        return (self.forward, self.backward, self.fixed, self.overheads, self.all_reduce, self.all_gather,
                self.traffic)

    @property
    def communication(self) -> dict[str, Any]:
        return {"op all-reduce": self.all_reduce, "op all-gather": self.all_gather}


# -- formulas --------------------------------------------------------------------------------

def all_reduce(nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring all-reduce of nbytes in `calls` collectives: 2(n-1) steps each, and each device
    sends 2(n-1)/n of the bytes."""
    return 0.0 if n <= 1 else calls * 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def all_gather(nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring all-gather (or reduce-scatter) of nbytes in all: (n-1)/n of them through each device."""
    return 0.0 if n <= 1 else calls * (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


reduce_scatter = all_gather


def point_to_point(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


def hierarchical(collective, nbytes: float, hosts: int, per_host: int, intra: Link, inter: Link,
                 calls: int = 1) -> float:
    """A collective over hosts x per_host devices: inside each host first, then across hosts on
    the per-host share (1/per_host of the bytes)."""
    if hosts <= 1:
        return collective(nbytes, per_host, intra, calls)
    return collective(nbytes, per_host, intra, calls) + collective(nbytes / per_host, hosts, inter, calls)


def call_time(flops: float, rate: float, overhead: float, share: float = 1.0, points: Points = (),
              fixed_share: float | None = None) -> float:
    """One call's seconds: its fixed cost plus its FLOPs at the effective rate (or interpolated
    between measured points), slowed by the share of the device's speed it gets (virtual CPU
    devices share cores); the fixed cost at `fixed_share` where given (shared_cores.fixed_share)."""
    if points:
        return interpolated(points, flops, rate) / share
    return overhead / (fixed_share or share) + flops / rate / share


def adam_time(param_bytes: float, profile: DeviceProfile, share: float = 1.0) -> float:
    """Adam's update as memory traffic, at the share of the memory system its device gets (every
    busy device updates its parameters at once). Its launch is the step's (pp = 1: one program)
    or priced on the host's timeline (simulate): not again here."""
    return ADAM_TRAFFIC * param_bytes / (profile.bandwidth * share)


def accumulate_time(grad_bytes: float, profile: DeviceProfile, share: float, micro_batches: int) -> float:
    """Seconds per micro-batch adding its gradients into the accumulator (none for one micro-batch)."""
    return 0.0 if micro_batches == 1 else ACCUMULATE_TRAFFIC * grad_bytes / (profile.bandwidth * share)


def most(values: Iterable) -> Any:
    """max() of seconds or bytes, elementwise where they are arrays."""
    return functools.reduce(np.maximum, values)
