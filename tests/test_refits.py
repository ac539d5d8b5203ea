"""Refits off the sweep's path (issue 55, item 3): recording a point prices that point alone and
reads no pool; a refit runs on a thread of its own, so a job beside a slow one is killed at its
timeout and records its own duration; on cores the jobs share, a refit runs only while no job
does."""

import dataclasses
import time

import pytest

import codesign.cost.learning as cost_learning
import codesign.run.learning as learning
from codesign.config.hosts import Hosts
from codesign.cost.calibration import COMPONENTS
from codesign.cost.learning import Calibration
from codesign.hardware.profiles import profile_id
from codesign.run.local import LocalExecutor
from codesign.run.profile_cache import profiles_for
from codesign.run.sweep import Pricing, run_sweep
from codesign.store.database import Store
from tests.conftest import REPO, db_rows
from tests.fault_trials import fault_job
from tests.test_executor import gpu_job
from tests.test_learning import JOBS, cache, learner, points  # noqa: F401


def test_recording_a_point_prices_it_alone_and_reads_no_pool(cache, monkeypatch):
    machine = learner(cache)
    for point in points(JOBS[:11]):
        machine.add(point)
    priced, read = [], []
    estimate, read_points = cost_learning.estimate, learning.read_points
    monkeypatch.setattr(cost_learning, "estimate", lambda *args: priced.append(args) or estimate(*args))
    monkeypatch.setattr(learning, "read_points", lambda *args: read.append(args) or read_points(*args))
    (last,) = points(JOBS[11:12])
    assert machine.learn(dataclasses.replace(last, peak=2 * last.peak))
    assert len(priced) == 1 and read == []
    assert machine.current.memory_only and machine.current.memory_factor == pytest.approx(2 / 1.025)


def slowed_refit(monkeypatch, seconds: float) -> list[tuple[float, float]]:
    """Every point makes a refit due, and each refit sleeps `seconds` (a rejected calibration);
    returns the (start, end) of each, in unix seconds, as they end."""
    spans = []

    def slow(base, points, current, version, now, *args, **kwargs):
        start = time.time()
        time.sleep(seconds)
        spans.append((start, time.time()))
        return Calibration(version, profile_id(base), tuple(dict.fromkeys(COMPONENTS, 1.0).items()), (), 1.0,
                           len(points), 0.2, 0.1, False, now)

    monkeypatch.setattr(learning, "due", lambda *args: True)
    monkeypatch.setattr(learning, "refit", slow)
    return spans


def noted_spans(path) -> list[tuple[float, float]]:
    """The (start, end) each "sleep" fault job noted, in the order they started (a hang notes pids)."""
    noted = [line.split() for line in path.read_text().splitlines()]
    return sorted((float(s), float(e)) for s, e, _ in (n for n in noted if len(n) == 3))


@pytest.mark.slow
@pytest.mark.drills
def test_a_refit_slowed_to_10_s_beside_a_job_with_a_3_s_timeout_kills_it_on_time(tmp_path, cache, monkeypatch):
    """On GPUs a refit runs beside the jobs: the first job's point starts one that takes 10 s;
    the hanging job beside it is killed within 1 s of its 3 s deadline, and the job that ran on
    the freed GPU meanwhile records its own 1.5 s, not the refit's 10."""
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    refits = slowed_refit(monkeypatch, 10)
    store = Store(tmp_path / "r.db")
    try:
        run_sweep([gpu_job("measured", 1), gpu_job("hang", 1), gpu_job("sleep a", 1)], store,
                  LocalExecutor(job_module="tests.fault_jobs", gpus=range(2)), retry_failed=False, manual_timeout=3,
                  max_concurrent=None, pricing=Pricing(profiles_for(Hosts.local(2), cache=cache)))
    finally:
        store.close()
    measured, hang, sleep = db_rows(tmp_path / "r.db")
    ((start, end),) = refits
    ((sleep_start, sleep_end),) = noted_spans(tmp_path / "spans")
    assert (measured["status"], hang["status"], sleep["status"]) == ("succeeded", "timeout", "succeeded")
    assert 3 <= hang["job_duration"] < 4 and start < hang["finished_at"] < end  # killed on time, mid-refit
    assert start < sleep_start and sleep_end < end and sleep["job_duration"] < 3  # its own 1.5 s


@pytest.mark.slow
def test_on_shared_cores_a_refit_runs_only_while_no_job_does(tmp_path, cache, monkeypatch):
    """Virtual CPU devices share the orchestrator's cores: the refit the first job's point makes
    due waits for the job beside it to end, and the next job waits for the refit."""
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "spans"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    refits = slowed_refit(monkeypatch, 1)
    store = Store(tmp_path / "r.db")
    try:
        run_sweep([fault_job("measured"), fault_job("sleep a"), fault_job("sleep b")], store,
                  LocalExecutor(job_module="tests.fault_jobs", cpu_slots=2), retry_failed=False, manual_timeout=60,
                  max_concurrent=None, pricing=Pricing(profiles_for(Hosts.local(0), cache=cache)))
    finally:
        store.close()
    ((start, end),) = refits
    (a_start, a_end), (b_start, b_end) = noted_spans(tmp_path / "spans")
    assert a_end < start and end < b_start
    assert [r["status"] for r in db_rows(tmp_path / "r.db")] == ["succeeded"] * 3
