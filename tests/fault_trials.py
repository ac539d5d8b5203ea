"""Faults made for real, shared by tests/test_faults.py (a few) and bench/bench_faults.py (many).

A kill trial starts an orchestrator on a fresh DB, SIGKILLs it at a chosen moment, looks for
any process of its jobs still alive, reruns it plainly until it exits 0, and counts what the
DB holds against the jobs of the config. Every process of a trial carries a marker in its
environment, so processes of other runs on this machine are never counted (or killed).
"""

from __future__ import annotations

import collections
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from codesign.run.local import LocalExecutor
from codesign.run.sweep import run_sweep
from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import PlannedJob, enumerate_jobs
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.store.database import Store
from tests.configs import ONE_CPU_DEVICE, SMALL_HEAD

REPO = Path(__file__).resolve().parents[1]
MARKER = "CODESIGN_FAULT_TRIAL"
ORPHAN_GRACE = 5.0  # seconds a job's processes get to die after their orchestrator
MAX_RERUNS = 6

# Fake jobs (tests.fault_jobs): each starts a grandchild, "trains" a while, succeeds.
FAKE_CONFIG = SMALL_HEAD + ONE_CPU_DEVICE + "".join(f"""
[[parallel_spec]]
description = "work {seconds}"
num_micro_batches = [1]
"(pp, dp, op)" = [1, 1, 1]
""" for seconds in (0.4, 0.8, 0.6))

# Real ZHEN jobs (codesign.engine.job) on two virtual CPU devices: import, compile, steps.
ZHEN_CONFIG = SMALL_HEAD + """
[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 2
transport = "NVLink"
platform = "cpu"

[[parallel_spec]]
description = "data parallel"
num_micro_batches = [1, 2]
"(pp, dp, op)" = [1, 2, 1]
"""


@dataclass
class TrialResult:
    killed_at: float  # seconds after the start
    jobs: int
    lost: int  # jobs without a succeeded attempt after the reruns
    duplicates: int  # succeeded attempts beyond one per job
    orphans: int  # processes of the trial alive ORPHAN_GRACE s after the kill
    reruns: int
    integrity: str
    running_left: int  # attempts still `running` after the last rerun
    interrupted: int  # attempts the kill interrupted (0: it came before or between jobs)
    orphan_details: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return (self.lost, self.duplicates, self.orphans, self.integrity, self.running_left) == \
            (0, 0, 0, "ok", 0)


def trial_env(marker: str) -> dict[str, str]:
    return {**os.environ, MARKER: marker, "PYTHONPATH": str(REPO)}


def processes_of(marker: str) -> list[psutil.Process]:
    """Live (not zombie) processes whose environment carries the marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def survivors(marker: str, grace: float = ORPHAN_GRACE) -> list[psutil.Process]:
    """The marker's processes still alive after grace seconds."""
    until = time.monotonic() + grace
    while (alive := processes_of(marker)) and time.monotonic() < until:
        time.sleep(0.1)
    return alive


def orchestrator(module: str, config: Path, db: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", module, "-c", str(config), "-d", str(db)],
                                cwd=db.parent, env=env, stdout=out, stderr=subprocess.STDOUT)


def kill_trial(workdir: Path, real: bool, kill_after: float) -> TrialResult:
    """SIGKILL an orchestrator kill_after s after its start, then rerun it until it is done."""
    workdir.mkdir(parents=True, exist_ok=True)
    config, db, log = workdir / "c.toml", workdir / "results.db", workdir / "log"
    config.write_text(ZHEN_CONFIG if real else FAKE_CONFIG)
    module = "codesign" if real else "tests.fault_cli"
    marker = uuid.uuid4().hex
    env = trial_env(marker)
    proc = orchestrator(module, config, db, env, log)
    time.sleep(kill_after)
    proc.kill()
    proc.wait()
    left = [describe(p) for p in survivors(marker)]
    for orphan in survivors(marker, 0.0):  # counted, then cleaned up so trials stay independent
        orphan.kill()
    reruns = 0
    while reruns < MAX_RERUNS:
        reruns += 1
        rerun = orchestrator(module, config, db, env, log)
        if rerun.wait(timeout=600) == 0:
            break
    keys = {p.key for p in enumerate_jobs(load_config(config), Hosts.local(0))}
    left += [describe(p) for p in survivors(marker)]
    return _count(db, keys, kill_after, left, reruns)


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} {proc.status()} ppid {proc.ppid()} pgid {os.getpgid(proc.pid)}: " \
               f"{' '.join(proc.cmdline())[:200]}"
    except (psutil.Error, OSError) as err:
        return f"pid {proc.pid}: {err}"


def _count(db: Path, keys: set[str], killed_at: float, orphans: list[str], reruns: int) -> TrialResult:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT job_key, status FROM attempts").fetchall()
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()
    succeeded = collections.Counter(key for key, status in rows if status == "succeeded")
    return TrialResult(killed_at, len(keys), sum(1 for k in keys if not succeeded[k]),
                       sum(n - 1 for n in succeeded.values() if n > 1), len(orphans), reruns, integrity,
                       sum(1 for _, status in rows if status == "running"),
                       sum(1 for _, status in rows if status == "interrupted"), tuple(orphans))


def fault_job(behaviour: str) -> PlannedJob:
    """A one-device CPU job whose body (tests.fault_jobs) does `behaviour`."""
    model = ModelSpec(4, 2, 1, 1, (("LINEAR",),))
    parallel = ParallelSpec(behaviour, (1,), 1, False, (1, 1, 1))
    return PlannedJob(Job(model, ClusterSpec(1, 1, "NVLink", "cpu"), TrainingSpec(2, 2), parallel, 1, "cpu"))


def wait_for_job(pids: Path, timeout: float = 60) -> int:
    """The pid a fault job noted first in `pids`, once it has started."""
    until = time.monotonic() + timeout
    while not (pids.exists() and pids.read_text().strip()):
        if time.monotonic() > until:
            raise TimeoutError("the job never started")
        time.sleep(0.05)
    return int(pids.read_text().split()[0])


def signal_the_job(pids: Path, signum: int) -> None:
    """Once the hang job has started, send it signum."""
    os.kill(wait_for_job(pids), signum)


def stopped_job_overshoot(workdir: Path, timeout: float) -> tuple[float, bool]:
    """A job SIGSTOPped while it runs: seconds past its timeout until it is recorded, and
    whether its process is gone."""
    workdir.mkdir(parents=True, exist_ok=True)
    pids = workdir / "pids"
    os.environ.update(FAULT_PIDS=str(pids), PYTHONPATH=str(REPO))  # read by the job body, and its import
    store = Store(workdir / "results.db")
    stopper = threading.Thread(target=signal_the_job, args=(pids, signal.SIGSTOP))
    stopper.start()
    start = time.monotonic()
    try:
        run_sweep([fault_job("hang")], store, LocalExecutor(job_module="tests.fault_jobs"),
                  retry_failed=False, manual_timeout=timeout)
        (row,) = store.attempts()
    finally:
        stopper.join()
        store.close()
    overshoot = time.monotonic() - start - timeout
    job_pid = int(pids.read_text().split()[0])
    gone = not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == psutil.STATUS_ZOMBIE
    return (overshoot if row["status"] == "timeout" else float("inf")), gone
