"""GPU energy from NVML's cumulative per-device counters (as Zeus measures it).

Absent, not zero, wherever NVML or a GPU is missing: CPUs, laptops, CI.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

log = logging.getLogger(__name__)


def open_energy_meter(devices: Sequence) -> Callable[[], float] | None:
    """A function returning the joules the job's GPUs have used so far, or None."""
    if not devices or any(d.platform != "gpu" for d in devices):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        nvml_index = [int(v) for v in visible.split(",")] if visible else None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(
            nvml_index[d.local_hardware_id] if nvml_index else d.local_hardware_id) for d in devices]

        def joules() -> float:
            return sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1000.0

        joules()
        return joules
    except Exception as err:  # NVML missing, too old a GPU, a MIG slice: no energy figure
        log.info("no GPU energy counter: %s", err)
        return None
