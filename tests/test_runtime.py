"""The job body in this process: the fit check before allocation, and what is measured."""

import dataclasses
import json
import math

import jax
import pytest

from codesign.engine import job as job_body
from codesign.engine import programs
from codesign.cost.plan import make_plan
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from tests.conftest import run_on_devices


class SmallDevice:
    """Stands in for a GPU's allocator statistics: CPUs report no memory limit."""

    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


JOB = Job(ModelSpec(64, 16, 4, 2, (("DOT", "LINEAR"),) * 2), ClusterSpec(1, 1, "NVLink", "cpu"),
          TrainingSpec(32, 3), ParallelSpec("single", (1,), 1, False, (1, 1, 1)), 1, "cpu")


def test_too_big_a_plan_is_oom_before_anything_is_allocated(monkeypatch):
    allocated = []
    monkeypatch.setattr(programs, "init_state", lambda *a: allocated.append(a))
    monkeypatch.setattr(jax, "local_devices", lambda: [SmallDevice(1 << 20)])
    outcome = job_body.run_job(JOB)
    assert outcome.status == "oom" and not allocated
    assert "GiB per device, the device has 0.00 GiB" in outcome.error
    assert outcome.plan["stages"][0]["device_ids"] == [0]


def test_too_big_a_pipeline_is_oom_before_anything_is_allocated():
    """Every stage compiled on abstract arrays, and the fit checked, before any stage's state is made."""
    proc = run_on_devices(2, """
        import dataclasses, json
        import jax
        from codesign.engine import job as job_body, programs
        from tests.test_runtime import JOB, SmallDevice
        from codesign.config.types import ClusterSpec, ParallelSpec
        allocated = []
        programs.init_state = lambda *a, **k: allocated.append(a)
        jax.local_devices = lambda: [SmallDevice(1 << 20)]
        job = dataclasses.replace(JOB, cluster=ClusterSpec(1, 2, "NVLink", "cpu"),
                                  parallel=ParallelSpec("pipeline", (2,), 2, pp_dp_op=(2, 1, 1)), num_micro_batches=2)
        outcome = job_body.run_job(job)
        print(json.dumps([outcome.status, outcome.error, [s["device_ids"] for s in outcome.plan["stages"]], allocated]))
    """)
    status, error, devices, allocated = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (status, devices, allocated) == ("oom", [[0], [1]], []), proc.stderr[-2000:]
    assert "GiB per device, the device has 0.00 GiB" in error


@pytest.mark.slow
def test_warm_up_steps_are_trained_but_not_timed():
    job = dataclasses.replace(JOB, training=TrainingSpec(32, 6))  # 6 iterations: 2 warm-up
    outcome = job_body.run_job(job)
    assert outcome.status == "succeeded", outcome.error
    losses, m = outcome.metrics["losses"], outcome.metrics
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert 0 < m["median"] <= m["p90"] and m["throughput"] == pytest.approx(32 / m["avg"])
    assert m["compile_time"] > 0 and m["max_memory"] > 0
    assert (m["energy_per_iter"], m["avg_power"], m["energy_source"]) == (None, None, None)  # no RAPL, no GPU
    assert m["energy"]["reason"]  # says why, in all_configs
    training = job_body.build_training(job, make_plan(job))
    losses, times, energy = job_body.measure_steps(training, job, jax.local_devices())
    assert (len(losses), len(times), energy.joules_per_iter) == (6, 4, None)


def test_min_measured_seconds_times_more_steps_until_they_add_up_to_it():
    """Past num_iters, the measured steps go on, in rounds priced at their median pace, until
    they have taken min_measured_seconds."""
    job = dataclasses.replace(JOB, training=TrainingSpec(32, 4, min_measured_seconds=0.3))
    training = job_body.build_training(job, make_plan(job))
    losses, times, _ = job_body.measure_steps(training, job, jax.local_devices())
    assert len(times) > 3 and len(losses) == len(times) + job.training.warmup_iters
    assert sum(times) >= 0.3 > sum(times[:3])
    assert job_body.more_steps([0.125] * 3, 1.0) == 5 and job_body.more_steps([0.5] * 3, 1.0) == 0


def test_an_auto_search_job_without_a_chosen_plan_is_invalid():
    """The orchestrator chooses an Auto search job's plan; the job body never guesses one."""
    job = dataclasses.replace(JOB, parallel=ParallelSpec("Auto search", (1,), 1))
    outcome = job_body.run_job(job)
    assert (outcome.status, outcome.error) == (
        "invalid", "an Auto search spec describes no plan: the toolkit chooses one (planner.auto.choose_plan)")


@pytest.mark.parametrize("whole_leaf, precision, whole", [
    (2**23, "fp32", 0), (2**21, "fp32", 1), (math.inf, "bf16", 0), (2**21, "bf16", 1)])
def test_replicated_parameters_and_adams_state_are_flat_vectors_with_the_same_step(whole_leaf, precision, whole):
    """One device: the step takes 4 arrays of state (parameters, Adam's count and moments) and 3
    more per leaf kept whole (the model's DOT kernel of 2^21 elements, with whole_leaf lowered to
    it), not one per leaf each; losses, gradients and updated parameters are those of the
    per-leaf step."""
    from codesign.engine.options import engine_options
    from codesign.engine.probe.gpu_sections import FLAT_STEP_ARRAYS
    from tests.reference import assert_matches, differences, live_leaves, two_steps

    job = dataclasses.replace(JOB, training=dataclasses.replace(JOB.training, precision=precision))
    states = {}
    for flat in (True, False):
        options = dataclasses.replace(engine_options("cpu", precision), flat_state=flat, whole_leaf=whole_leaf)
        states[flat] = len(jax.tree.leaves(job_body.build_training(job, make_plan(job), options=options).state))
        runs = states.setdefault("runs", {})
        runs[flat] = two_steps(job, options=options)
    assert states[True] == 4 + 3 * whole < states[False]
    assert states[True] + 2 == FLAT_STEP_ARRAYS + 3 * whole  # and the batch's x and y: what a GPU profile's call takes
    per_leaf = states["runs"][False]
    assert_matches("flat", differences(states["runs"][True], per_leaf, live_leaves(per_leaf)))


def test_only_replicated_parameters_are_viewed_flat_and_the_view_round_trips():
    """The view round-trips with no leaf whole, the DOT kernel whole, and every leaf whole."""
    from types import SimpleNamespace

    from jax.sharding import PartitionSpec as P

    from codesign.engine.step import FlatView, replicated

    def sharding(*spec, op=2):
        return SimpleNamespace(spec=P(*spec), mesh=SimpleNamespace(shape={"dp": 2, "op": op}))

    assert replicated({"a": sharding(), "b": sharding(None, None), "c": sharding(None, "op", op=1)})
    assert not replicated({"a": sharding(), "b": sharding(None, "op")})
    assert not replicated({"a": sharding(("dp", "op"), op=1)})
    plan = make_plan(JOB)
    abstract, _ = programs.stage_parameters(JOB, plan, plan.stages[0], programs.stage_mesh(plan.stages[0]))
    tree = jax.tree.map(lambda a: jax.numpy.arange(a.size, dtype=a.dtype).reshape(a.shape), abstract)
    sizes = [a.size for a in jax.tree.leaves(abstract)]
    for whole_leaf, whole in ((float("inf"), ()), (2**21, (2**21,)), (1, sizes)):
        view = FlatView.of(abstract, whole_leaf)
        assert [sizes[i] for i in view.whole] == list(whole)
        state = view.flatten(tree)
        assert all((x == y).all() for x, y in zip(jax.tree.leaves(view.leaves(state)), jax.tree.leaves(tree)))
        assert [a.shape for a in state] == [a.shape for a in view.abstract()]
        assert view.abstract()[0].shape == (sum(sizes) - sum(whole),)
