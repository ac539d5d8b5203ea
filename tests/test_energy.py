"""Energy of the timed steps through Zeus: the figures where a counter reads, null with the reason
where none can (this VM: no GPU, no RAPL), and never a failed job for want of a counter."""

import dataclasses
import os
import sys

import pytest

from codesign.engine import energy
from codesign.engine.energy import NO_RAPL, NO_ZEUS, Energy, Meter, open_meter


@dataclasses.dataclass
class Device:
    platform: str
    local_hardware_id: int = 0


@dataclasses.dataclass
class Window:
    time: float
    gpu_energy: dict
    cpu_energy: dict | None = None


class FakeMonitor:
    def __init__(self, window: Window):
        self.window, self.open = window, []

    def begin_window(self, key, sync_execution=True):
        self.open.append(key)

    def end_window(self, key, sync_execution=True):
        assert self.open.pop() == key
        return self.window


def test_gpu_joules_per_iteration_and_watts_per_device():
    meter = Meter(FakeMonitor(Window(2.0, {0: 500.0, 1: 700.0})), "zeus:nvml", devices=2)
    meter.begin()
    reading = meter.end(steps=4)
    assert reading == Energy("zeus:nvml", 300.0, 300.0)
    assert reading.metrics() == {"energy_per_iter": 300.0, "avg_power": 300.0, "energy_source": "zeus:nvml",
                                 "energy": {"source": "zeus:nvml", "joules_per_iter": 300.0,
                                            "watts_per_device": 300.0, "reason": None}}


def test_rapl_packages_are_the_jobs_and_their_watts_are_shared_by_the_virtual_devices():
    meter = Meter(FakeMonitor(Window(4.0, {}, {0: 160.0, 1: 160.0})), "zeus:rapl", devices=8)
    meter.begin()
    assert meter.end(steps=8) == Energy("zeus:rapl", 40.0, 10.0)


def test_a_window_that_counted_nothing_is_null_with_the_reason():
    meter = Meter(FakeMonitor(Window(1.0, {})), "zeus:nvml", devices=1)
    meter.begin()
    reading = meter.end(steps=3)
    assert (reading.joules_per_iter, reading.watts_per_device) == (None, None)
    assert reading.reason == "zeus:nvml counted no energy over 1 s"


@pytest.mark.skipif(os.path.exists("/sys/class/powercap/intel-rapl"), reason="this machine exposes RAPL")
def test_without_rapl_a_cpu_job_has_no_counter_and_says_why():
    """No RAPL (this VM): the job's reading is null, with the reason."""
    pytest.importorskip("zeus")
    reading = open_meter([Device("cpu"), Device("cpu")])
    reading.begin()
    found = reading.end(steps=3)
    assert (found.source, found.joules_per_iter, found.watts_per_device) == (None, None, None)
    assert found.reason == NO_RAPL


def test_without_zeus_the_reading_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "zeus.device", None)  # import fails as if not installed
    meter = open_meter([Device("gpu")])
    meter.begin()
    assert meter.end(steps=2) == Energy(reason=NO_ZEUS)
    assert NO_ZEUS == "zeus is not installed (pip install 'codesign[energy]')"


def test_a_platform_zeus_cannot_read_has_no_meter():
    assert open_meter([Device("tpu")]).end(1) == Energy(reason="no energy counter for tpu devices")


def test_a_counter_that_fails_mid_run_costs_the_figure_not_the_job():
    class Broken(FakeMonitor):
        def end_window(self, key, sync_execution=True):
            raise OSError("NVML lost the GPU")

    meter = Meter(Broken(Window(1.0, {})), "zeus:nvml", devices=1)
    meter.begin()
    assert meter.end(2) == Energy("zeus:nvml", reason="zeus:nvml failed to read: NVML lost the GPU")


def test_gpu_sources_name_zeus_managers():
    assert energy.GPU_SOURCES == {"NVIDIAGPUs": "zeus:nvml", "AMDGPUs": "zeus:amdsmi"}
    pytest.importorskip("zeus")
    from zeus.device.gpu.nvidia import NVIDIAGPUs

    assert NVIDIAGPUs.__name__ in energy.GPU_SOURCES
