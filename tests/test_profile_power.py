"""The power model `codesign profile` measures on a GPU (engine/probe/power.py): energy windows of
its timed loops turned into a PowerModel, with the data sheet's figures for what no window
measured; the window loop's bounds and NVML's counters against fakes (no GPU here)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from codesign.engine.probe import power as probe_power
from codesign.engine.probe.parts import Parts
from codesign.engine.probe.power import (
    BUSY_SECONDS,
    MAX_CALLS,
    Meter,
    measure_window,
    metered,
    open_meter,
    power_model,
)
from codesign.hardware.datasheets import DATA_SHEETS, data_sheet
from codesign.hardware.profiles import DeviceProfile, PowerModel, data_sheet_power
from tests.conftest import REPO

H100 = data_sheet_power(DATA_SHEETS["H100"])  # idle 80, compute 700, memory 455, communication 315, floor 175
WINDOWS = {"idle": [[1.0, 85.0]], "compute": [[0.5, 340.0], [0.6, 390.0]], "memory": [[0.5, 210.0]]}


def test_windows_become_watts_per_device_and_the_data_sheet_fills_what_none_measured():
    power = power_model(WINDOWS, (200.0, 700.0), H100)
    assert power == PowerModel(idle=85.0, compute=680.0, memory=420.0, communication=315.0, limits=(200.0, 700.0),
                               floor=175.0, source="measured")  # compute: the higher of the two precisions
    assert power_model({**WINDOWS, "communication": [[0.5, 150.0]]}, None, H100).communication == 300.0
    assert power_model(WINDOWS, None, H100).limits == (200.0, 700.0)  # limits unread: the data sheet's
    assert DeviceProfile.from_dict(json.loads(json.dumps({**DeviceProfile("x", "gpu", 1, (), 1.0, 1.0).to_dict(),
                                                          "power": power.to_dict()}))).power == power


def test_windows_too_short_or_without_joules_do_not_count():
    cut = {"idle": [[0.1, 10.0]], "compute": [[0.5, 0.0]], "memory": [[0.2, 100.0], [0.5, 200.0]]}
    power = power_model(cut, None, H100)
    assert (power.idle, power.compute, power.memory) == (80.0, 700.0, 400.0)


def test_nothing_measured_gives_the_data_sheets_model_or_none():
    assert power_model({}, (200.0, 700.0), H100) is H100
    assert power_model({"idle": [], "compute": [[0.01, 5.0]]}, None, H100) is H100
    assert power_model({}, None, None) is None  # a CPU: with_power gives it the assumed model


def test_without_a_data_sheet_collectives_draw_as_memory_bound_work_and_the_floor_is_idle():
    power = power_model(WINDOWS, (150.0, 350.0), None)
    assert power == PowerModel(85.0, 680.0, 420.0, 420.0, (150.0, 350.0), 0.0, "measured")
    assert power_model(WINDOWS, None, None).limits == (0.0, 0.0)  # none known: no limit is priced
    assert power_model({"compute": WINDOWS["compute"]}, None, None) is None  # idle unknown: no model


def test_a_data_sheet_floor_above_a_measured_draw_is_dropped():
    low_memory = {**WINDOWS, "memory": [[0.5, 80.0]]}  # 160 W: below the data sheet's 175 W floor
    assert power_model(low_memory, None, H100).floor == 0.0
    assert data_sheet("NVIDIA H100 80GB HBM3") == DATA_SHEETS["H100"] and data_sheet("cpu") is None


# -- the window loop and NVML, against fakes --------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_window_repeats_the_loop_until_it_lasts_long_enough_and_no_more():
    clock, calls, counter = FakeClock(), [], [1000.0]

    def call():  # a 0.12 s loop drawing 300 W
        calls.append(1)
        clock.now += 0.12
        counter[0] += 36.0

    seconds, joules = measure_window(call, lambda: counter[0], BUSY_SECONDS, clock)
    assert len(calls) == 5 and seconds == pytest.approx(0.6) and joules == pytest.approx(180.0)
    seconds, joules = measure_window(lambda: calls.append(1), lambda: counter[0], BUSY_SECONDS, clock)
    assert len(calls) == 5 + MAX_CALLS and seconds == 0.0 and joules == 0.0  # a loop too fast: bounded


def fake_nvml(energy=None, mig=False, limits=(100_000, 400_000)):
    """A pynvml with GPUs 0-3 whose energy counters (millijoules) are `energy`'s."""
    energy = energy if energy is not None else {i: 0 for i in range(4)}

    def constraints(handle):
        if limits is None:
            raise RuntimeError("Not Supported")
        return limits

    def total(handle):
        if handle not in energy:
            raise RuntimeError("Not Supported")
        return energy[handle]

    return SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
                           nvmlDeviceGetHandleByUUID=lambda uuid: uuid, nvmlDeviceGetTotalEnergyConsumption=total,
                           nvmlDeviceGetPowerManagementLimitConstraints=constraints,
                           nvmlDeviceGetMigMode=lambda handle: (int(mig), int(mig)))


def test_the_meter_counts_the_busy_devices_only_per_device_in_watts_and_limits():
    energy = {0: 5_000, 1: 7_000}
    meter = Meter(fake_nvml(energy), [0, 1])

    def loop():  # device 0 busy: 0.3 J a call; device 1 idle, 0.05 J
        energy[0] += 300
        energy[1] += 50

    seconds, joules = meter.window(loop, busy=1, least=0.0)
    assert joules == pytest.approx(0.3)
    _, joules = meter.window(loop, busy=2, least=0.0)
    assert joules == pytest.approx(0.175)  # per device: (0.3 + 0.05) / 2
    assert meter.limits() == (100.0, 400.0)
    assert Meter(fake_nvml(limits=None), [0]).limits() is None


def test_open_meter_maps_cuda_visible_devices_to_nvml_and_says_why_it_cannot(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    meter = open_meter("gpu", [0, 1], "3,1")
    assert isinstance(meter, Meter) and meter.handles == [3, 1]
    assert open_meter("gpu", [0], None).handles == [0]
    assert open_meter("cpu", [0], None) == "no power counter on cpu devices"
    assert open_meter("gpu", [0], "MIG-1234").startswith("a MIG slice")
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(mig=True))
    assert open_meter("gpu", [0], None).startswith("the GPU is in MIG mode")
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(energy={}))
    assert open_meter("gpu", [0], None) == "NVML reads no energy counter here: Not Supported"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert open_meter("gpu", [0], None).startswith("NVML is not available")


def test_a_sections_windows_are_kept_beside_it_and_not_measured_again(tmp_path):
    energy = {0: 0}
    meter = Meter(fake_nvml(energy), [0])

    def section(hook):  # two loops, each timed, then handed to the hook
        for i in range(2):
            hook(i, lambda: energy.__setitem__(0, energy[0] + 1000))
        return {"fp32": 1e12}

    path = tmp_path / "p.json.parts"
    found, windows = metered(Parts(path), "matmul", section, meter, 1)
    assert found == {"fp32": 1e12} and len(windows) == 2
    assert sum(j for _, j in windows) == pytest.approx(energy[0] / 1000)  # 1 J a call, each counted once
    assert json.loads(path.read_text())["matmul energy"] == windows
    again = metered(Parts(path), "matmul", lambda hook: pytest.fail("measured again"), meter, 1)
    assert again == (found, windows)
    assert metered(Parts(tmp_path / "q.parts"), "x", lambda hook: hook, "no counter", 1) == (None, [])


def test_loop_times_hands_each_timed_loop_to_the_window_as_its_long_run():
    from codesign.engine.probe.loops import loop_times

    runs, handed = [], []

    def run(state, trips):
        runs.append([int(t) for t in trips])
        return state

    loop_times(run, (0, 0), -1.0, [1, 1], lambda i, call: handed.append((i, call)))  # any length will do
    assert [i for i, _ in handed] == [0, 1]
    runs.clear()
    handed[1][1]()
    assert runs == [[0, 2]]  # loop 1 alone, one trip more than its short run


def test_the_profile_gets_the_windows_power_model(tmp_path, monkeypatch):
    """loop_profile on CPU (one device) with every section kept in the parts file, the energy
    windows among them: its power model is theirs, filled from the data sheet named."""
    from codesign.config.types import MIXERS
    from codesign.engine.probe import gpu_sections as engine
    from codesign.engine.probe.loops import LoopSizes
    from codesign.hardware.profiles import LAYER

    points = {"forward": [[1e6, 2e-5], [1e8, 4e-5]], "backward": [[2e6, 4e-5], [2e8, 8e-5]]}
    data = {"matmul": {"fp32": 1e9, "bf16": 2e9}, "bandwidth": 1e10, "dispatch": 1e-4, "scratch": 0.5,
            **{f"{p} {k}": points for p in ("fp32", "bf16") for k in (*MIXERS, LAYER)},
            **{f"{name} energy": WINDOWS[figure] for name, figure in
               (("matmul", "compute"), ("bandwidth", "memory"), ("idle", "idle"))}}
    path = tmp_path / "p.json.parts"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(engine, "compile_side_by_side", lambda lowered: {name: None for name, _ in lowered})
    monkeypatch.setattr(probe_power, "data_sheet", lambda kind: DATA_SHEETS["H100"])
    sizes = LoopSizes(64, 2**16, ((8, 2, 4),), (2, 8), (2**10,), 0.002)
    profile = engine.loop_profile(Parts(path), sizes)
    assert profile.power == power_model(WINDOWS, None, H100) and profile.power.source == "measured"
    path.write_text(json.dumps({k: v for k, v in data.items() if not k.endswith("energy")}))
    assert engine.loop_profile(Parts(path), sizes).power == H100  # no counter on CPU: the data sheet's


def test_the_power_arithmetic_imports_no_jax():
    code = "import sys, codesign.engine.probe.power; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
