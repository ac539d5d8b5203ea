"""`codesign reprice`: each attempt re-priced with the links it recorded; what a measured attempt
predicted before it ran is never rewritten (its repricings sit beside it), a simulated attempt's
prediction is replaced and the one it replaces kept."""

import json
import sqlite3

import pandas as pd
import pytest

from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.outcome import Outcome
from codesign.cost.model import COST_MODEL_VERSION, predict
from codesign.hardware.profiles import ProfileBook
from codesign.store import schema
from codesign.store.database import Store
from codesign.store.schema import EARLIER_PREDICTIONS, LEGACY_COLUMNS, PRICED_BY, REPRICED_COLUMNS
from tests.conftest import REPO, db_rows, run_cli

SEED_SIM = (REPO / "bench" / "plan_sim.toml").read_text()  # seed model on 8, 16, 64 simulated H100s
LINKS = "\n[links.NVLink]\nbandwidth = 5e10\nlatency = 1e-4\n[links.EFAx4]\nbandwidth = 1e9\nlatency = 1e-3\n"
SIM_JOB = Job(ModelSpec(4, 2, 1, 1, (("LINEAR",),)), ClusterSpec(2, 8, "EFAx4", "sim", "H100"),
              TrainingSpec(2, 2), ParallelSpec("dp", (1,), 1, False, (1, 16, 1)), 1, "sim")
CPU_JOB = Job(ModelSpec(4, 2, 1, 1, (("LINEAR",),)), ClusterSpec(1, 2, "NVLink", "cpu"), TrainingSpec(2, 2),
              ParallelSpec("dp", (1,), 1, False, (1, 2, 1)), 1, "cpu")
# what a measured attempt predicted before it ran, as a sweep records it
BEFORE = {"predicted_time": 0.5, "predicted_memory": 7, "predicted_energy": 3.0, "profile_id": "cpu@before",
          "cost_model": "v0", "prediction": {"seconds": 0.5, "calibration": None, "links": []}}


def test_reprice_with_nothing_changed_keeps_every_prediction_of_a_db_priced_with_custom_links(tmp_path):
    (tmp_path / "c.toml").write_text(SEED_SIM + LINKS)
    assert run_cli("-c", "c.toml", cwd=tmp_path).returncode == 0
    before = db_rows(tmp_path / "results.db")
    assert len(before) == 5 and all(json.loads(r["all_configs"])["prediction"]["links"] for r in before)
    proc = run_cli("reprice", "-d", "results.db", cwd=tmp_path)
    assert proc.returncode == 0 and "re-priced 5 attempts" in proc.stderr, proc.stderr
    after = db_rows(tmp_path / "results.db")
    assert [r["predicted_time"] for r in after] == [r["predicted_time"] for r in before]
    assert [r["predicted_memory"] for r in after] == [r["predicted_memory"] for r in before]
    assert [json.loads(r["all_configs"]) for r in after] == [json.loads(r["all_configs"]) for r in before]


def test_reprice_prices_an_attempt_that_recorded_no_links_with_the_configs_and_keeps_what_it_replaces(tmp_path):
    """An attempt of an older codesign recorded no links: `-c`'s price it, and from then on it
    keeps them; each prediction replaced stays in its history, the columns hold the new one."""
    store = Store(tmp_path / "r.db")
    attempt = store.claim("k", SIM_JOB, retry_failed=False)
    store.finish(attempt, Outcome("simulated", metrics={"predicted_time": 123.0, "predicted_memory": 1}))
    store.close()
    (tmp_path / "slow.toml").write_text(SEED_SIM + LINKS)
    assert run_cli("reprice", "-d", "r.db", "-c", "slow.toml", cwd=tmp_path).returncode == 0
    (slow,) = db_rows(tmp_path / "r.db")
    assert run_cli("reprice", "-d", "r.db", cwd=tmp_path).returncode == 0
    (again,) = db_rows(tmp_path / "r.db")
    assert again == slow
    configs = json.loads(again["all_configs"])
    assert {link["name"] for link in configs["prediction"]["links"]} == {"NVLink", "EFAx4"}
    assert again["predicted_time"] > 1.5 * predict(SIM_JOB, ProfileBook())["predicted_time"]
    assert configs[EARLIER_PREDICTIONS] == [{"predicted_time": 123.0, "predicted_memory": 1, "predicted_energy": None,
                                             "profile_id": None, "cost_model": None, "prediction": None}]


def measured_db(path) -> None:
    """A succeeded and a timed-out CPU attempt with what they predicted before they ran, and a simulated one."""
    store = Store(path)
    for key, outcome in (("ok", Outcome("succeeded", metrics={"median": 0.25, "max_memory": 9, **BEFORE})),
                         ("slow", Outcome("timeout", error="timed out", metrics=BEFORE))):
        store.finish(store.claim(key, CPU_JOB, retry_failed=False), outcome)
    store.finish(store.claim("sim", SIM_JOB, retry_failed=False),
                 Outcome("simulated", metrics={"predicted_time": 123.0, "predicted_memory": 1}))
    store.close()


def test_reprice_then_export_keeps_every_prediction_made_before_a_job_ran_with_the_new_one_beside(tmp_path):
    measured_db(tmp_path / "r.db")
    before = db_rows(tmp_path / "r.db")
    proc = run_cli("reprice", "-d", "r.db", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("re-priced 3 attempts of r.db: 2 measured, each new prediction kept beside the one it made before "
            "it ran (0 in-sample: by a calibration fitted to them); 1 simulated, their predictions replaced"
            ) in proc.stderr
    assert run_cli("export", "all", "-d", "r.db", "-o", "all.csv", cwd=tmp_path).returncode == 0
    frame = pd.read_csv(tmp_path / "all.csv")
    assert list(frame.columns) == [*before[0], *REPRICED_COLUMNS]  # the DB's columns where they were, then these
    ok, slow, sim = frame.to_dict("records")
    for row in (ok, slow):
        assert [row[k] for k in PRICED_BY] == [BEFORE[k] for k in PRICED_BY]
        assert json.loads(row["all_configs"])["prediction"] == BEFORE["prediction"]
        assert 0 < row["repriced_time"] != BEFORE["predicted_time"] and row["repriced_memory"] > 0
        assert row["repriced_profile_id"].startswith("cpu@") and row["repriced_cost_model"] == COST_MODEL_VERSION
        assert pd.isna(row["repriced_calibration"]) and row["repriced_in_sample"] == 0 and row["repriced_at"] > 0
    assert sim["predicted_time"] != 123.0 and pd.isna(sim["repriced_time"])  # its prediction is its result
    assert [r["all_configs"] for r in db_rows(tmp_path / "r.db")][:2] == [r["all_configs"] for r in before][:2]
    assert run_cli("reprice", "-d", "r.db", cwd=tmp_path).returncode == 0  # one more repricing each, oldest kept
    assert [r["attempt_id"] for r in db_rows(tmp_path / "r.db", "repricings")] == [1, 2, 1, 2]
    assert [r[k] for r in db_rows(tmp_path / "r.db")[:2] for k in PRICED_BY] == [
        r[k] for r in before[:2] for k in PRICED_BY]


def test_the_store_never_rewrites_a_prediction_made_before_an_attempt_ran(tmp_path):
    store = Store(tmp_path / "r.db")
    ran = store.claim("ran", CPU_JOB, retry_failed=False)
    store.finish(ran, Outcome("succeeded", metrics={"median": 0.25, **BEFORE}))
    running = store.claim("running", CPU_JOB, retry_failed=False)
    simulated = store.claim("sim", SIM_JOB, retry_failed=False)
    store.finish(simulated, Outcome("simulated", metrics={"predicted_time": 123.0}))
    again = {"predicted_time": 2.0, "profile_id": "cpu@now", "prediction": {"calibration": 3}}
    with pytest.raises(ValueError, match="is not simulated"):
        store.reprice_simulated(ran, again)
    for attempt in (running, simulated):
        with pytest.raises(ValueError, match="running, simulated or absent"):
            store.reprice(attempt, again, in_sample=False)
    store.reprice(ran, again, in_sample=True)
    (row,) = [r for r in store.attempts_repriced() if r["id"] == ran]
    store.close()
    assert (row["predicted_time"], row["profile_id"]) == (0.5, "cpu@before")
    assert (row["repriced_time"], row["repriced_profile_id"], row["repriced_calibration"], row["repriced_in_sample"]
            ) == (2.0, "cpu@now", 3, 1)


def test_a_db_an_earlier_codesign_repriced_in_place_gets_its_predictions_back(tmp_path):
    """Schema v9: a measured attempt re-priced in place gets back what it predicted before it ran;
    the predictions that replaced it become its repricings (in-sample where a calibration made
    them). A simulated attempt's history stays as it was; `results` answers as before."""
    conn = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    for migration in schema.MIGRATIONS[:8]:
        migration(conn)
    conn.execute("PRAGMA user_version = 8")
    later = {**BEFORE, "predicted_time": 0.75, "profile_id": "cpu@later", "prediction": {"calibration": None}}
    latest = {"predicted_time": 0.875, "predicted_memory": 8, "predicted_energy": None, "profile_id": "cpu@latest",
              "cost_model": "1"}
    history = {EARLIER_PREDICTIONS: [BEFORE, later], "prediction": {"calibration": 2}, "parallel": {}}
    for status in ("succeeded", "simulated"):
        conn.execute(f"INSERT INTO attempts (job_key, status, avg, all_configs, {', '.join(latest)}) VALUES "
                     f"(?, ?, 1.0, ?, {', '.join('?' for _ in latest)})", (status, status, json.dumps(history),
                                                                          *latest.values()))
    conn.close()
    store = Store(tmp_path / "r.db")
    measured, simulated = store.attempts()
    store.close()
    assert [measured[k] for k in PRICED_BY] == [BEFORE[k] for k in PRICED_BY]
    assert json.loads(measured["all_configs"]) == {"prediction": BEFORE["prediction"], "parallel": {}}
    assert [(r["attempt_id"], r["predicted_time"], r["profile_id"], r["calibration"], r["in_sample"], r["repriced_at"])
            for r in db_rows(tmp_path / "r.db", "repricings")] == [
        (1, 0.75, "cpu@later", None, 0, None), (1, 0.875, "cpu@latest", 2, 1, None)]
    assert [simulated[k] for k in latest] == list(latest.values()) and json.loads(simulated["all_configs"]) == history
    conn = sqlite3.connect(tmp_path / "r.db")
    cursor = conn.execute("SELECT * FROM results")
    assert [d[0] for d in cursor.description] == list(LEGACY_COLUMNS) and len(cursor.fetchall()) == 2
    conn.close()
