"""GPU power limits set by a job's guard and put back however the job ends, against a fake NVML
(a `pynvml` module first on the guard's PYTHONPATH, keeping the limits in a JSON file): the job
body killed with kill -9, the orchestrator gone (lifeline closed), SIGTERM, a normal exit and a
timeout; without permission nothing is set and the job still runs."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from codesign import gpu_power
from codesign.outcome import TIMEOUT
from codesign.run.local import LocalExecutor
from tests.conftest import REPO
from tests.fault_trials import fault_job

BEFORE, SET = 300_000, 250_000  # milliwatts

FAKE_NVML = '''
import json, os

class NVMLError(Exception):
    pass

FILE = os.environ["FAKE_NVML"]

def _load():
    with open(FILE) as f:
        return json.load(f)

def nvmlInit():
    if _load().get("missing"):
        raise NVMLError("NVML Shared Library Not Found")

def nvmlDeviceGetHandleByIndex(index):
    return str(index)

def nvmlDeviceGetHandleByUUID(uuid):
    return uuid

def nvmlDeviceGetPowerManagementLimit(handle):
    return _load()["limits"][handle]

def nvmlDeviceGetPowerManagementLimitConstraints(handle):
    return (100_000, 400_000)

def nvmlDeviceSetPowerManagementLimit(handle, milliwatts):
    state = _load()
    if state.get("no_permission"):
        raise NVMLError("Insufficient Permissions")
    state["limits"][handle] = milliwatts
    with open(FILE + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(FILE + ".tmp", FILE)
'''

# `python -m power_job NOTE SECONDS`: notes its pid, what its guard said and the limits it runs
# under, then sleeps
POWER_JOB = '''
import json, os, sys, time
with open(os.environ["FAKE_NVML"]) as f:
    limits = json.load(f)["limits"]
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "applied": os.environ.get("CODESIGN_POWER_APPLIED"), "limits": limits}, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(float(sys.argv[2]))
'''


@pytest.fixture
def nvml(tmp_path):
    """The fake NVML's directory and state file: GPUs 0-3 at BEFORE milliwatts."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pynvml.py").write_text(textwrap.dedent(FAKE_NVML))
    (fake / "power_job.py").write_text(textwrap.dedent(POWER_JOB))
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"limits": {str(i): BEFORE for i in range(4)}}))
    return fake, state


def env_with(nvml, limits, **extra):
    fake, state = nvml
    return {**os.environ, "PYTHONPATH": f"{fake}:{REPO}", "FAKE_NVML": str(state),
            **gpu_power.limits_env(limits), **extra}


def start_guard(tmp_path, env, seconds: float):
    read, write = os.pipe()
    guard = subprocess.Popen([sys.executable, "-m", "codesign.run.guard", str(os.getpid()), str(read),
                              "power_job", str(tmp_path / "note.json"), str(seconds)],
                             pass_fds=(read,), env=env, start_new_session=True)
    os.close(read)
    return guard, write


def wait_for(condition, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the job never got there"
        time.sleep(0.05)


def note(tmp_path) -> dict:
    wait_for(lambda: (tmp_path / "note.json").exists())
    return json.loads((tmp_path / "note.json").read_text())


def limits(state) -> dict:
    return json.loads(state.read_text())["limits"]


def test_a_job_body_killed_with_kill_9_leaves_the_limit_restored(tmp_path, nvml):
    guard, lifeline = start_guard(tmp_path, env_with(nvml, {0: 250.0}), 600)
    try:
        running = note(tmp_path)
        assert running["limits"]["0"] == SET and running["applied"] == "yes"
        os.kill(running["pid"], signal.SIGKILL)
        assert guard.wait(timeout=60) == -signal.SIGKILL  # the guard exits as its child did
    finally:
        os.close(lifeline)
    assert limits(nvml[1]) == {str(i): BEFORE for i in range(4)}


def test_the_limit_is_restored_when_the_orchestrator_is_gone(tmp_path, nvml):
    guard, lifeline = start_guard(tmp_path, env_with(nvml, {0: 250.0}), 600)
    assert note(tmp_path)["limits"]["0"] == SET
    os.close(lifeline)  # what the kernel does when the orchestrator dies
    assert guard.wait(timeout=60) == -signal.SIGKILL
    assert limits(nvml[1])["0"] == BEFORE


def test_the_limit_is_restored_when_the_guard_gets_sigterm(tmp_path, nvml):
    guard, lifeline = start_guard(tmp_path, env_with(nvml, {0: 250.0}), 600)
    try:
        assert note(tmp_path)["limits"]["0"] == SET
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=60) == -signal.SIGKILL
    finally:
        os.close(lifeline)
    assert limits(nvml[1])["0"] == BEFORE


def test_a_job_that_ends_by_itself_leaves_the_limits_restored(tmp_path, nvml):
    """Job devices are the GPUs of CUDA_VISIBLE_DEVICES in order; a limit past what the device
    allows is clamped, and the job body is told so."""
    env = env_with(nvml, {0: 150.0, 1: 500.0}, CUDA_VISIBLE_DEVICES="3,1")
    guard, lifeline = start_guard(tmp_path, env, 0)
    try:
        assert guard.wait(timeout=60) == 0
    finally:
        os.close(lifeline)
    ran = note(tmp_path)
    assert ran["limits"] == {"0": BEFORE, "1": 400_000, "2": BEFORE, "3": 150_000}
    assert ran["applied"] == "yes: device 1 clamped to 400 W"
    assert limits(nvml[1]) == {str(i): BEFORE for i in range(4)}


@pytest.mark.parametrize("problem, reason", [
    ({"no_permission": True}, "no: NVMLError: Insufficient Permissions"),
    ({"missing": True}, "no: NVML is not available: NVML Shared Library Not Found")])
def test_without_permission_or_nvml_nothing_is_set_and_the_job_runs(tmp_path, nvml, problem, reason):
    nvml[1].write_text(json.dumps({"limits": {str(i): BEFORE for i in range(4)}, **problem}))
    guard, lifeline = start_guard(tmp_path, env_with(nvml, {0: 250.0}), 0)
    try:
        assert guard.wait(timeout=60) == 0
    finally:
        os.close(lifeline)
    assert note(tmp_path)["applied"] == reason
    assert limits(nvml[1])["0"] == BEFORE
    assert gpu_power.record({**gpu_power.limits_env({0: 250.0}), "CODESIGN_POWER_APPLIED": reason}) == {
        "limits": {"0": 250.0}, "applied": False, "reason": reason.removeprefix("no: ")}


def test_a_job_killed_at_its_timeout_by_the_executor_leaves_the_limit_restored(tmp_path, nvml, monkeypatch):
    """The executor stops a limited job's guard with SIGTERM first, so that it restores."""
    for name, value in env_with(nvml, {}, FAULT_PIDS=str(tmp_path / "pids")).items():
        monkeypatch.setenv(name, value)
    executor = LocalExecutor(job_module="tests.fault_jobs")
    try:
        run = executor.start(fault_job("hang").job, 600, power_limits={0: 250.0})
        wait_for(lambda: (tmp_path / "pids").exists())
        assert limits(nvml[1])["0"] == SET
        run.deadline = time.monotonic()  # overstayed
        ((_, outcome),) = executor.wait([run], 60)
    finally:
        executor.close()
    assert outcome.status == TIMEOUT
    assert limits(nvml[1])["0"] == BEFORE


def test_the_job_body_records_its_limits_and_whether_they_were_set():
    env = {**gpu_power.limits_env({1: 200.0, 0: 250.0}), "CODESIGN_POWER_APPLIED": "yes"}
    assert gpu_power.record(env) == {"limits": {"0": 250.0, "1": 200.0}, "applied": True, "reason": None}
    assert gpu_power.record({}) is None  # no limits given: nothing to record
