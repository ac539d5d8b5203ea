"""GPU power limits a job runs under: set by its guard before the job body starts, and put back
by the guard however the job ends (see `run.guard`).

The executor hands the limits to the guard in LIMITS_ENV (job device id -> watts; job device i
is the i-th GPU of CUDA_VISIBLE_DEVICES); the guard tells the job body in APPLIED_ENV whether it
set them ("yes", or "no: <reason>"), and the job body records both (`record`). Setting a limit
needs NVML and root: elsewhere nothing is set and the job runs at the limits it finds.
Neither JAX nor Zeus is imported here: the guard must start in a moment.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Mapping

LIMITS_ENV = "CODESIGN_POWER_LIMITS"
APPLIED_ENV = "CODESIGN_POWER_APPLIED"


def limits_env(limits: Mapping[int, float] | None) -> dict[str, str]:
    """The environment entry carrying a job's limits to its guard (none without limits)."""
    return {LIMITS_ENV: json.dumps({str(d): float(w) for d, w in sorted(limits.items())})} if limits else {}


def read_limits(env: Mapping[str, str]) -> dict[int, float]:
    text = env.get(LIMITS_ENV)
    return {int(d): float(w) for d, w in json.loads(text).items()} if text else {}


def record(env: Mapping[str, str]) -> dict[str, Any] | None:
    """all_configs["power"] of a job given limits: which, whether the guard set them and, where
    it did not (or clamped them), why; None for a job given none."""
    limits = read_limits(env)
    if not limits:
        return None
    said = env.get(APPLIED_ENV, "no: the job ran without a guard to set them")
    answer, _, reason = said.partition(": ")
    return {"limits": {str(d): w for d, w in limits.items()}, "applied": answer == "yes", "reason": reason or None}


class PowerLimits:
    """Limits set through NVML, and the limits they replaced, put back by `restore`. restore may
    run from the lifeline's thread, the main thread, or a signal handler interrupting either:
    each device's previous limit is forgotten only once it has been set back."""

    def __init__(self, limits: Mapping[int, float], visible: str | None):
        self.limits = dict(limits)
        self.visible = visible_names(visible)
        self.previous: dict[str, tuple[Any, int]] = {}  # device name -> (NVML handle, milliwatts)
        self.lock = threading.RLock()
        self.nvml: Any = None

    def apply(self) -> str:
        """Set every limit (clamped to what the device allows): "yes" (with what was clamped),
        or "no: <reason>" with nothing left changed."""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception as err:  # no driver, no library: the job runs as it is
            return f"no: NVML is not available: {err}"
        notes = []
        try:
            for device, watts in sorted(self.limits.items()):
                notes += self._set(device, watts)
        except Exception as err:  # no permission (not root), a device NVML cannot limit
            self.restore()
            return f"no: {type(err).__name__}: {err}"
        return "yes" + (f": {'; '.join(notes)}" if notes else "")

    def _set(self, device: int, watts: float) -> list[str]:
        nvml = self.nvml
        name = visible_name(device, self.visible)
        handle = device_handle(nvml, name)
        low, high = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        wanted = round(watts * 1000)
        target = min(max(wanted, low), high)
        with self.lock:  # known before it changes, so that restore can never miss it
            self.previous.setdefault(name, (handle, nvml.nvmlDeviceGetPowerManagementLimit(handle)))
            nvml.nvmlDeviceSetPowerManagementLimit(handle, target)
        return [f"device {device} clamped to {target / 1000:g} W"] if target != wanted else []

    def restore(self) -> None:
        """Put back every limit changed; what fails is said on stderr and the rest still restored."""
        with self.lock:
            for name, (handle, milliwatts) in list(self.previous.items()):
                try:
                    self.nvml.nvmlDeviceSetPowerManagementLimit(handle, milliwatts)
                except Exception as err:
                    print(f"codesign guard: could not restore GPU {name}'s power limit to {milliwatts / 1000:g} W:"
                          f" {err}", file=sys.stderr, flush=True)
                self.previous.pop(name, None)


def visible_names(visible: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (None: unset, every GPU in NVML's order)."""
    return [v.strip() for v in visible.split(",")] if visible else None


def visible_name(device: int, visible: list[str] | None) -> str:
    """What CUDA_VISIBLE_DEVICES calls a process's device `device` (an index, a GPU-/MIG- UUID)."""
    return visible[device] if visible else str(device)


def device_handle(nvml: Any, name: str) -> Any:
    """NVML's handle of a device CUDA_VISIBLE_DEVICES names (NVML's indices ignore it)."""
    return nvml.nvmlDeviceGetHandleByIndex(int(name)) if name.isdigit() else nvml.nvmlDeviceGetHandleByUUID(name)


def from_env(env: Mapping[str, str] = os.environ) -> PowerLimits | None:
    """The guard's limits to set, from its environment; None when the job has none."""
    limits = read_limits(env)
    return PowerLimits(limits, env.get("CUDA_VISIBLE_DEVICES")) if limits else None
