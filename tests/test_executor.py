"""Jobs that hang, crash and segfault really do so; the sweep records them and goes on."""

import dataclasses
import json
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from codesign.run.local import LocalExecutor
from codesign.run.sweep import run_sweep
from codesign.config.jobs import PlannedJob
from codesign.config.types import ClusterSpec
from codesign.store import database
from codesign.store.database import Store
from tests.conftest import REPO
from tests.fault_trials import fault_job


@pytest.mark.drills
def test_hang_crash_and_segfault_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    jobs = [fault_job(b) for b in ("hang", "ok", "crash", "segfault", "ok2")]
    start = time.monotonic()
    summary = run_sweep(jobs, store, LocalExecutor(job_module="tests.fault_jobs"),
                        retry_failed=False, manual_timeout=6)  # the crash's 1.6 s, thrice over on a busy CI
    elapsed = time.monotonic() - start
    rows = {r["description"]: r for r in store.attempts()}
    assert [rows[b]["status"] for b in ("hang", "ok", "crash", "segfault", "ok2")] == \
        ["timeout", "succeeded", "failed", "failed", "succeeded"]
    assert summary.statuses == {"timeout": 1, "succeeded": 2, "failed": 2}
    assert "killed after the 6 s timeout" in rows["hang"]["error"]
    assert 6 <= rows["hang"]["job_duration"] < 20 and elapsed < 60
    assert "RuntimeError: the job body crashed" in rows["crash"]["error"]
    assert "about to crash" in rows["crash"]["error"]
    assert "SIGSEGV" in rows["segfault"]["error"]
    assert rows["ok"]["avg"] == 0.5
    job_pid, grandchild_pid = map(int, (tmp_path / "pids").read_text().split())
    for pid in (job_pid, grandchild_pid):  # the whole process group is gone
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def counted_beats(monkeypatch, enough: int) -> tuple[list[tuple[int, ...]], threading.Event]:
    """Every heartbeat the store writes (the attempts it beat), and an event set at the `enough`th."""
    beats, reached, real = [], threading.Event(), database._beat

    def beat(conn, attempt_ids):
        real(conn, attempt_ids)
        beats.append(attempt_ids)
        if len(beats) >= enough:
            reached.set()

    monkeypatch.setattr(database, "_beat", beat)
    return beats, reached


def test_heartbeat_runs_while_the_job_runs(tmp_path, monkeypatch):
    monkeypatch.setattr("codesign.run.sweep.HEARTBEAT_EVERY", 0.2)
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    beats, _ = counted_beats(monkeypatch, 1)
    run_sweep([fault_job("hang")], store, LocalExecutor(job_module="tests.fault_jobs"),
              retry_failed=False, manual_timeout=1.5)
    (row,) = store.attempts()
    assert row["status"] == "timeout" and len(beats) >= 3 and set(beats) == {(row["id"],)}
    assert row["heartbeat"] > row["started_at"]


def test_the_heartbeat_goes_on_while_auto_search_prices_a_job(tmp_path, monkeypatch):
    """Auto search holds the sweep's thread (here until three heartbeats were written): the
    attempt it prices is beaten meanwhile, so another host never reaps it as silent."""
    from codesign.config.types import AUTO_SEARCH, Job, ModelSpec, ParallelSpec, TrainingSpec
    from codesign.run import sweep

    monkeypatch.setattr(sweep, "HEARTBEAT_EVERY", 0.01)
    beats, three = counted_beats(monkeypatch, 3)
    store = Store(tmp_path / "r.db")
    real, seen = sweep.choose_plan, {}

    def slow_search(job, book, links):
        seen["claimed"] = store.attempts()[0]
        seen["three beats"] = three.wait(timeout=60)  # False: none came while the search ran
        seen["searched"] = store.attempts()[0]
        return real(job, book, links)

    monkeypatch.setattr(sweep, "choose_plan", slow_search)
    job = Job(ModelSpec(4, 2, 1, 1, (("LINEAR",),)), ClusterSpec(1, 8, "NVLink", "sim", "H100"), TrainingSpec(2, 2),
              ParallelSpec(AUTO_SEARCH, (1,)), 1, "sim")
    run_sweep([PlannedJob(job)], store, LocalExecutor(), retry_failed=False, manual_timeout=60)
    (row,) = store.attempts()
    assert row["status"] == "simulated" and set(beats) == {(row["id"],)}
    assert seen["three beats"] and seen["searched"]["status"] == "running"
    assert seen["searched"]["heartbeat"] > seen["claimed"]["heartbeat"]


def test_max_concurrent_runs_local_jobs_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    summary = run_sweep([fault_job(f"meet 2 {i}") for i in range(2)], store,
                        LocalExecutor(job_module="tests.fault_jobs", cpu_slots=2), retry_failed=False,
                        manual_timeout=60, max_concurrent=2)
    assert summary.statuses == {"succeeded": 2}
    (a_start, a_end), (b_start, b_end) = sorted(
        tuple(map(float, line.split()[:2])) for line in (tmp_path / "spans").read_text().splitlines())
    assert b_start < a_end


def gpu_job(behaviour: str, gpus: int) -> PlannedJob:
    job = fault_job(behaviour).job
    parallel = dataclasses.replace(job.parallel, pp_dp_op=(1, gpus, 1))
    return PlannedJob(dataclasses.replace(job, cluster=ClusterSpec(1, gpus, "NVLink", "gpu"), parallel=parallel,
                                          platform="gpu"))


def test_the_next_job_runs_in_a_process_started_beside_the_one_before(tmp_path, monkeypatch):
    """A spare process imports Python and JAX while a job runs, made for the job queued next:
    the next job runs in it, on other devices too (the sweep's first job on another cluster);
    none outlives the sweep."""
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    two = fault_job("whoami c")
    two = PlannedJob(dataclasses.replace(two.job, cluster=ClusterSpec(1, 2, "NVLink", "cpu"),
                                         parallel=dataclasses.replace(two.job.parallel, pp_dp_op=(1, 2, 1))))
    summary = run_sweep([fault_job("whoami a"), fault_job("whoami b"), two], store,
                        LocalExecutor(job_module="tests.fault_jobs"), retry_failed=False, manual_timeout=60)
    assert summary.statuses == {"succeeded": 3}
    ran = {label: (int(pid), float(created), float(ended)) for label, pid, created, ended in
           (line.split() for line in (tmp_path / "pids").read_text().splitlines())}
    assert len({pid for pid, _, _ in ran.values()}) == 3
    assert ran["b"][1] < ran["a"][2]  # b's process was started while a ran
    assert ran["c"][1] < ran["b"][2]  # two devices, c's own environment: started while b ran
    left = [p for p in psutil.Process().children(recursive=True) if "codesign.run.warm" in " ".join(p.cmdline())]
    assert left == []


def test_jobs_started_beside_others_leave_no_spare(tmp_path, monkeypatch):
    """Beside a running job the next one would see other GPUs: no spare is made for it."""
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    executor = LocalExecutor(job_module="tests.fault_jobs", gpus=range(2))
    first = executor.start(gpu_job("sleep a", 1).job, 60)
    try:
        assert executor.spare is not None and executor.spare.env["CUDA_VISIBLE_DEVICES"] == "0"
        second = executor.start(gpu_job("sleep b", 1).job, 60, running=[first])
        assert second.gpus == (1,) and executor.spare is None
        ended = []
        while len(ended) < 2:
            ended += executor.wait([r for r in (first, second) if r not in {e for e, _ in ended}], 10)
        assert [o.status for _, o in ended] == ["succeeded", "succeeded"]
    finally:
        executor.close()


def test_gpu_jobs_share_a_host_on_disjoint_gpus_each_seeing_only_its_own(tmp_path, monkeypatch):
    """A host of 4 GPUs (their count faked; the fake job body only reads CUDA_VISIBLE_DEVICES):
    jobs of 1, 2 and 1 GPUs run side by side, then a 4-GPU job alone."""
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    jobs = [gpu_job("meet 3 a", 1), gpu_job("meet 3 b", 2), gpu_job("meet 3 c", 1), gpu_job("meet 3 d", 4)]
    summary = run_sweep(jobs, store, LocalExecutor(job_module="tests.fault_jobs", gpus=range(4)),
                        retry_failed=False, manual_timeout=60, max_concurrent=None)
    assert summary.statuses == {"succeeded": 4}
    spans = [line.split() for line in (tmp_path / "spans").read_text().splitlines()]
    seen = {frozenset(map(int, s[2].split(","))): (float(s[0]), float(s[1])) for s in spans}
    assert set(seen) == {frozenset({0}), frozenset({1, 2}), frozenset({3}), frozenset({0, 1, 2, 3})}
    first_three = [seen[frozenset(g)] for g in ({0}, {1, 2}, {3})]
    assert max(start for start, _ in first_three) < min(end for _, end in first_three)  # side by side
    assert seen[frozenset({0, 1, 2, 3})][0] >= max(end for _, end in first_three) - 0.1  # then alone
    rows = store.attempts()
    assert [json.loads(r["gpu_ids"]) for r in rows] == [[0], [1, 2], [3], [0, 1, 2, 3]]
    assert [r["jobs_beside"] for r in rows] == [2, 2, 2, 0]


def test_max_concurrent_1_keeps_gpu_jobs_exclusive(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store = Store(tmp_path / "r.db")
    run_sweep([gpu_job("sleep a", 1), gpu_job("sleep b", 1)], store,
              LocalExecutor(job_module="tests.fault_jobs", gpus=range(8)), False, 60, max_concurrent=1)
    (a_start, a_end, a_gpus), (b_start, b_end, b_gpus) = sorted(
        line.split() for line in (tmp_path / "spans").read_text().splitlines())
    assert float(b_start) >= float(a_end) and a_gpus == b_gpus == "0"
    assert [r["jobs_beside"] for r in store.attempts()] == [0, 0]


def test_gpu_and_cpu_jobs_do_not_mix_and_unknown_gpus_are_held_whole():
    executor, cpu = LocalExecutor(), fault_job("ok").job
    gpu = dataclasses.replace(cpu, platform="gpu")
    running_cpu = [SimpleNamespace(job=cpu, gpus=())]
    assert executor.can_start(gpu, []) and not executor.can_start(gpu, running_cpu)
    assert not executor.can_start(cpu, [SimpleNamespace(job=gpu, gpus=())])
    assert not executor.can_start(gpu, [SimpleNamespace(job=gpu, gpus=())])  # GPUs not known by id
    assert not executor.can_start(cpu, running_cpu)  # one CPU job at a time unless told otherwise
    assert LocalExecutor(cpu_slots=2).can_start(cpu, running_cpu)


def test_the_spare_is_made_for_the_gpus_the_next_job_will_get(tmp_path, monkeypatch):
    """Started alone, a 1-GPU job leaves a spare for the 2-GPU job queued next: GPUs 0 and 1, the
    first free ones once this job ends."""
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    executor = LocalExecutor(job_module="tests.fault_jobs", gpus=range(4))
    first = executor.start(gpu_job("sleep a", 1).job, 60, then=gpu_job("sleep b", 2).job)
    try:
        assert first.gpus == (0,) and executor.spare.env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert [o.status for _, o in executor.wait([first], 30)] == ["succeeded"]
    finally:
        executor.close()
