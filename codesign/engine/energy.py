"""Energy of the timed steps, measured with Zeus (the `energy` extra): NVIDIA GPUs through NVML,
AMD GPUs through amdsmi, CPUs through RAPL.

Absent, not zero, wherever nothing can measure (no Zeus, no GPU counter, no RAPL): the figures
are None and the reading says why in one line, so a CPU sweep records null energy and goes on.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Sequence

log = logging.getLogger(__name__)
NO_ZEUS = "zeus is not installed (pip install 'codesign[energy]')"
NO_RAPL = "this machine exposes no RAPL energy counters (/sys/class/powercap)"
WINDOW = "codesign-timed-steps"
GPU_SOURCES = {"NVIDIAGPUs": "zeus:nvml", "AMDGPUs": "zeus:amdsmi"}  # Zeus's GPU managers


@dataclass(frozen=True)
class Energy:
    """What the timed steps used: all_configs["energy"], and the attempt's energy columns."""

    source: str | None = None
    joules_per_iter: float | None = None
    watts_per_device: float | None = None
    reason: str | None = None  # why the figures are None

    def metrics(self) -> dict[str, Any]:
        return {"energy_per_iter": self.joules_per_iter, "avg_power": self.watts_per_device,
                "energy_source": self.source, "energy": asdict(self)}


class Meter:
    """A Zeus monitor over the job's devices on this process, or, where none can be opened, the
    reason every reading gives. On virtual CPU devices RAPL counts whole packages: the packages'
    joules are taken as the job's (it is the only work the packages do that it waits for), and
    each device gets an equal share of their watts."""

    def __init__(self, monitor: Any = None, source: str | None = None, devices: int = 0, reason: str | None = None):
        self.monitor, self.source, self.devices, self.reason = monitor, source, devices, reason

    def begin(self) -> None:
        # Zeus's own sync asks JAX for a CPU device, which a GPU job's JAX_PLATFORMS leaves out;
        # every timed step already ends synchronised.
        if self.monitor is not None:
            self.monitor.begin_window(WINDOW, sync_execution=False)

    def end(self, steps: int) -> Energy:
        if self.monitor is None:
            return Energy(reason=self.reason)
        try:
            window = self.monitor.end_window(WINDOW, sync_execution=False)
        except Exception as err:  # a counter that fails mid-run costs the figure, not the job
            return Energy(self.source, reason=f"{self.source} failed to read: {err}")
        counted = window.gpu_energy if self.source != "zeus:rapl" else window.cpu_energy or {}
        if not counted or window.time <= 0 or steps <= 0:
            return Energy(self.source, reason=f"{self.source} counted no energy over {window.time:.3g} s")
        joules = float(sum(counted.values()))
        return Energy(self.source, joules / steps, joules / window.time / self.devices)


def open_meter(devices: Sequence) -> Meter:
    """A meter of the job's devices on this process (JAX devices, all of one platform)."""
    platform = devices[0].platform if devices else None
    if platform not in ("gpu", "cpu"):
        return Meter(reason=f"no energy counter for {platform or 'no'} devices")
    try:  # zeus.device is light; zeus.monitor imports scikit-learn, so only once a counter exists
        source = _gpu_source() if platform == "gpu" else _rapl_source()
        from zeus.monitor import ZeusMonitor

        if platform == "gpu":
            monitor = ZeusMonitor(gpu_indices=[d.local_hardware_id for d in devices], cpu_indices=[],
                                  approx_instant_energy=True, sync_execution_with="jax")
        else:
            monitor = ZeusMonitor(gpu_indices=[], sync_execution_with="jax")
    except ModuleNotFoundError as err:
        return Meter(reason=NO_ZEUS if (err.name or "").split(".")[0] == "zeus" else str(err))
    except Exception as err:  # whatever keeps Zeus from counting, the job still runs
        log.info("no energy meter: %s", err)
        return Meter(reason=str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    return Meter(monitor, source, len(devices))


def _gpu_source() -> str:
    """Zeus's reader of this machine's GPUs; raises with the reason where it has none."""
    from zeus.device import get_gpus

    try:
        gpus = get_gpus()
    except Exception as err:
        raise RuntimeError(f"Zeus can read no GPU here (NVML, amdsmi): {err}") from err
    return GPU_SOURCES.get(type(gpus).__name__, f"zeus:{type(gpus).__name__}")


def _rapl_source() -> str:
    """RAPL through Zeus; raises with the reason where this machine exposes none or hides it."""
    from zeus.device import get_cpus
    from zeus.device.cpu.common import ZeusCPUInitError

    try:
        cpus = get_cpus()
    except ZeusCPUInitError as err:
        raise RuntimeError(NO_RAPL) from err
    except Exception as err:  # RAPL is there, but this user may not read it
        raise RuntimeError(f"RAPL energy counters are not readable here: {err}") from err
    if not len(cpus):
        raise RuntimeError(NO_RAPL)
    return "zeus:rapl"
