"""`codesign reprice`: each attempt re-priced with the links it recorded, its earlier prediction kept."""

import json

from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.outcome import Outcome
from codesign.cost.model import predict
from codesign.hardware.profiles import ProfileBook
from codesign.store.database import EARLIER_PREDICTIONS, Store
from tests.conftest import REPO, db_rows, run_cli

SEED_SIM = (REPO / "bench" / "plan_sim.toml").read_text()  # seed model on 8, 16, 64 simulated H100s
LINKS = "\n[links.NVLink]\nbandwidth = 5e10\nlatency = 1e-4\n[links.EFAx4]\nbandwidth = 1e9\nlatency = 1e-3\n"
SIM_JOB = Job(ModelSpec(4, 2, 1, 1, (("LINEAR",),)), ClusterSpec(2, 8, "EFAx4", "sim", "H100"),
              TrainingSpec(2, 2), ParallelSpec("dp", (1,), 1, False, (1, 16, 1)), 1, "sim")


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
