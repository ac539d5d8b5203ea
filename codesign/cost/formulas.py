"""The cost model's value types, and the traffic of Adam and gradient accumulation in param-sized
arrays. Pure Python; cost.model fills them from the hardware's answers (hardware.device)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np


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
    # included in the above: the time a lower clock does not stretch (cost.power)

    def calibrated(self, time: float, memory: float) -> StageCost:
        """Its seconds times `time`, its bytes times `memory` (a calibration's factors, cost.learning)."""
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


# -- helpers ---------------------------------------------------------------------------------

def most(values: Iterable) -> Any:
    """max() of seconds or bytes, elementwise where they are arrays."""
    return functools.reduce(np.maximum, values)
