"""Plans the toolkit chooses: any contiguous split of the layer groups over stages, each stage on
its own submesh; checked, run against the single-device reference, recorded, and sent to the
job body as JSON."""

import dataclasses
import json
import re

import pytest

from codesign.engine.job import run_job
from codesign.errors import PlanError
from codesign.planner.columns import plan_columns
from codesign.cost.plan import Plan, make_plan, plan_from_stages
from codesign.run.local import LocalExecutor
from codesign.run.sweep import Attempt, Sweep
from codesign.config.jobs import PlannedJob
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.store.database import Store
from tests.conftest import FAST_XLA, run_on_devices
from tests.reference import assert_matches

TOKENS = (("ATTENTION", "LINEAR"), ("DOT",), ("CONVOLUTION", "LINEAR"), ("DOT", "LINEAR"))
MODEL = ModelSpec(8, 4, 2, 4, TOKENS)
AUTO = ParallelSpec("Auto search", (2,), num_auto_layers=4)
# 1 host x 4 virtual devices, global batch 12 in 2 micro-batches of 6: whole on 1, 2 or 3 devices.
JOB = Job(MODEL, ClusterSpec(1, 4, "NVLink", "cpu"), TrainingSpec(3, 2), AUTO, 2, "cpu")
CASES = {  # name: (groups per stage, devices per stage, (dp, op) per stage, options)
    "groups 3|1": ([[0, 1, 2], [3]], [[0, 1], [2, 3]], [(2, 1), (2, 1)], {}),
    "devices 3|1": ([[0, 1], [2, 3]], [[0, 1, 2], [3]], [(3, 1), (1, 1)], {"reduce_scatter": True}),
    "pp3 1|2|1 op": ([[0], [1, 2], [3]], [[3], [0, 1], [2]], [(1, 1), (1, 2), (1, 1)],
                     {"remat": True, "schedule": "GPipe"}),
}

SCRIPT = """
import json, sys
from codesign.cost.plan import plan_from_stages
from codesign.config.types import ClusterSpec, Job, ParallelSpec, TrainingSpec
from tests.reference import differences, live_leaves, two_steps
from tests.test_uneven import CASES, JOB, MODEL

reference = two_steps(Job(MODEL, ClusterSpec(1, 1, "NVLink", "cpu"), TrainingSpec(12, 2),
                          ParallelSpec("reference", (2,), 1, False, (1, 1, 1)), 2, "cpu"))
live = live_leaves(reference)
result = {}
for name, (groups, devices, meshes, options) in CASES.items():
    plan = plan_from_stages(JOB, groups, devices, meshes, **options)
    result[name] = differences(two_steps(JOB, plan), reference, live)
    print(name, result[name], file=sys.stderr, flush=True)
print(json.dumps({"ref": reference["losses"], "cases": result}))
"""


@pytest.mark.slow
def test_uneven_partitions_match_single_device_reference():
    out = run_on_devices(4, SCRIPT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ref"][1] < result["ref"][0]
    assert sorted(result["cases"]) == sorted(CASES)
    for name, diff in result["cases"].items():
        assert_matches(name, diff)


def test_stages_take_their_own_groups_and_submeshes():
    groups, devices, meshes, options = CASES["pp3 1|2|1 op"]
    plan = plan_from_stages(JOB, groups, devices, meshes, **options)
    assert [s.layers for s in plan.stages] == [(0,), (1, 2), (3,)]
    assert [(s.device_ids, s.dp, s.op) for s in plan.stages] == [((3,), 1, 1), ((0, 1), 1, 2), ((2,), 1, 1)]
    assert (plan.remat, plan.schedule, plan.placement, plan.num_micro_batches) == (True, "GPipe", "chosen", 2)
    two = plan_from_stages(JOB, [[0], [1]], [[0], [1, 2, 3]], [(1, 1), (3, 1)], num_groups=2)
    assert [s.groups for s in two.stages] == [((0,),), ((1, 2, 3),)]  # by FLOPs: layer 0 attends


@pytest.mark.parametrize("groups, devices, meshes, reason", [
    ([[0, 1], [3, 2]], [[0], [1]], [(1, 1), (1, 1)], "must take a contiguous run of the 4 layer groups"),
    ([[0, 1], [1, 2, 3]], [[0], [1]], [(1, 1), (1, 1)], "must take a contiguous run"),
    ([[0, 1, 2]], [[0]], [(1, 1)], "got [[0, 1, 2]]"),
    ([[0, 1, 2, 3], []], [[0], [1]], [(1, 1), (1, 1)], "stage 1 takes no layer groups"),
    ([[0, 1], [2, 3]], [[0]], [(1, 1), (1, 1)], "2 stages of layer groups, 1 device lists"),
    ([[0, 1], [2, 3]], [[0, 1], [1]], [(2, 1), (1, 1)], "device(s) [1] are placed in more than one stage"),
    ([[0, 1], [2, 3]], [[0], [4]], [(1, 1), (1, 1)], "device(s) [4] are outside the cluster of 4 devices"),
    ([[0, 1], [2, 3]], [[0, 1, 2], [3]], [(1, 2), (1, 1)], "stage 0 gets 3 devices, but dp * op = 2"),
    ([[0, 1], [2, 3]], [[0], [1, 2, 3, 4]], [(1, 1), (0, 4)], "(dp, op) of every stage must be positive"),
    ([[0, 1], [2, 3]], [[0], [1, 2, 3]], [(1, 1), (3, 1)], None),
])
def test_plans_that_cannot_run_are_rejected_with_the_reason(groups, devices, meshes, reason):
    if reason is None:
        assert len(plan_from_stages(JOB, groups, devices, meshes).stages) == 2
        return
    with pytest.raises(PlanError, match=re.escape(reason)):
        plan_from_stages(JOB, groups, devices, meshes)


def test_a_stage_whose_batch_share_is_not_whole_is_rejected():
    job = dataclasses.replace(JOB, num_micro_batches=3)  # micro-batches of 4 samples
    with pytest.raises(PlanError, match=re.escape("4 samples cannot be split over 3 devices of mesh axis dp "
                                                  "of stage 0")):
        plan_from_stages(job, [[0, 1], [2, 3]], [[0, 1, 2], [3]], [(3, 1), (1, 1)])
    # batch on op: stage 0 (op 1) holds the whole micro-batch on each of its dp replicas
    assert plan_from_stages(job, [[0, 1], [2, 3]], [[0, 1, 2], [3]], [(3, 1), (1, 1)], batch_axis="op")


def test_plan_json_round_trips_and_is_checked_against_the_job():
    groups, devices, meshes, options = CASES["pp3 1|2|1 op"]
    plan = plan_from_stages(JOB, groups, devices, meshes, **options)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.describe() == plan.describe()
    manual = Job(MODEL, JOB.cluster, JOB.training, ParallelSpec("m", (2,), 4, True, (2, 2, 1)), 2, "cpu")
    assert Plan.from_dict(json.loads(json.dumps(make_plan(manual).to_dict()))) == make_plan(manual)
    with pytest.raises(PlanError, match="malformed plan"):
        Plan.from_dict({"stages": [{"groups": [[0]]}]})


def test_a_chosen_plan_that_does_not_fit_its_job_is_invalid():
    plan = plan_from_stages(JOB, [[0, 1], [2, 3]], [[0, 1, 2], [3]], [(3, 1), (1, 1)])
    on_two = dataclasses.replace(JOB, cluster=ClusterSpec(1, 2, "NVLink", "cpu"), training=TrainingSpec(6, 2))
    outcome = run_job(on_two, [plan])
    assert (outcome.status, outcome.error) == ("invalid", "device(s) [2, 3] are outside the cluster of 2 devices")
    data = plan.to_dict()
    data["stages"][1]["groups"] = [[3]]
    outcome = run_job(JOB, [Plan.from_dict(data)])
    assert outcome.status == "invalid" and "each layer group must take a contiguous run of the 4 layers" in outcome.error


def test_chosen_plan_columns_in_the_manual_spec_form():
    uneven = plan_from_stages(JOB, [[0, 1], [2, 3]], [[0, 1, 2], [3]], [(3, 1), (1, 1)], remat=True)
    assert plan_columns(uneven, 4) == {
        "pp_dp_op": [2, [3, 1], 1], "physical_mesh_shapes": [[1, 3], [1, 1]],
        "host_ids": [[0], [0]], "device_ids": [[[0, 1, 2]], [[3]]], "num_auto_layers": 4, "remat_layer": 1}
    on_two_hosts = plan_columns(uneven, 2)  # devices 0-1 on host 0, 2-3 on host 1
    assert on_two_hosts["host_ids"] == [[0, 1], [1]] and on_two_hosts["device_ids"] == [[[0, 1], [0]], [[1]]]
    assert on_two_hosts["physical_mesh_shapes"] == [None, [1, 1]]  # stage 0 holds 2 + 1: no tile


def test_columns_of_an_even_plan_are_a_manual_spec_that_runs_the_same_plan():
    """A hand-written 2 x 8 plan with interleaved stages: its columns, written back as a manual
    spec, place every stage on the same devices in the same (dp, op) order."""
    cluster = ClusterSpec(2, 8, "TCPx4", "cpu")
    hosts, devices = ((0, 1), (0, 1)), (((0, 2, 4, 6), (0, 2, 4, 6)), ((1, 3, 5, 7), (1, 3, 5, 7)))
    spec = ParallelSpec("interleaved", (1,), 4, False, (2, 4, 2), None, (), hosts, devices)
    plan = make_plan(Job(MODEL, cluster, TrainingSpec(1, 2), spec, 1, "cpu"))
    columns = plan_columns(plan, cluster.num_devices_per_host)
    assert columns["pp_dp_op"] == [2, 4, 2] and columns["physical_mesh_shapes"] == [2, 4]
    written = dataclasses.replace(spec, pp_dp_op=tuple(columns["pp_dp_op"]),
                                  host_ids=tuple(map(tuple, columns["host_ids"])),
                                  device_ids=tuple(tuple(map(tuple, s)) for s in columns["device_ids"]))
    again = make_plan(Job(MODEL, cluster, TrainingSpec(1, 2), written, 1, "cpu"))
    assert [s.device_ids for s in again.stages] == [s.device_ids for s in plan.stages]


def test_job_body_runs_the_chosen_plan_and_the_store_records_it(tmp_path, monkeypatch):
    """The plan goes to the job body as JSON, runs there instead of deriving one from a spec, and
    its attempt gets the manual spec's columns."""
    monkeypatch.setenv("XLA_FLAGS", FAST_XLA)
    job = dataclasses.replace(JOB, model=ModelSpec(8, 4, 2, 2, (("LINEAR", "DOT"),) * 2),
                              parallel=dataclasses.replace(AUTO, num_auto_layers=2))
    plan = plan_from_stages(job, [[0], [1]], [[1, 2, 3], [0]], [(3, 1), (1, 1)])
    store = Store(tmp_path / "r.db")
    attempt = store.claim("auto", job, retry_failed=False)
    executor = LocalExecutor()
    run = executor.start(job, 300, [plan])
    ((_, outcome),) = executor.wait([run], 300)
    assert outcome.status == "succeeded", outcome.error
    assert [s["device_ids"] for s in outcome.plan["stages"]] == [[1, 2, 3], [0]]
    assert Plan.from_dict(outcome.chosen_plan) == plan
    Sweep([], store, executor, False, 300, 1).record(Attempt(PlannedJob(job), attempt, None), outcome)
    (row,) = store.attempts()
    assert (row["pp_dp_op"], row["host_ids"], row["device_ids"]) == ("[2, [3, 1], 1]", "[[0], [0]]",
                                                                     "[[[1, 2, 3]], [[0]]]")
    assert (row["physical_mesh_shapes"], row["num_auto_layers"], row["description"]) == (
        "[[1, 3], [1, 1]]", 2, "Auto search")
    assert Plan.from_dict(json.loads(row["all_configs"])["chosen_plan"]) == plan
