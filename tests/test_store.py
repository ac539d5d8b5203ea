import json
import multiprocessing
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest

from codesign.errors import StoreError
from codesign.outcome import Outcome
from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.store import schema
from codesign.store.database import STALE_AFTER, Store
from codesign.store.schema import LEGACY_COLUMNS, SCHEMA_VERSION
from tests.conftest import REPO
from tests.configs import SMALL_HEAD

DATA = REPO / "tests" / "data"

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


def test_an_attempt_whose_pid_was_reused_by_a_later_process_becomes_interrupted(tmp_path):
    store = Store(tmp_path / "r.db")
    attempt = store.claim("k", JOB, retry_failed=False)
    store.conn.execute("UPDATE attempts SET started_at = started_at - 10 WHERE id = ?", (attempt,))
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        store.conn.execute("UPDATE attempts SET pid = ? WHERE id = ?", (later.pid, attempt))
        assert Store(tmp_path / "r.db").reap_stale() == 1
    finally:
        later.kill()
        later.wait()
    assert store.attempts()[0]["status"] == "interrupted"
    live = store.claim("k2", JOB, retry_failed=False)  # this process, which claimed it: alive
    assert Store(tmp_path / "r.db").reap_stale() == 0 and store.attempts()[1]["id"] == live


def test_silent_attempt_of_another_host_becomes_interrupted(tmp_path):
    store = Store(tmp_path / "r.db")
    live = store.claim("a", JOB, retry_failed=False)
    silent = store.claim("b", JOB, retry_failed=False)
    store.conn.execute("UPDATE attempts SET host = 'elsewhere', heartbeat = heartbeat - ? WHERE id = ?",
                       (STALE_AFTER + 1, silent))
    store.conn.execute("UPDATE attempts SET host = 'elsewhere' WHERE id = ?", (live,))
    assert store.reap_stale() == 1
    assert [r["status"] for r in store.attempts()] == ["running", "interrupted"]


def _claim_all(path: str, keys: list[str], queue, done) -> None:
    """Claim what it can, then stay alive (a claimer that exits is an interrupted orchestrator,
    whose attempts the other would rightly retry)."""
    store = Store(path)
    queue.put([k for k in keys if store.claim(k, JOB, retry_failed=False)])
    done.wait(120)


def test_two_orchestrators_never_claim_the_same_job(tmp_path):
    path = str(tmp_path / "r.db")
    Store(path).close()
    keys = [f"job{i}" for i in range(200)]
    spawn = multiprocessing.get_context("spawn")
    queue, done = spawn.Queue(), spawn.Event()
    procs = [spawn.Process(target=_claim_all, args=(path, keys, queue, done)) for _ in range(2)]
    for p in procs:
        p.start()
    claimed = [queue.get(timeout=120) for _ in procs]
    done.set()
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


def test_a_version_7_db_gains_the_energy_columns_and_keeps_its_rows(tmp_path):
    conn = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    for migration in schema.MIGRATIONS[:7]:
        migration(conn)
    conn.execute("PRAGMA user_version = 7")
    conn.execute("INSERT INTO attempts (job_key, status, avg, energy_per_iter, predicted_time) "
                 "VALUES ('old', 'succeeded', 2.5, 40.0, 2.25)")
    conn.close()
    store = Store(tmp_path / "r.db")
    assert store.schema_version == SCHEMA_VERSION >= 8
    (old,) = store.attempts()
    assert (old["job_key"], old["avg"], old["energy_per_iter"], old["predicted_time"]) == ("old", 2.5, 40.0, 2.25)
    assert (old["avg_power"], old["energy_source"], old["predicted_energy"]) == (None, None, None)
    cursor = store.conn.execute("select * from results")
    assert [d[0] for d in cursor.description] == list(LEGACY_COLUMNS) and len(cursor.fetchall()) == 1


def test_measured_and_predicted_energy_land_in_their_columns_and_all_configs(tmp_path):
    """The job body's energy reading fills energy_per_iter, avg_power and energy_source (the whole
    reading, with its reason, in all_configs); a prediction's predicted_energy fills its column."""
    store = Store(tmp_path / "r.db")
    reading = {"source": "zeus:nvml", "joules_per_iter": 12.5, "watts_per_device": 310.0, "reason": None}
    power = {"limits": {"0": 250.0}, "applied": False, "reason": "no permission"}
    metrics = {"energy_per_iter": 12.5, "avg_power": 310.0, "energy_source": "zeus:nvml", "energy": reading,
               "power": power, "predicted_time": 0.04, "predicted_energy": 11.0}
    store.finish(store.claim("k", JOB, retry_failed=False), Outcome("succeeded", metrics=metrics))
    (row,) = store.attempts()
    assert (row["energy_per_iter"], row["avg_power"], row["energy_source"], row["predicted_energy"]) == (
        12.5, 310.0, "zeus:nvml", 11.0)
    configs = json.loads(row["all_configs"])
    assert (configs["energy"], configs["power"]) == (reading, power)


def test_auto_search_rows_of_0_1_0_are_not_attempts(tmp_path):
    """codesign 0.1.0 recorded every Auto search job as invalid "not supported yet": a plain rerun
    runs those jobs, and still skips every other recorded one."""
    conn = sqlite3.connect(tmp_path / "r.db")
    conn.executescript((DATA / "results_v0.1.0.sql").read_text())
    conn.close()
    store = Store(tmp_path / "r.db")
    decisions = {(p.job.parallel.description, p.job.num_micro_batches): store.decide(p.key, False).action
                 for p in enumerate_jobs(load_config(DATA / "results_v0.1.0.toml"), Hosts.local(0))}
    assert decisions == {("data parallel", 1): "skip", ("data parallel", 3): "skip", ("pipeline", 2): "skip",
                         ("Auto search", 1): "run"}
    (auto,) = [p for p in enumerate_jobs(load_config(DATA / "results_v0.1.0.toml"), Hosts.local(0))
               if p.job.parallel.is_auto]
    attempt = store.claim(auto.key, auto.job, retry_failed=False)
    assert attempt and store.finish(attempt, Outcome("oom", error="no plan fits"))
    assert store.decide(auto.key, retry_failed=False).action == "skip"  # a new attempt counts
    assert len(store.attempts(["invalid"])) == 2  # the old rows stay, for the record
def _attempts_with(store: Store, key: str, statuses: list[str]) -> None:
    for status in statuses:
        store.finish(store.claim(key, JOB, retry_failed=True), Outcome(status))


@pytest.mark.parametrize("history, plain, retrying", [
    ([], "run", "run"),
    (["interrupted"], "retry: interrupted 1 of 3", "retry: interrupted 1 of 3"),
    (["interrupted", "interrupted"], "retry: interrupted 2 of 3", "retry: interrupted 2 of 3"),
    (["interrupted"] * 3, "skip", "run"),  # three interruptions: treated like a failure
    (["failed", "interrupted"], "skip", "run"),
    (["interrupted", "succeeded"], "skip", "skip"),
])
def test_interrupted_attempts_are_retried_without_a_flag_up_to_three(tmp_path, history, plain, retrying):
    store = Store(tmp_path / "r.db")
    _attempts_with(store, "k", history)
    assert str(store.decide("k", retry_failed=False)) == plain
    assert str(store.decide("k", retry_failed=True)) == retrying
    claimed = store.claim("k", JOB, retry_failed=False)
    assert (claimed is not None) == (plain != "skip")


def test_results_view_answers_the_earlier_toolkits_queries(tmp_path):
    store = Store(tmp_path / "r.db")
    _attempts_with(store, "a", ["failed"])
    store.finish(store.claim("b", JOB, retry_failed=False), Outcome("succeeded", metrics={"avg": 1.5}))
    store.claim("c", JOB, retry_failed=False)  # still running: not a result yet
    store.close()
    conn = sqlite3.connect(tmp_path / "r.db")
    cursor = conn.execute("select * from results where avg is not null")
    assert [d[0] for d in cursor.description] == list(LEGACY_COLUMNS)
    (row,) = cursor.fetchall()
    assert row[LEGACY_COLUMNS.index("avg")] == 1.5 and row[LEGACY_COLUMNS.index("input_batch_size")] == 2
    assert conn.execute("select count(*), count(error) from results").fetchone() == (2, 0)
    conn.close()
    if shutil.which("sqlite3"):  # the program users type the query into, where installed
        out = subprocess.run(["sqlite3", "-header", str(tmp_path / "r.db"),
                              "select * from results where avg is not null"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        assert out[0] == "|".join(LEGACY_COLUMNS) and len(out) == 2 and "|1.5|" in out[1]


def test_results_view_can_be_recreated_after_attempts_is_rebuilt(tmp_path):
    store = Store(tmp_path / "r.db")
    store.finish(store.claim("b", JOB, retry_failed=False), Outcome("succeeded", metrics={"avg": 1.5}))
    with store._transaction() as conn:  # what a later migration rebuilding `attempts` does
        conn.execute("DROP VIEW results")
        conn.execute("CREATE TABLE attempts_new AS SELECT * FROM attempts")
        conn.execute("DROP TABLE attempts")
        conn.execute("ALTER TABLE attempts_new RENAME TO attempts")
        for statement in schema.RESULTS_VIEW:
            conn.execute(statement)
    assert [tuple(r) for r in store.conn.execute("select avg from results")] == [(1.5,)]


def test_a_db_of_the_previous_release_migrates_keeps_its_skips_and_answers_results(tmp_path):
    conn = sqlite3.connect(tmp_path / "r.db")
    conn.executescript((DATA / "results_v0.1.0.sql").read_text())
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    conn.close()
    store = Store(tmp_path / "r.db")
    assert store.schema_version == SCHEMA_VERSION
    config = load_config(DATA / "results_v0.1.0.toml")
    planned = list(enumerate_jobs(config, Hosts.local(0)))
    assert [str(store.decide(p.key, retry_failed=False)) for p in planned] == ["skip"] * 3 + ["run"]  # Auto search
    assert store.conn.execute("select count(*) from results where avg is not null").fetchone()[0] == 2
    assert store.conn.execute("select count(*) from results").fetchone()[0] == 4


def test_a_file_that_is_not_a_sound_db_is_refused_and_left_untouched(tmp_path):
    good = tmp_path / "good.db"
    store = Store(good)
    for i in range(300):  # several pages
        store.finish(store.claim(f"k{i}", JOB, retry_failed=False), Outcome("failed", error="x" * 200))
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    whole = good.read_bytes()
    cases = {"text.db": b"name,avg\na,1\n" * 100, "truncated.db": whole[:len(whole) // 2],
             "header.db": whole[:100]}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(StoreError, match="not a usable SQLite results DB") as err:
            Store(path)
        assert str(path) in str(err.value) and "left untouched" in str(err.value)
        assert path.read_bytes() == content, name


def test_two_processes_opening_a_fresh_db_at_once_both_work(tmp_path):
    script = ("import sys, time; from codesign.store.database import Store\n"
              "start = float(sys.argv[2])\n"
              "time.sleep(max(0.0, start - time.time()))\n"
              "store = Store(sys.argv[1]); print(store.schema_version)\n")
    for round in range(3):
        path, start = tmp_path / f"r{round}.db", time.time() + 1.5
        procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(start)], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        outputs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outputs]
        assert [out.strip() for out, _ in outputs] == [str(SCHEMA_VERSION)] * 3
        conn = sqlite3.connect(path)
        assert conn.execute("select count(*) from sqlite_master where name in ('attempts', 'results')"
                            ).fetchone()[0] == 2
        conn.close()


def test_a_running_attempt_with_no_heartbeat_is_reaped_not_a_crash(tmp_path):
    store = Store(tmp_path / "r.db")
    attempt = store.claim("k", JOB, retry_failed=False)
    store.conn.execute("UPDATE attempts SET heartbeat = NULL, host = 'elsewhere' WHERE id = ?", (attempt,))
    assert store.reap_stale() == 1
    assert store.attempts()[0]["status"] == "interrupted"


@pytest.mark.parametrize("name", ["what?.db", "a#b.db", "100%.db", "two words.db"])
def test_a_db_path_with_uri_characters_opens_read_only(tmp_path, name):
    store = Store(tmp_path / name)
    store.finish(store.claim("k", JOB, retry_failed=False), Outcome("failed", error="x"))
    store.close()
    reader = Store.open_if_exists(tmp_path / name)
    assert [r["status"] for r in reader.attempts()] == ["failed"]
    reader.close()


def test_every_page_is_checked_only_after_a_crash_or_on_request(tmp_path, monkeypatch):
    Store(tmp_path / "r.db").close()
    seen = []
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(seen.append)
        return conn

    monkeypatch.setattr("codesign.store.database.sqlite3.connect", traced)
    Store(tmp_path / "r.db").close()
    assert not any("quick_check" in s for s in seen)
    Store(tmp_path / "r.db", check=True).close()
    assert sum("quick_check" in s for s in seen) == 1
    (tmp_path / "r.db-journal").write_bytes(b"")  # what a crash mid-transaction leaves
    Store(tmp_path / "r.db").close()
    assert sum("quick_check" in s for s in seen) == 2


def test_a_metric_with_no_column_is_an_error_not_dropped(tmp_path):
    store = Store(tmp_path / "r.db")
    attempt = store.claim("k", JOB, retry_failed=False)
    with pytest.raises(ValueError, match="metrics with no column: throughput_typo"):
        store.finish(attempt, Outcome("succeeded", metrics={"avg": 1.0, "throughput_typo": 2.0}))
    assert store.attempts()[0]["status"] == "running"


def test_a_malformed_profile_row_is_reported_once_and_skipped_not_a_crash_of_every_command(tmp_path, caplog):
    """A DB's copies of profiles: one damaged, one missing fields, then a sound measured one that a
    simulated cluster needs. Each command says once which rows it skipped and prices with the rest."""
    import dataclasses
    import json

    from codesign.hardware.profiles import BUILTIN, Provenance, profile_id
    from codesign.run.profile_cache import profiles_for
    from tests.conftest import run_cli

    trn = dataclasses.replace(BUILTIN["H100"], kind="Trn1", provenance=Provenance("measured"))
    store = Store(tmp_path / "r.db")
    for pid, text in (("cpu@damaged", "{half"), ("cpu@fields", json.dumps({"kind": "cpu", "platform": "cpu"}))):
        store.keep_profile(pid, {"kind": "cpu", "platform": "cpu"})
        store.conn.execute("UPDATE profiles SET profile = ? WHERE profile_id = ?", (text, pid))
    store.keep_profile(profile_id(trn), trn.to_dict())
    with caplog.at_level("WARNING"):
        book = profiles_for(Hosts.local(0), store).book
    store.close()
    assert book.profiles["Trn1"] == trn
    assert [(r.levelname, r.getMessage().split(": ", 1)[1]) for r in caplog.records] == [
        ("WARNING", "table profiles, profile_id 'cpu@damaged': unreadable profile skipped (JSONDecodeError: "
                    "Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ("WARNING", "table profiles, profile_id 'cpu@fields': unreadable profile skipped (KeyError: 'rates')")]
    (tmp_path / "c.toml").write_text(SMALL_HEAD + '[[cluster_spec]]\nnum_hosts = 1\nnum_devices_per_host = 8\n'
                                     'transport = "NVLink"\nplatform = "sim"\ndevice = "Trn1"\n\n'
                                     '[[parallel_spec]]\ndescription = "dp"\nnum_micro_batches = [1]\n'
                                     '"(pp, dp, op)" = [1, 8, 1]\n')
    for command in (("-c", "c.toml", "-d", "r.db"), ("reprice", "-d", "r.db")):
        proc = run_cli(*command, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert [proc.stderr.count(f"profile_id {pid!r}: unreadable profile skipped")
                for pid in ("cpu@damaged", "cpu@fields")] == [1, 1]
    (row,) = Store(tmp_path / "r.db").attempts()
    assert row["status"] == "simulated" and row["profile_id"] == profile_id(trn)


def test_a_damaged_cached_profile_is_reported_naming_its_file_and_skipped(tmp_path, caplog):
    from codesign.run.profile_cache import Machine, ProfileCache

    cache, here = ProfileCache(tmp_path), Machine("cpu", "cpu", "Some CPU x 2", (("jax", "1"),))
    assert cache.load(here) is None and not caplog.records  # none cached: nothing to say
    cache.path(here).write_text("{half")
    with caplog.at_level("WARNING"):
        assert cache.load(here) is None
    (record,) = caplog.records
    assert record.getMessage().startswith(f"{cache.path(here)}: unreadable cached profile of the cpu devices")
