"""A GPU's power model, measured in the profile's timed loops: NVML's energy counter read over a
window of each loop (the largest matmuls: compute-bound; the stream: memory-bound; the largest
all-reduce: communication) and over a window of doing nothing.

NVML through pynvml (a core dependency, and what sets the guard's power limits), not Zeus (an
extra): Zeus's NVIDIA path reads this same counter. No JAX here: the sections hand over their
loops as calls, and the figures become a PowerModel by plain arithmetic (`power_model`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from codesign.engine.probe.parts import Parts
from codesign.gpu_power import device_handle, visible_name, visible_names
from codesign.hardware.datasheets import data_sheet
from codesign.hardware.profiles import PowerModel, data_sheet_power

log = logging.getLogger("codesign.profile")

BUSY_SECONDS = 0.5  # a busy window at least this long: NVML's counter moves every 20-100 ms
IDLE_SECONDS = 1.0  # the idle window
SHORTEST = 0.25  # seconds: a window cut shorter (MAX_CALLS) is too coarse to count
MAX_CALLS = 4096  # calls of a loop per window at most (a body too fast to fill one)
IDLE_CALL = 0.05  # seconds each idle call sleeps
FIGURES = ("idle", "compute", "memory", "communication")

Window = Sequence[float]  # (seconds, joules per busy device), as the parts file keeps it
WindowHook = Callable[[int, Callable[[], Any]], None]  # (loop index, a call of that loop's long run)


def measure_window(call: Callable[[], Any], joules: Callable[[], float], least: float,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(seconds, joules) over `call` repeated until the calls last `least` seconds (each call
    ends synchronised), or MAX_CALLS of them."""
    begin, start = joules(), clock()
    for _ in range(MAX_CALLS):
        call()
        seconds = clock() - start
        if seconds >= least:
            break
    return seconds, joules() - begin


class Meter:
    """NVML's energy counters of the local GPUs, in JAX's device order, and their power limits."""

    def __init__(self, nvml: Any, handles: Sequence[Any]):
        self.nvml, self.handles = nvml, list(handles)

    def joules(self, busy: int) -> float:
        """Joules counted so far by the first `busy` devices together (NVML counts millijoules)."""
        return sum(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles[:busy]) / 1000

    def window(self, call: Callable[[], Any], busy: int, least: float = BUSY_SECONDS) -> list[float]:
        """[seconds, joules per busy device] of calls of a loop that keeps the first `busy` busy."""
        seconds, joules = measure_window(call, functools.partial(self.joules, busy), least)
        return [seconds, joules / busy]

    def hook(self, windows: list, busy: int) -> WindowHook:
        """What a section's loop_times calls after timing each loop: its window, kept in `windows`."""
        return lambda index, call: windows.append(self.window(call, busy))

    def idle(self) -> list[float]:
        """A window of every device doing nothing (each loop ends synchronised: nothing is queued)."""
        return self.window(functools.partial(time.sleep, IDLE_CALL), len(self.handles), IDLE_SECONDS)

    def limits(self) -> tuple[float, float] | None:
        """(lowest, highest) power limit the first device accepts, in watts; None where unreadable."""
        try:
            low, high = self.nvml.nvmlDeviceGetPowerManagementLimitConstraints(self.handles[0])
        except Exception:  # a device without limits keeps the data sheet's
            return None
        return low / 1000, high / 1000


def open_meter(platform: str, ordinals: Sequence[int], visible: str | None) -> Meter | str:
    """A meter of the local devices (ordinals: JAX's local_hardware_id, CUDA's numbering within
    CUDA_VISIBLE_DEVICES, `visible`), or the one-line reason none can count."""
    if platform != "gpu":
        return f"no power counter on {platform} devices"
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # no driver, no library: the data sheet prices
        return f"NVML is not available: {err}"
    names = [visible_name(o, visible_names(visible)) for o in ordinals]
    if any(name.startswith("MIG-") for name in names):
        return "a MIG slice: NVML counts the whole GPU's energy, not the slice's"
    try:
        handles = [device_handle(pynvml, name) for name in names]
        if any(mig_enabled(pynvml, h) for h in handles):
            return "the GPU is in MIG mode: NVML counts every slice's energy together"
        meter = Meter(pynvml, handles)
        meter.joules(len(handles))
    except Exception as err:  # a GPU older than Volta has no energy counter
        return f"NVML reads no energy counter here: {err}"
    return meter


def mig_enabled(nvml: Any, handle: Any) -> bool:
    """Whether the GPU is split into MIG slices (its counter is then the slices' together)."""
    try:
        return bool(nvml.nvmlDeviceGetMigMode(handle)[0])
    except Exception:  # GPUs without MIG do not support the query
        return False


def idle_windows(meter: Meter | str) -> list[Window]:
    return [meter.idle()] if isinstance(meter, Meter) else []


def measured_power(kind: str, windows: Mapping[str, Sequence[Window]], meter: Meter | str) -> PowerModel | None:
    """The profile's power model, said in one line: the windows', else the data sheet's (a
    device kind without one, such as a CPU, gets none: `with_power` fills what it can)."""
    sheet = data_sheet(kind)
    power = power_model(windows, meter.limits() if isinstance(meter, Meter) else None,
                        data_sheet_power(sheet) if sheet else None)
    log.info("  power: %s", described(power, windows, meter if isinstance(meter, str) else None))
    return power


def metered(parts: Parts, name: str, measure: Callable[[WindowHook | None], Any], meter: Meter | str,
            busy: int) -> tuple[Any, list[Window]]:
    """A section's figures (measure's, given a hook for its loops' windows) and its energy
    windows, each kept in the parts file ("NAME energy" beside NAME)."""
    windows: list[Window] = []
    found = parts.get(name, lambda: measure(meter.hook(windows, busy) if isinstance(meter, Meter) else None))
    if f"{name} energy" not in parts.data:  # measured now (or resumed from a section kept alone: none)
        parts.keep(f"{name} energy", windows)
    return found, parts.data[f"{name} energy"]


def watts(windows: Sequence[Window]) -> float | None:
    """The highest draw per device among the windows long enough to count; None without one."""
    counted = [joules / seconds for seconds, joules in windows if seconds >= SHORTEST and joules > 0]
    return max(counted) if counted else None


def power_model(windows: Mapping[str, Sequence[Window]], limits: tuple[float, float] | None,
                fallback: PowerModel | None) -> PowerModel | None:
    """The device's power model from its windows (FIGURES -> windows), the limits NVML reports and,
    for what no window measured, `fallback` (the data sheet's); the fallback itself where nothing
    was measured. Without a data sheet, unmeasured collectives draw as memory-bound work, and
    the floor is the idle draw (PowerModel's 0)."""
    found = {figure: watts(windows.get(figure, ())) for figure in FIGURES}
    if all(w is None for w in found.values()):
        return fallback
    if fallback is None and any(found[f] is None for f in ("idle", "compute", "memory")):
        return None
    idle, compute, memory = (found[f] or getattr(fallback, f) for f in ("idle", "compute", "memory"))
    communication = found["communication"] or (fallback.communication if fallback else memory)
    floor = fallback.floor if fallback and fallback.floor < min(compute, memory) else 0.0
    return PowerModel(idle, compute, memory, communication,
                      limits or (fallback.limits if fallback else (0.0, 0.0)), floor, source="measured")


def described(power: PowerModel | None, windows: Mapping[str, Sequence[Window]], reason: str | None) -> str:
    """The profile's one line on power: watts per device and what no window measured, or why
    nothing was measured."""
    if power is None or power.source != "measured":
        model = f"the {power.source}'s model" if power else "none in the profile"
        return f"not measured ({reason or 'no energy window long enough to count'}): {model}"
    unmeasured = [f for f in FIGURES if watts(windows.get(f, ())) is None] + ["floor"]
    figures = ", ".join(f"{f} {getattr(power, f):.0f} W" for f in (*FIGURES, "floor"))
    return (f"{figures} per device; limits {power.limits[0]:g}-{power.limits[1]:g} W; "
            f"not measured: {', '.join(unmeasured)}")
