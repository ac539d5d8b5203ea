"""Jobs that hang, crash and segfault really do so; the sweep records them and goes on."""

import dataclasses
import time
from types import SimpleNamespace

import psutil

from codesign.run.local import LocalExecutor
from codesign.run.sweep import run_sweep
from codesign.store.database import Store
from tests.conftest import REPO
from tests.fault_trials import fault_job


def test_hang_crash_and_segfault_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    jobs = [fault_job(b) for b in ("hang", "ok", "crash", "segfault", "ok2")]
    start = time.monotonic()
    summary = run_sweep(jobs, store, LocalExecutor(job_module="tests.fault_jobs"),
                        retry_failed=False, manual_timeout=3)
    elapsed = time.monotonic() - start
    rows = {r["description"]: r for r in store.attempts()}
    assert [rows[b]["status"] for b in ("hang", "ok", "crash", "segfault", "ok2")] == \
        ["timeout", "succeeded", "failed", "failed", "succeeded"]
    assert summary.statuses == {"timeout": 1, "succeeded": 2, "failed": 2}
    assert "killed after the 3 s timeout" in rows["hang"]["error"]
    assert 3 <= rows["hang"]["job_duration"] < 20 and elapsed < 60
    assert "RuntimeError: the job body crashed" in rows["crash"]["error"]
    assert "about to crash" in rows["crash"]["error"]
    assert "SIGSEGV" in rows["segfault"]["error"]
    assert rows["ok"]["avg"] == 0.5
    job_pid, grandchild_pid = map(int, (tmp_path / "pids").read_text().split())
    for pid in (job_pid, grandchild_pid):  # the whole process group is gone
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_heartbeat_runs_while_the_job_runs(tmp_path, monkeypatch):
    monkeypatch.setattr("codesign.run.sweep.HEARTBEAT_EVERY", 0.2)
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    beats = []
    monkeypatch.setattr(store, "heartbeat", lambda attempt: beats.append(attempt) or Store.heartbeat(store, attempt))
    run_sweep([fault_job("hang")], store, LocalExecutor(job_module="tests.fault_jobs"),
              retry_failed=False, manual_timeout=1.5)
    (row,) = store.attempts()
    assert row["status"] == "timeout" and len(beats) >= 3 and set(beats) == {row["id"]}
    assert row["heartbeat"] > row["started_at"]


def test_max_concurrent_runs_local_jobs_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    summary = run_sweep([fault_job(f"sleep{i}") for i in range(2)], store,
                        LocalExecutor(job_module="tests.fault_jobs"), retry_failed=False,
                        manual_timeout=60, max_concurrent=2)
    assert summary.statuses == {"succeeded": 2}
    (a_start, a_end), (b_start, b_end) = sorted(
        tuple(map(float, line.split())) for line in (tmp_path / "spans").read_text().splitlines())
    assert b_start < a_end


def test_a_gpu_job_runs_alone_on_this_machine():
    executor, cpu = LocalExecutor(), fault_job("ok").job
    gpu = dataclasses.replace(cpu, platform="gpu")
    running_cpu = [SimpleNamespace(job=cpu)]
    assert executor.can_start(cpu, running_cpu) and executor.can_start(gpu, [])
    assert not executor.can_start(gpu, running_cpu)
    assert not executor.can_start(cpu, [SimpleNamespace(job=gpu)])
