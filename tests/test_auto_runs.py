"""Auto search jobs run: the orchestrator chooses the plan (planner.auto.choose_plan), the job
body runs it (or trials the auto_trials best and runs the fastest), and the attempt records the
plan in the manual spec's columns, its prediction and the search."""

import dataclasses
import json

import pytest

from codesign.planner.auto import NoPlanFits, choose_plan
from codesign.planner.columns import plan_columns
from codesign.cost.plan import Plan
from codesign.hardware.profiles import ProfileBook
from codesign.report.frame import attempts_frame
from codesign.run.local import LocalExecutor
from codesign.run.profile_cache import Profiles
from codesign.run.sweep import Pricing, run_sweep
from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.store.database import Store
from tests.conftest import FAST_XLA, db_rows, run_cli, run_on_devices

TOKENS = (("ATTENTION", "LINEAR"), ("DOT",), ("CONVOLUTION", "LINEAR"), ("DOT", "LINEAR"))
# 4 virtual devices, global batch 12 in 2 micro-batches of 6: whole on 1, 2 or 3 devices.
CONFIG = """
[training_spec]
avg_batch_size_per_device = 3
num_iters = 3

[[model]]
num_features = 8
emb_dim = 4
output_per_emb = 2
num_zhen_layers = 4
tokens = [["ATTENTION", "LINEAR"], ["DOT"], ["CONVOLUTION", "LINEAR"], ["DOT", "LINEAR"]]

[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 4
transport = "NVLink"
platform = "cpu"

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [2]
num_auto_layers = 4
"""
MODEL = ModelSpec(8, 4, 2, 4, TOKENS)
JOB = Job(MODEL, ClusterSpec(1, 4, "NVLink", "cpu"), TrainingSpec(3, 3),
          ParallelSpec("Auto search", (2,), num_auto_layers=4), 2, "cpu")

SCRIPT = """
import json
from codesign.cost.plan import Plan
from codesign.config.types import ClusterSpec, Job, ParallelSpec, TrainingSpec
from tests.reference import differences, live_leaves, two_steps
from tests.test_auto_runs import JOB, MODEL

plan = Plan.from_dict(json.loads(PLAN))
reference = two_steps(Job(MODEL, ClusterSpec(1, 1, "NVLink", "cpu"), TrainingSpec(12, 2),
                          ParallelSpec("reference", (2,), 1, False, (1, 1, 1)), 2, "cpu"))
print(json.dumps({"ref": reference["losses"],
                  "diff": differences(two_steps(JOB, plan), reference, live_leaves(reference))}))
"""



def uniform(plan: Plan) -> bool:
    return len({(s.dp, s.op) for s in plan.stages}) == 1


def run_config(tmp_path, config: str) -> dict:
    (tmp_path / "c.toml").write_text(config)
    proc = run_cli("-c", "c.toml", cwd=tmp_path, env={"XLA_FLAGS": FAST_XLA})
    assert proc.returncode == 0, proc.stderr
    (row,) = db_rows(tmp_path / "results.db")
    return row


@pytest.mark.slow
def test_an_auto_search_job_runs_its_chosen_plan_and_matches_the_reference(tmp_path):
    row = run_config(tmp_path, CONFIG)
    assert row["status"] == "succeeded", row["error"]
    configs = json.loads(row["all_configs"])
    plan = Plan.from_dict(configs["chosen_plan"])
    search = configs["auto_search"]
    assert search["priced"] >= 1 and 0 < search["search_seconds"] < 5 and len(search["runners_up"]) <= 5
    best = choose_plan(JOB, ProfileBook()).best()  # the search is deterministic: the same plan again
    assert best.plan == plan
    assert (row["predicted_time"], row["predicted_memory"]) == (best.estimate.seconds, best.estimate.peak_bytes)
    assert configs["prediction"]["seconds"] == best.estimate.seconds
    columns = plan_columns(plan, 4)
    recorded = {k: row[k] for k in columns}
    assert recorded == {k: v if isinstance(v, int) else json.dumps(v) for k, v in columns.items()}
    assert row["avg"] > 0 and len(configs["losses"]) == 3
    (label,) = attempts_frame([row])["plan"]  # the report names the chosen plan by its columns
    assert label.startswith(f"Auto search | pp{len(plan.stages)} " if uniform(plan) else
                            f"Auto search | pp_dp_op {row['pp_dp_op']} | mb2 | groups 4")
    out = run_on_devices(4, f"PLAN = {json.dumps(plan.to_dict())!r}\n{SCRIPT}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["diff"]["initial"] == 0.0 and result["diff"]["loss"] < 1e-5, result
    assert result["diff"]["update"] < 1e-3 and result["diff"]["grad"] < 1e-4, result
    assert abs(configs["losses"][0] - result["ref"][0]) < 1e-5 and abs(configs["losses"][1] - result["ref"][1]) < 1e-5


@pytest.mark.slow
def test_two_trials_are_measured_and_the_fastest_runs(tmp_path):
    row = run_config(tmp_path, CONFIG + "auto_trials = 2\n")
    assert row["status"] == "succeeded", row["error"]
    configs = json.loads(row["all_configs"])
    trials = configs["auto_trials"]
    assert len(trials) == 2 and all(t["measured_time"] > 0 and t["predicted_time"] > 0 for t in trials)
    ranked = choose_plan(dataclasses.replace(JOB, parallel=dataclasses.replace(JOB.parallel, auto_trials=2)),
                         ProfileBook()).trials(2)  # the best plans of two shapes
    assert [t["predicted_time"] for t in trials] == [c.estimate.seconds for c in ranked]
    assert trials[0]["pp_dp_op"] != trials[1]["pp_dp_op"] or trials[0]["layers"] != trials[1]["layers"]
    fastest = min(range(2), key=lambda i: trials[i]["measured_time"])
    assert Plan.from_dict(configs["chosen_plan"]) == ranked[fastest].plan
    assert row["pp_dp_op"] == json.dumps(trials[fastest]["pp_dp_op"])
    assert row["predicted_time"] == ranked[fastest].estimate.seconds


def test_when_no_plan_fits_the_job_is_oom_with_the_reason_and_never_starts(tmp_path):
    book = ProfileBook()
    book.profiles["cpu"] = dataclasses.replace(book.profiles["cpu"], memory=4096)
    (tmp_path / "c.toml").write_text(CONFIG)
    planned = list(enumerate_jobs(load_config(tmp_path / "c.toml"), Hosts.local(0)))
    with pytest.raises(NoPlanFits) as err:
        choose_plan(planned[0].job, book)
    reason = str(err.value)
    store = Store(tmp_path / "r.db")
    summary = run_sweep(planned, store, LocalExecutor(), False, 60, pricing=Pricing(Profiles(book)))
    (row,) = store.attempts()
    assert dict(summary.statuses) == {"oom": 1}
    assert (row["status"], row["error"], row["job_duration"], row["avg"]) == ("oom", reason, 0.0, None)
    assert "GiB" in reason


def test_auto_search_on_a_simulated_cluster_records_the_chosen_plan(tmp_path):
    config = CONFIG.replace('platform = "cpu"', 'platform = "sim"\ndevice = "H100"').replace(
        "num_devices_per_host = 4", "num_devices_per_host = 8")
    row = run_config(tmp_path, config)
    assert (row["status"], row["platform"], row["avg"]) == ("simulated", "sim", None)
    configs = json.loads(row["all_configs"])
    plan = Plan.from_dict(configs["chosen_plan"])
    assert sum(s.dp * s.op for s in plan.stages) <= 8 and configs["auto_search"]["priced"] >= 1
    assert row["predicted_time"] > 0 and row["predicted_memory"] > 0
    assert row["pp_dp_op"] == json.dumps(plan_columns(plan, 8)["pp_dp_op"])
