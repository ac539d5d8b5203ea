"""Faults made for real, in short bounded loops: kill -9 of the orchestrator and of a job, a
stopped job, a locked DB, a damaged DB file, two orchestrators at once, SIGTERM and SIGINT.
bench/bench_faults.py runs the kill trials many more times and prints the figures."""

import json
import os
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time

import psutil
import pytest

from codesign.outcome import Outcome, read_outcome, write_outcome
from codesign.run.local import LocalExecutor
from codesign.run.sweep import run_sweep
from codesign.store.database import Store
from tests.conftest import REPO, SMALL_CONFIG, run_cli
from tests.fault_trials import (
    FAKE_CONFIG,
    fault_job,
    kill_trial,
    processes_of,
    signal_the_job,
    stopped_job_overshoot,
    survivors,
    trial_env,
    wait_for_job,
)

HANG_CONFIG = FAKE_CONFIG.replace('description = "work 0.4"', 'description = "hang"')


@pytest.fixture
def fault_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULT_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return tmp_path / "pids"


def statuses(db) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return [r[0] for r in conn.execute("SELECT status FROM attempts ORDER BY id")]
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.drills
def test_orchestrator_killed_at_random_moments_loses_nothing_and_orphans_nothing(tmp_path):
    rng = random.Random(10)
    for trial in range(4):
        result = kill_trial(tmp_path / f"t{trial}", real=False, kill_after=rng.uniform(0.3, 3.0))
        assert result.ok, (result, (tmp_path / f"t{trial}" / "log").read_text()[-3000:])
        assert result.jobs == 3


def test_a_killed_job_is_recorded_failed_and_the_next_job_runs(tmp_path, fault_env):
    store = Store(tmp_path / "r.db")
    killer = threading.Thread(target=signal_the_job, args=(fault_env, signal.SIGKILL))
    killer.start()
    summary = run_sweep([fault_job("hang"), fault_job("work 0.1")], store,
                        LocalExecutor(job_module="tests.fault_jobs"), retry_failed=False, manual_timeout=60)
    killer.join()
    rows = store.attempts()
    assert [r["status"] for r in rows] == ["failed", "succeeded"] and summary.statuses["failed"] == 1
    assert "exited with signal SIGKILL without a result" in rows[0]["error"]
    grandchild = int(fault_env.read_text().split()[1])
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_a_stopped_job_is_killed_at_its_timeout(tmp_path, fault_env):
    overshoot, gone = stopped_job_overshoot(tmp_path, timeout=2.0)
    assert 0 <= overshoot < 5 and gone


@pytest.mark.parametrize("behaviour, problem", [
    ("no-outcome", "exited with code 0 without a result"),
    ("empty-outcome", "with an unreadable outcome file (the file is empty)"),
    ("corrupt-outcome", "with an unreadable outcome file (Unterminated string"),
])
def test_a_missing_empty_or_corrupt_outcome_fails_the_attempt_and_the_sweep_goes_on(
        tmp_path, fault_env, behaviour, problem):
    store = Store(tmp_path / "r.db")
    run_sweep([fault_job(behaviour), fault_job("ok")], store, LocalExecutor(job_module="tests.fault_jobs"),
              retry_failed=False, manual_timeout=60)
    rows = store.attempts()
    assert [r["status"] for r in rows] == ["failed", "succeeded"]
    assert problem in rows[0]["error"]


def test_the_outcome_file_is_replaced_whole(tmp_path):
    path = tmp_path / "outcome.json"
    path.write_text("half a file")
    write_outcome(path, Outcome("succeeded", metrics={"avg": 0.25}))
    assert read_outcome(path) == Outcome("succeeded", metrics={"avg": 0.25})
    assert [p.name for p in tmp_path.iterdir()] == ["outcome.json"]  # no temp file left
    path.write_text('{"status": "finished"}')
    with pytest.raises(ValueError, match="no final status"):
        read_outcome(path)


@pytest.mark.drills
def test_a_db_locked_by_another_process_makes_the_sweep_wait_and_lose_nothing(tmp_path, fault_env):
    """Another process holds the DB's write lock from before the sweep starts until the test
    lets go of it (a line on its stdin): the sweep cannot finish meanwhile, then records everything."""
    db = tmp_path / "r.db"
    Store(db).close()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys\n"
        "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "conn.execute('BEGIN IMMEDIATE')\n"
        "conn.execute(\"INSERT INTO attempts (job_key, status) VALUES ('theirs', 'failed')\")\n"
        "print('locked', flush=True)\n"
        "sys.stdin.readline()\n"
        "conn.execute('COMMIT')\n"), str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    found = {}
    sweep = threading.Thread(target=lambda: found.update(summary=run_sweep(
        [fault_job("work 0.1"), fault_job("work 0.2")], Store(db), LocalExecutor(job_module="tests.fault_jobs"),
        retry_failed=False, manual_timeout=60)))
    sweep.start()
    sweep.join(timeout=4)  # the lock held for 4 s of the sweep's
    assert sweep.is_alive() and found == {}  # still waiting for it, not given up
    holder.communicate("release\n", timeout=30)
    sweep.join(timeout=120)
    assert holder.returncode == 0 and not sweep.is_alive()
    assert found["summary"].statuses == {"succeeded": 2}
    assert sorted((r["job_key"] == "theirs", r["status"]) for r in Store(db).attempts()) == \
        [(False, "succeeded"), (False, "succeeded"), (True, "failed")]


@pytest.mark.parametrize("damage", ["not sqlite", "truncated"])
def test_a_damaged_db_file_exits_2_and_is_left_byte_identical(tmp_path, damage):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG)
    if damage == "not sqlite":
        content = b"datetime,avg\n2024-01-01,0.5\n" * 200
    else:
        store = Store(tmp_path / "whole.db")
        for i in range(200):
            store.claim(f"job{i}", fault_job("ok").job, retry_failed=False)
        store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        store.close()
        content = (tmp_path / "whole.db").read_bytes()[:-8192]
    (tmp_path / "r.db").write_bytes(content)
    proc = run_cli("-c", "c.toml", "-d", "r.db", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert "r.db: not a usable SQLite results DB" in proc.stderr and "left untouched" in proc.stderr
    assert (tmp_path / "r.db").read_bytes() == content


def test_two_orchestrators_started_at_once_on_a_fresh_db(tmp_path):
    (tmp_path / "c.toml").write_text(FAKE_CONFIG)
    env = trial_env("two-at-once")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.fault_cli", "-c", "c.toml", "-d", "r.db"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert statuses(tmp_path / "r.db") == ["succeeded"] * 3  # each job once, by one of them


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_sigint_kill_the_jobs_record_them_and_exit(tmp_path, fault_env, signum, code):
    (tmp_path / "c.toml").write_text(HANG_CONFIG)
    marker = f"stop-{signum}-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "tests.fault_cli", "-c", "c.toml", "-d", "r.db"],
                            cwd=tmp_path, env=trial_env(marker), stderr=subprocess.PIPE, text=True)
    wait_for_job(fault_env)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"stopped by {signal.Signals(signum).name}" in err
    assert survivors(marker) == []
    assert statuses(tmp_path / "r.db") == ["interrupted"]
    dry = subprocess.run([sys.executable, "-m", "codesign", "-D", "-c", "c.toml", "-d", "r.db"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "retry: interrupted 1 of 3" in dry.stdout and "3 jobs: 3 run, 0 skip" in dry.stdout


def test_run_sh_passes_sigterm_on_and_stops(tmp_path, fault_env):
    (tmp_path / "c.toml").write_text(HANG_CONFIG)
    python = tmp_path / "python"  # run.sh runs `$CODESIGN_PYTHON -m codesign ARGS`: the fake jobs' CLI
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} -m tests.fault_cli "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    marker = f"run-sh-{os.getpid()}"
    env = {**trial_env(marker), "CODESIGN_PYTHON": str(python), "CODESIGN_RESTART_DELAY": "0"}
    proc = subprocess.Popen([str(REPO / "run.sh"), "-c", "c.toml", "-d", "r.db"], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True)
    wait_for_job(fault_env)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "restart" not in err, err
    assert survivors(marker) == [] and statuses(tmp_path / "r.db") == ["interrupted"]


def test_processes_of_finds_only_the_marked(tmp_path):
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=trial_env("mine"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=trial_env("theirs"))
    try:
        assert [p.pid for p in processes_of("mine")] == [marked.pid]
    finally:
        marked.kill(), other.kill(), marked.wait(), other.wait()
    assert survivors("mine", 1.0) == []


def start_guard(tmp_path, behaviour: str, marker: str) -> tuple[subprocess.Popen, int]:
    """A guard running a fault job as JobProcess starts it; returns it and the lifeline's write end."""
    (tmp_path / "job.json").write_text(json.dumps(fault_job(behaviour).job.to_dict()))
    read, write = os.pipe()
    guard = subprocess.Popen([sys.executable, "-m", "codesign.run.guard", str(os.getpid()), str(read),
                              "tests.fault_jobs", str(tmp_path / "job.json"), str(tmp_path / "outcome.json")],
                             pass_fds=(read,), env=trial_env(marker), start_new_session=True)
    os.close(read)
    return guard, write


def test_the_guard_leaves_nothing_behind_when_the_job_ends_by_itself(tmp_path):
    marker = f"guard-done-{os.getpid()}"
    guard, lifeline = start_guard(tmp_path, "work 0.1", marker)  # leaves a sleeping grandchild
    try:
        assert guard.wait(timeout=60) == 0
        assert processes_of(marker) == []  # at once: the guard killed and reaped it before exiting
    finally:
        os.close(lifeline)
    assert read_outcome(tmp_path / "outcome.json").status == "succeeded"


def test_the_guard_kills_its_group_when_the_lifeline_closes(tmp_path, fault_env):
    marker = f"guard-cut-{os.getpid()}"
    guard, lifeline = start_guard(tmp_path, "hang", marker)
    wait_for_job(fault_env)
    assert len(processes_of(marker)) == 3  # guard, job body, grandchild
    os.close(lifeline)  # what the kernel does when the orchestrator dies
    assert guard.wait(timeout=30) == -signal.SIGKILL
    assert survivors(marker) == []


def test_an_exception_while_pricing_a_job_fails_its_attempt_and_the_sweep_goes_on(tmp_path, fault_env, monkeypatch):
    from codesign.run import sweep

    real = sweep.predict

    def predict(job, *args):
        if job.parallel.description == "work 0.2":
            raise ZeroDivisionError("a bug in the cost model")
        return real(job, *args)

    monkeypatch.setattr(sweep, "predict", predict)
    store = Store(tmp_path / "r.db")
    summary = run_sweep([fault_job("work 0.1"), fault_job("work 0.2"), fault_job("work 0.3")], store,
                        LocalExecutor(job_module="tests.fault_jobs"), retry_failed=False, manual_timeout=60)
    rows = store.attempts()
    assert [r["status"] for r in rows] == ["succeeded", "failed", "succeeded"] and summary.failures == 1
    assert rows[1]["error"].startswith("codesign failed while pricing the job:\nTraceback")
    assert rows[1]["error"].rstrip().endswith("ZeroDivisionError: a bug in the cost model")
    assert store.decide(rows[1]["job_key"], retry_failed=False).action == "skip"  # not retried as interrupted


def test_an_exception_while_recording_an_outcome_keeps_the_measurements_beside_the_traceback(tmp_path, fault_env):
    store = Store(tmp_path / "r.db")
    item = fault_job("ok")
    attempt = store.claim(item.key, item.job, retry_failed=False)
    from codesign.run.sweep import Attempt, Sweep

    sweep = Sweep([], store, LocalExecutor(), False, 60, 1)
    sweep.record(Attempt(item, attempt, None), Outcome("succeeded", metrics={"avg": 0.5, "bogus": 1}))
    (row,) = store.attempts()
    assert row["status"] == "succeeded" and row["avg"] == 0.5
    assert "recording the job's succeeded outcome" in row["error"]
    assert "metrics with no column: bogus" in row["error"]


class FinishedJobs:
    """An executor whose jobs have finished by the time it is asked: each with these measurements."""

    def __init__(self, metrics):
        self.metrics = metrics

    def can_start(self, job, running):
        return True

    def start(self, job, timeout, plans=(), log=None, running=(), then=None, power_limits=None):
        return job

    def wait(self, running, seconds):
        return [(handle, Outcome("succeeded", metrics=dict(self.metrics), duration=1.0)) for handle in running]

    def cancel(self, handle):
        pass

    def close(self):
        pass


def test_an_error_in_the_bookkeeping_after_a_job_finished_records_its_measurements_beside_it(tmp_path, monkeypatch):
    """Writing the copy of the profile that priced a finished job fails: the job's median, p90,
    throughput... are recorded with its own status, the error beside them; the sweep goes on."""
    measured = {"avg": 0.51, "median": 0.5, "p90": 0.7, "throughput": 2048.0, "max_memory": 123, "compile_time": 3.0,
                "losses": [1.0, 0.5]}

    def keep_profile(self, profile_id, profile):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Store, "keep_profile", keep_profile)
    store = Store(tmp_path / "r.db")
    summary = run_sweep([fault_job("work 0.1"), fault_job("work 0.2")], store, FinishedJobs(measured),
                        retry_failed=False, manual_timeout=60)
    rows = store.attempts()
    assert [r["status"] for r in rows] == ["succeeded", "succeeded"] and summary.statuses == {"succeeded": 2}
    for row in rows:
        assert {k: row[k] for k in measured if k != "losses"} == {k: v for k, v in measured.items() if k != "losses"}
        assert json.loads(row["all_configs"])["losses"] == [1.0, 0.5] and row["job_duration"] == 1.0
        assert row["error"].startswith("codesign failed while recording the job's succeeded outcome:\nTraceback")
        assert row["error"].rstrip().endswith("sqlite3.OperationalError: disk I/O error")


def test_a_stop_signal_during_record_loses_no_finished_result(tmp_path, fault_env, monkeypatch):
    """SIGTERM arrives while the first result is being written: it is recorded whole, the next
    job is never started, and the sweep stops with the signal's exit code."""
    from codesign.run.sweep import Stopped, signals_stop_the_sweep

    store = Store(tmp_path / "r.db")
    real = Store.finish

    def finish(self, attempt_id, outcome, columns=None):
        os.kill(os.getpid(), signal.SIGTERM)  # in the middle of the write: handled before it goes on
        handled = time.monotonic() + 10
        while stop.signum is None and time.monotonic() < handled:
            time.sleep(0.01)
        assert stop.signum == signal.SIGTERM
        return real(self, attempt_id, outcome, columns)

    monkeypatch.setattr(Store, "finish", finish)
    with signals_stop_the_sweep() as stop, pytest.raises(Stopped) as stopped:
        run_sweep([fault_job("work 0.1"), fault_job("work 0.1")], store, LocalExecutor(job_module="tests.fault_jobs"),
                  retry_failed=False, manual_timeout=60, stop=stop)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert [r["status"] for r in store.attempts()] == ["succeeded"]
