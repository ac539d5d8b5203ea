"""Points that say how they ran (issue 55, item 2): each records its power limits, the jobs beside
it, its devices, its engine options and the calibration that priced it; a refit fits only the
points that ran as the sweep prices plans (alone, at full power, under the engine as it is), so
a limited or crowded point moves no time factor; a points file from before still reads, its
points bounding memory but fitting no time factor."""

import dataclasses
import json

import pytest

from codesign.config.hosts import Hosts
from codesign.config.jobs import PlannedJob
from codesign.cost.learning import Point, comparable, memory_bound, refit
from codesign.outcome import Outcome
from codesign.run.learning import point_of
from codesign.run.profile_cache import profiles_for
from codesign.run.sweep import Pricing, run_sweep
from codesign.store.database import Store
from tests.test_learning import BASE, JOBS, Measured, cache, learner, points  # noqa: F401

ENGINE = (("flat_state", False), ("whole_leaf", 8388608), ("bias_in_matmul", False), ("batch_encoders", True),
          ("one_reduction_sums", True))


def time_factors(found) -> tuple:
    return found.factors, found.plan_factors


def slowed(pool: list[Point], times: float, **how) -> list[Point]:
    """The pool's points measured `times` slower, as they ran `how`."""
    return [dataclasses.replace(p, seconds=p.seconds * times, source=f"slow.db#{i}", **how) for i, p in enumerate(pool)]


@pytest.mark.parametrize("how", [{"power_limits": ((0, 150.0), (1, 150.0))}, {"jobs_beside": 1}],
                         ids=["under a power limit", "beside another job"])
def test_a_point_that_ran_limited_or_beside_a_job_moves_no_time_factor_of_plans_run_alone(how):
    alone = points(JOBS, 1.5)
    mixed = [p for pair in zip(alone, slowed(alone, 2.0, **how)) for p in pair]
    assert comparable(mixed) == list(range(0, len(mixed), 2))
    expected = time_factors(refit(BASE, alone, None, 1, 0.0))
    assert time_factors(refit(BASE, mixed, None, 1, 0.0)) == expected
    # were they fitted, they would move them
    as_if_alone = [dataclasses.replace(p, power_limits=(), jobs_beside=0) for p in mixed]
    assert time_factors(refit(BASE, as_if_alone, None, 1, 0.0)) != expected


def test_points_of_another_engine_than_the_newest_fit_no_time_factor():
    """The engine as the newest point of a precision ran it is what the sweep prices next: points
    built under other options (an earlier release's) are not comparable."""
    then, now = points(JOBS, 3.0), points(JOBS, 1.5)
    mixed = [*slowed(then, 1.0, engine=ENGINE), *[dataclasses.replace(p, engine=ENGINE[1:]) for p in now]]
    assert comparable(mixed) == list(range(len(then), len(mixed)))
    assert time_factors(refit(BASE, mixed, None, 1, 0.0)) == time_factors(refit(BASE, now, None, 1, 0.0))


def test_an_old_points_file_still_reads_its_points_bound_memory_and_fit_no_time_factor(cache):
    """A point written before points said how they ran reads with None for each: it may have run
    under a limit or beside a job, so it fits no time factor; its peak still bounds memory."""
    machine = learner(cache)
    path = machine.file("points.jsonl")
    path.parent.mkdir(parents=True)
    before = ("job", "plan", "links", "status", "seconds", "peak", "source", "base")  # a point's fields then
    old = [{k: v for k, v in dataclasses.replace(p, seconds=2 * p.seconds, peak=1.4 * p.peak).to_dict().items()
            if k in before} for p in points(JOBS, 1.5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in old))
    read = machine.points()
    assert len(read) == len(JOBS) and comparable(read) == []
    assert {(p.power_limits, p.jobs_beside, p.engine, p.calibration) for p in read} == {(None, None, None, None)}
    new = points(JOBS, 1.5)
    for point in new:
        machine.add(point)
    pool = machine.points()
    assert time_factors(refit(BASE, pool, None, 1, 0.0)) == time_factors(refit(BASE, new, None, 1, 0.0))
    bound = memory_bound(BASE, read)
    assert refit(BASE, pool, None, 1, 0.0).memory_factor == pytest.approx(bound) and bound > 1.3


def test_a_point_says_how_its_attempt_ran():
    job = JOBS[3]
    metrics = {"median": 0.02, "max_memory": 1e6, "jobs_beside": 2, "gpu_ids": [2, 3],
               "engine_options": dict(ENGINE), "prediction": {"calibration": 4},
               "power": {"limits": {"1": 150.0, "0": 200.0}, "applied": True, "reason": None}}
    point = point_of(job, Outcome("succeeded", metrics=metrics), (), "a.db#1", "cpu@1")
    assert (point.power_limits, point.jobs_beside, point.devices, point.engine, point.calibration) == (
        ((0, 200.0), (1, 150.0)), 2, (2, 3), ENGINE, 4)
    assert Point.from_dict(json.loads(json.dumps(point.to_dict()))) == point
    # limits its guard could not set leave it at full power; a job priced uncalibrated, by calibration 0
    unset = {**metrics, "power": {"limits": {"0": 200.0}, "applied": False, "reason": "NVML is not available"},
             "prediction": {"calibration": None}}
    point = point_of(job, Outcome("succeeded", metrics=unset), (), "a.db#2", "cpu@1")
    assert (point.power_limits, point.calibration) == ((), 0)
    # nothing said: no sweep counted its neighbours, no prediction priced it
    bare = point_of(job, Outcome("succeeded", metrics={"median": 0.02, "max_memory": 1e6}), (), "a.db#3", "cpu@1")
    assert (bare.power_limits, bare.jobs_beside, bare.devices, bare.engine, bare.calibration) == ((), None, (), None, None)


class Crowded(Measured):
    """Measured's jobs, finished only once two run side by side."""

    def wait(self, running, seconds):
        return super().wait(running, seconds) if len(running) == 2 else []


def test_jobs_a_sweep_ran_side_by_side_are_points_that_fit_no_time_factor(tmp_path, cache):
    pricing = Pricing(profiles_for(Hosts.local(0), cache=cache))
    store = Store(tmp_path / "a.db")
    try:
        run_sweep([PlannedJob(j) for j in JOBS], store, Crowded(), retry_failed=False, manual_timeout=60,
                  max_concurrent=2, pricing=pricing)
    finally:
        store.close()
    pool = learner(cache).points()
    assert [p.jobs_beside for p in pool] == [1] * len(JOBS) and [p.calibration for p in pool] == [0] * len(JOBS)
    assert all(v.memory_only for v in learner(cache).versions())  # no refit: nothing to fit time factors to
