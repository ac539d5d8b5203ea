"""Auto search's planner (pure): the DP against brute force, uneven splits, memory, 64 devices, the record."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from codesign.planner import auto
from codesign.planner.auto import NoPlanFits, choose_plan, dp_search
from codesign.planner.columns import plan_columns
from codesign.cost.model import Workload, estimate
from codesign.cost.plan import check_plan
from codesign.hardware.profiles import BUILTIN, ProfileBook
from codesign.planner.space import Candidate, all_plans, space_size
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec

SEED = ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4)
SMALL = ModelSpec(32, 16, 4, 4, (("ATTENTION", "LINEAR"), ("DOT",), ("CONVOLUTION", "LINEAR"), ("DOT", "ATTENTION")))
HEAVY_FIRST = ModelSpec(256, 64, 16, 4, (("DOT", "DOT", "DOT", "DOT"), ("LINEAR",), ("LINEAR",), ("LINEAR",)))


def auto_job(model=SEED, hosts=1, per_host=4, micro=4, groups=4, transport="NVLink", device="H100",
             batch=1024) -> Job:
    cluster = ClusterSpec(hosts, per_host, transport, "sim", device)
    spec = ParallelSpec("Auto search", (micro,), num_auto_layers=groups)
    return Job(model, cluster, TrainingSpec(batch, 5), spec, micro, "sim")


def book_with_memory(nbytes: int, kind: str = "H100") -> ProfileBook:
    book = ProfileBook()
    book.profiles[kind] = dataclasses.replace(BUILTIN[kind], memory=nbytes)
    return book


def fastest(candidates) -> Candidate:
    return min((c for c in candidates if c.estimate.fits), key=lambda c: c.estimate.seconds)


def test_importing_auto_search_never_imports_jax():
    code = "import sys, codesign.planner.auto; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("model, hosts, per_host, micro, device, batch", [
    (SEED, 1, 4, 4, "H100", 1024), (SEED, 1, 4, 2, "cpu", 64), (SMALL, 1, 4, 1, "H100", 1024),
    (SMALL, 2, 2, 4, "cpu", 64), (HEAVY_FIRST, 1, 4, 4, "H100", 1024), (SEED, 2, 2, 1, "H100", 1024)])
def test_the_dp_finds_the_brute_force_best_on_small_spaces(model, hosts, per_host, micro, device, batch):
    job = auto_job(model, hosts, per_host, micro, device=device, batch=batch)
    workload = Workload.of(job, BUILTIN[device])
    every = [Candidate(p, estimate(workload, p)) for p in all_plans(job)]
    proposed = dp_search(job, workload)
    assert len(every) == space_size(job, 10**6) and len(proposed) < len(every)
    best, found = fastest(every), fastest(proposed)
    assert found.estimate.seconds == pytest.approx(best.estimate.seconds, rel=0.01)


def test_choose_plan_ranks_the_plans_that_fit_fastest_first_and_each_runs():
    job = auto_job()
    choice = choose_plan(job, ProfileBook())
    times = [c.estimate.seconds for c in choice.ranked]
    assert times == sorted(times) and all(c.estimate.fits for c in choice.ranked)
    assert choice.priced == space_size(job, 10**6) >= len(choice.ranked) > 1 and choice.seconds > 0
    for c in choice.ranked[:20]:
        check_plan(job, c.plan)
        micro_batch = job.global_batch // job.num_micro_batches
        assert all(micro_batch % getattr(s, c.plan.batch_axis) == 0 for s in c.plan.stages)


def test_unbalanced_layers_get_an_uneven_split_on_unequal_submeshes():
    """Layer 0 holds four DOT mixers, layers 1-3 one LINEAR each, on four hosts of one GPU joined by
    EFA (a data-parallel all-reduce of the DOT kernels over all four is dear there): the plan is a
    pipeline whose stages hold different numbers of layers, and the heavy layer's stage has the
    most devices."""
    choice = choose_plan(auto_job(HEAVY_FIRST, hosts=4, per_host=1, transport="EFAx4", micro=16), ProfileBook())
    stages = choice.best().plan.stages
    assert len(stages) > 1 and len({len(s.layers) for s in stages}) > 1
    heavy = next(s for s in stages if 0 in s.layers)
    assert len(heavy.device_ids) > max(len(s.device_ids) for s in stages if s is not heavy)


def test_a_tight_memory_makes_it_pick_a_plan_that_fits():
    job = auto_job(micro=2)
    free = choose_plan(job, ProfileBook()).best()
    workload = Workload.of(job, BUILTIN["H100"])
    least = min(estimate(workload, p).peak_bytes for p in all_plans(job))
    assert least < free.estimate.peak_bytes
    limit = (least + free.estimate.peak_bytes) // 2
    tight = choose_plan(job, book_with_memory(limit)).best()
    assert tight.estimate.peak_bytes <= limit < free.estimate.peak_bytes
    assert tight.estimate.seconds >= free.estimate.seconds
    plan = tight.plan
    assert plan.remat or plan.reduce_scatter or len(plan.stages) > len(free.plan.stages)


def test_no_plan_fits_names_the_smallest_peak_against_the_device_memory():
    job = auto_job(micro=2)
    workload = Workload.of(job, BUILTIN["H100"])
    least = min(estimate(workload, p).peak_bytes for p in all_plans(job))
    with pytest.raises(NoPlanFits) as caught:
        choose_plan(job, book_with_memory(least // 2))
    message = str(caught.value)
    assert f"{least / 2**30:.2f} GiB per device" in message
    assert f"has {least // 2 / 2**30:.2f} GiB" in message and "more devices" in message


def test_64_devices_are_searched_by_the_dp_with_a_bounded_number_of_plans_priced():
    job = auto_job(hosts=8, per_host=8, transport="EFAx4")
    assert space_size(job, auto.EXHAUSTIVE_LIMIT) > auto.EXHAUSTIVE_LIMIT
    choice = choose_plan(job, ProfileBook())
    assert 0 < choice.priced <= 1000 and choice.best().estimate.fits
    plan = choice.best().plan
    assert sorted(d for s in plan.stages for d in s.device_ids) == list(range(64))


def test_the_record_says_the_plan_as_a_manual_spec_its_prediction_and_the_runners_up():
    job = auto_job(HEAVY_FIRST, micro=8)
    choice = choose_plan(job, ProfileBook())
    record = json.loads(json.dumps(choice.record()))
    best = choice.best()
    assert record["plan"] == json.loads(json.dumps(auto.manual_form(best.plan, 4)))
    assert {k: record["plan"][k] for k in plan_columns(best.plan, 4)} == json.loads(
        json.dumps(plan_columns(best.plan, 4)))
    assert record["plan"]["stage_layers"] == [[list(g) for g in s.groups] for s in best.plan.stages]
    assert record["predicted"]["seconds"] == best.estimate.seconds
    assert record["predicted"]["peak_bytes"] == best.estimate.peak_bytes
    assert record["priced"] == choice.priced and record["search_seconds"] == choice.seconds
    runners = record["runners_up"]
    assert len(runners) == min(5, len(choice.ranked) - 1) == 5
    assert [r["predicted"]["seconds"] for r in runners] == [c.estimate.seconds for c in choice.ranked[1:6]]
    assert math.isclose(runners[0]["predicted"]["seconds"], choice.ranked[1].estimate.seconds)


def test_trials_are_the_best_plans_of_distinct_shapes():
    choice = choose_plan(auto_job(model=SMALL, per_host=8, micro=4, device="cpu", batch=64), ProfileBook())

    def twin(c):
        return auto.shape(c.plan)

    assert sum(twin(c) == twin(choice.best()) for c in choice.ranked) > 1  # e.g. both schedules, priced alike
    assert {len(c.plan.stages) for c in choice.ranked} == {1, 2, 3, 4}  # uneven splits of the 4 groups too
    trials = choice.trials(3)
    assert trials[0] == choice.best() and len({twin(c) for c in trials}) == 3
    ranks = [choice.ranked.index(c) for c in trials]
    assert ranks == sorted(ranks)
    per_degree = {n: next(c for c in choice.ranked if len(c.plan.stages) == n) for n in (1, 2, 3, 4)}
    best_degree = len(choice.best().plan.stages)
    others = sorted((n for n in per_degree if n not in (1, best_degree)),
                    key=lambda n: choice.ranked.index(per_degree[n]))
    expected = [per_degree[n] for n in dict.fromkeys([best_degree, 1, *others])]  # the best, one program, the rest
    assert {choice.ranked.index(t) for t in trials} == {choice.ranked.index(c) for c in expected[:3]}
    more = choice.trials(5)  # the best of all four degrees, then the best plan of another shape
    fifth = next(c for c in choice.ranked if twin(c) not in {twin(p) for p in expected})
    assert [choice.ranked.index(c) for c in more] == sorted(choice.ranked.index(c) for c in [*expected, fifth])


def test_on_cpu_zero2_is_chosen_only_where_a_plan_needs_its_memory():
    """No special case: the cost model prices XLA:CPU's ZeRO-2 (an all-reduce, slices and an
    all-gather per array) slower than the same plan without it, so the search ranks the plain
    plan first; ZeRO-2 plans stay in the ranking, for when memory needs them."""
    j = auto_job(model=SMALL, per_host=8, micro=2, device="cpu", batch=64)
    ranked = choose_plan(j, ProfileBook()).ranked
    assert not ranked[0].plan.reduce_scatter and any(c.plan.reduce_scatter for c in ranked)
    by_plan = {c.plan: c.estimate.seconds for c in ranked}
    single = [p for p in by_plan if p.reduce_scatter and len(p.stages) == 1 and p.stages[0].dp > 1]
    assert single and all(by_plan[p] > by_plan[dataclasses.replace(p, reduce_scatter=False)] for p in single)
    gpu = auto_job(model=SMALL, per_host=8, micro=2, batch=64)
    assert any(c.plan.reduce_scatter for c in choose_plan(gpu, ProfileBook()).ranked)

    w = Workload.of(j, BUILTIN["cpu"])
    saving = {}
    for plan in all_plans(j):
        if plan.reduce_scatter:
            plain = estimate(w, dataclasses.replace(plan, reduce_scatter=False)).peak_bytes
            saving[plan] = (estimate(w, plan).peak_bytes, plain)
    zero_plan, (zero_peak, plain_peak) = max(saving.items(), key=lambda kv: kv[1][1] - kv[1][0])
    assert zero_peak < plain_peak
    book = book_with_memory((zero_peak + plain_peak) // 2, "cpu")
    ranked = choose_plan(j, book).ranked
    assert zero_plan in [c.plan for c in ranked]  # its plain twin does not fit: ZeRO-2 is what makes it run
    assert dataclasses.replace(zero_plan, reduce_scatter=False) not in [c.plan for c in ranked]
