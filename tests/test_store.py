import multiprocessing
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from codesign.errors import StoreError
from codesign.outcome import Outcome
from codesign.spec.config import load_config
from codesign.spec.hosts import Hosts
from codesign.spec.jobs import enumerate_jobs
from codesign.spec.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.store import schema
from codesign.store.database import STALE_AFTER, Store
from codesign.store.schema import LEGACY_COLUMNS, SCHEMA_VERSION

DATA = Path(__file__).parent / "data"
JOB = Job(ModelSpec(4, 2, 1, 1, (("LINEAR",),)), ClusterSpec(1, 1, "NVLink", "cpu"), TrainingSpec(2, 2),
          ParallelSpec("dp", (1,), 1, False, (1, 1, 1)), 1, "cpu")


def test_new_db_has_legacy_columns_and_a_schema_version(tmp_path):
    store = Store(tmp_path / "r.db")
    columns = [r[1] for r in store.conn.execute("PRAGMA table_info(attempts)")]
    assert set(LEGACY_COLUMNS) <= set(columns)
    assert {"job_key", "status", "heartbeat", "throughput", "compile_time", "platform"} <= set(columns)
    assert store.schema_version == SCHEMA_VERSION
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_newer_schema_is_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / "r.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this codesign"):
        Store(tmp_path / "r.db")


def test_claim_skip_and_retry(tmp_path):
    store = Store(tmp_path / "r.db")
    first = store.claim("k", JOB, retry_failed=False)
    assert first and store.claim("k", JOB, retry_failed=False) is None  # running: never twice
    assert store.finish(first, Outcome("failed", error="boom"))
    assert not store.finish(first, Outcome("succeeded"))  # a finished attempt cannot change
    assert store.claim("k", JOB, retry_failed=False) is None  # attempted: skip
    second = store.claim("k", JOB, retry_failed=True)
    assert second and store.finish(second, Outcome("succeeded", metrics={"avg": 1.5, "versions": {"jax": "x"}}))
    assert store.claim("k", JOB, retry_failed=True) is None  # succeeded: skip even when retrying
    rows = store.attempts()
    assert [r["status"] for r in rows] == ["failed", "succeeded"]
    assert rows[1]["avg"] == 1.5 and rows[1]["versions"] == '{"jax": "x"}'
    assert rows[0]["input_batch_size"] == 2 and rows[0]["pp_dp_op"] == "[1, 1, 1]"


def test_running_attempt_of_a_dead_process_becomes_interrupted(tmp_path):
    store = Store(tmp_path / "r.db")
    attempt = store.claim("k", JOB, retry_failed=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    store.conn.execute("UPDATE attempts SET pid = ? WHERE id = ?", (int(dead), attempt))
    assert Store(tmp_path / "r.db").reap_stale() == 1
    assert store.attempts()[0]["status"] == "interrupted"


def test_silent_attempt_of_another_host_becomes_interrupted(tmp_path):
    store = Store(tmp_path / "r.db")
    live = store.claim("a", JOB, retry_failed=False)
    silent = store.claim("b", JOB, retry_failed=False)
    store.conn.execute("UPDATE attempts SET host = 'elsewhere', heartbeat = heartbeat - ? WHERE id = ?",
                       (STALE_AFTER + 1, silent))
    store.conn.execute("UPDATE attempts SET host = 'elsewhere' WHERE id = ?", (live,))
    assert store.reap_stale() == 1
    assert [r["status"] for r in store.attempts()] == ["running", "interrupted"]


def _claim_all(path: str, keys: list[str], queue) -> None:
    store = Store(path)
    queue.put([k for k in keys if store.claim(k, JOB, retry_failed=False)])


def test_two_orchestrators_never_claim_the_same_job(tmp_path):
    path = str(tmp_path / "r.db")
    Store(path).close()
    keys = [f"job{i}" for i in range(200)]
    queue = multiprocessing.get_context("spawn").Queue()
    procs = [multiprocessing.get_context("spawn").Process(target=_claim_all, args=(path, keys, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    claimed = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert sorted(claimed[0] + claimed[1]) == sorted(keys)
    assert not set(claimed[0]) & set(claimed[1])


def test_a_version_1_db_is_migrated_in_place(tmp_path):
    conn = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    schema.MIGRATIONS[0](conn)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO attempts (job_key, status, avg) VALUES ('old', 'succeeded', 2.5)")
    conn.close()
    store = Store(tmp_path / "r.db")
    assert store.schema_version == SCHEMA_VERSION >= 2
    old = store.attempts()[0]
    assert (old["job_key"], old["avg"], old["precision"], old["energy_per_iter"]) == ("old", 2.5, "fp32", None)
    attempt = store.claim("new", JOB, retry_failed=False)
    store.finish(attempt, Outcome("succeeded", metrics={"energy_per_iter": 3.25}))
    assert store.attempts()[1]["energy_per_iter"] == 3.25 and store.attempts()[1]["precision"] == "fp32"


def test_auto_search_rows_of_0_1_0_are_not_attempts(tmp_path):
    """codesign 0.1.0 recorded every Auto search job as invalid "not supported yet": a plain rerun
    runs those jobs, and still skips every other recorded one."""
    conn = sqlite3.connect(tmp_path / "r.db")
    conn.executescript((DATA / "results_v0.1.0.sql").read_text())
    conn.close()
    store = Store(tmp_path / "r.db")
    decisions = {(p.job.parallel.description, p.job.num_micro_batches): store.decide(p.key, retry_failed=False)
                 for p in enumerate_jobs(load_config(DATA / "results_v0.1.0.toml"), Hosts.local(0))}
    assert decisions == {("data parallel", 1): "skip", ("data parallel", 3): "skip", ("pipeline", 2): "skip",
                         ("Auto search", 1): "run"}
    (auto,) = [p for p in enumerate_jobs(load_config(DATA / "results_v0.1.0.toml"), Hosts.local(0))
               if p.job.parallel.is_auto]
    attempt = store.claim(auto.key, auto.job, retry_failed=False)
    assert attempt and store.finish(attempt, Outcome("oom", error="no plan fits"))
    assert store.decide(auto.key, retry_failed=False) == "skip"  # a new attempt counts
    assert len(store.attempts(["invalid"])) == 2  # the old rows stay, for the record
