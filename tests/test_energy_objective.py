"""Energy as an objective (pure): the power model, power limits, objectives, `codesign plan`."""

import csv
import io
import json

import pytest

from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.planner.auto import choose_plan
from codesign.cost.model import Workload, estimate
from codesign.hardware.device import Devices
from codesign.hardware.links import NVLINK
from codesign.hardware.profiles import BUILTIN, ProfileBook
from codesign.cost.plan import Plan, StagePlan, plan_name
from codesign.cost.power import Busy, clock_at, device_joules, iteration_joules
from codesign.planner.power_limits import by_device, per_stage, plan_wide
from tests.conftest import REPO, db_rows, run_cli

H100 = BUILTIN["H100"]
MODEL = ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "DOT"),) * 4)
EIGHT = ClusterSpec(1, 8, "NVLink", "sim", "H100")


def _job(micro: int = 8, **auto) -> Job:
    return Job(MODEL, EIGHT, TrainingSpec(1024, 10), ParallelSpec("Auto search", (micro,), 4, **auto), micro, "sim")


def _two_stages(first: tuple[int, ...], second: tuple[int, ...]) -> Plan:
    stages = (StagePlan(tuple((i,) for i in first), (0, 1, 2, 3), 4, 1),
              StagePlan(tuple((i,) for i in second), (4, 5, 6, 7), 4, 1))
    return Plan(stages, 8, "dp", False, False, "1F1B", "chosen")


def test_a_limit_slows_compute_bound_work_and_lowers_its_joules():
    power = H100.power
    assert clock_at(power, power.compute, None) == clock_at(power, power.compute, 800) == 1.0
    assert clock_at(power, power.compute, 300) < clock_at(power, power.compute, 500) < 1.0
    busy = Busy(1, compute=1.0, memory=0.0, communication=0.0)
    assert device_joules(power, busy, 1.0) == pytest.approx(power.compute)
    at_400 = device_joules(power, busy, 2.0, 400)
    assert at_400 < device_joules(power, busy, 2.0)
    memory = Busy(1, compute=0.0, memory=1.0, communication=0.0)  # memory-bound time barely moves
    assert device_joules(power, memory, 1.0, 600) == pytest.approx(power.memory)


def test_unused_devices_and_idle_time_draw_idle_power():
    busy = [Busy(4, compute=0.01, memory=0.0, communication=0.0)]
    gpus = Devices(H100, NVLINK, NVLINK)
    on_four = iteration_joules(gpus, busy, 0.02, devices=4)
    assert on_four == pytest.approx(4 * (0.01 * H100.power.compute + 0.01 * H100.power.idle))
    assert iteration_joules(gpus, busy, 0.02, devices=8) == pytest.approx(on_four + 4 * 0.02 * H100.power.idle)


def test_an_estimate_prices_every_device_between_idle_and_full_power():
    job = _job()
    w = Workload.of(job, ProfileBook().for_job(job))
    found = estimate(w, _two_stages((0, 1, 2), (3,)))
    assert found.devices == 8 and len(found.busy) == 2
    assert 8 * H100.power.idle * found.seconds < found.energy < 8 * H100.power.compute * found.seconds
    assert found.busy[1].seconds < found.busy[0].seconds <= found.seconds  # the light stage idles more


def test_per_stage_limits_slow_an_uneven_pipelines_light_stage_without_lengthening_it():
    job = _job()
    w = Workload.of(job, ProfileBook().for_job(job))
    uneven, balanced = _two_stages((0, 1, 2), (3,)), _two_stages((0, 1), (2, 3))
    before = estimate(w, uneven)
    after = per_stage(w, uneven, before)
    assert after.seconds == pytest.approx(before.seconds, rel=0.01)
    assert after.energy < 0.97 * before.energy
    assert after.power_limits[1] < after.power_limits[0] == H100.power.limits[1]  # the light stage slows
    assert by_device(uneven, after) == {**dict.fromkeys(range(4), after.power_limits[0]),
                                        **dict.fromkeys(range(4, 8), after.power_limits[1])}
    even = estimate(w, balanced)
    gained = per_stage(w, balanced, even)
    saved = 0.0 if gained is None else 1 - gained.energy / even.energy
    assert saved < (1 - after.energy / before.energy) / 3


def test_plan_wide_limits_trade_time_for_joules():
    job = _job()
    w = Workload.of(job, ProfileBook().for_job(job))
    plan = _two_stages((0, 1), (2, 3))
    found = estimate(w, plan)
    limited = plan_wide(w, plan, found)
    assert [e.power_limits[0] for e in limited] == sorted((e.power_limits[0] for e in limited), reverse=True)
    assert all(e.seconds >= found.seconds and e.energy < found.energy for e in limited)
    assert limited[-1].power_limits == (H100.power.limits[0],) * 2


def test_the_objective_changes_the_choice_and_cost_spans_time_to_energy():
    book = ProfileBook()
    fastest = choose_plan(_job(4), book).best()
    frugal = choose_plan(_job(4, objective="energy"), book).best()
    assert frugal.estimate.energy < 0.8 * fastest.estimate.energy
    assert (plan_name(frugal.plan), frugal.estimate.power_limits) != (plan_name(fastest.plan), ())
    only_time = choose_plan(_job(4, objective="cost", eta=0.0), book).best()
    assert (plan_name(only_time.plan), only_time.estimate.seconds) == (plan_name(fastest.plan), fastest.estimate.seconds)
    only_energy = choose_plan(_job(4, objective="cost", eta=1.0), book).best()
    assert only_energy.estimate.energy == pytest.approx(frugal.estimate.energy)
    bounded = choose_plan(_job(4, objective="energy", max_slowdown=0.05), book).best()
    assert bounded.estimate.seconds <= 1.05 * fastest.estimate.seconds
    assert bounded.estimate.energy <= fastest.estimate.energy


def _blocks(text: str) -> dict[tuple[str, str], list[dict]]:
    blocks: dict[tuple[str, str], list[dict]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        blocks.setdefault((row["cluster"], row["space"]), []).append(row)
    return blocks


def test_plan_prints_the_least_energy_plan_within_the_slowdown_and_the_frontier():
    proc = run_cli("plan", "-c", "bench/plan_sim.toml", "--objective", "energy", "--max-slowdown", "5",
                   "--top", "1", "--format", "csv", cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    blocks = _blocks(proc.stdout)
    auto = {cluster: rows for (cluster, space), rows in blocks.items() if space.startswith("Auto search")}
    assert {c.split()[0] for c in auto} == {"1x8", "2x8", "8x8"}
    for cluster, rows in auto.items():
        best = next(r for r in rows if r["rank"] == "1")
        on = [r for r in rows if r["frontier"] == "yes"]
        fastest = min(on, key=lambda r: float(r["time_ms"]))
        assert float(best["energy_j"]) <= float(fastest["energy_j"])
        assert float(best["time_ms"]) <= 1.05 * float(fastest["time_ms"])
        by_time = sorted(on, key=lambda r: float(r["time_ms"]))
        energies = [float(r["energy_j"]) for r in by_time]
        assert len(on) >= 2 and energies == sorted(energies, reverse=True), cluster  # a frontier: no point beats another
    limited = [c for c, rows in auto.items() if next(r for r in rows if r["rank"] == "1")["power_w"] not in ("", "-")]
    assert limited  # where a power limit saves joules within the slowdown, the least-energy plan runs under it


def test_plan_rejects_a_slowdown_without_an_energy_objective():
    proc = run_cli("plan", "-c", "bench/plan_sim.toml", "--max-slowdown", "5", cwd=REPO)
    assert proc.returncode == 2 and "--max-slowdown applies to --objective energy or cost" in proc.stderr


SIM_ENERGY = """
[training_spec]
avg_batch_size_per_device = 1024
num_iters = 10

[[model]]
num_features = 512
emb_dim = 160
output_per_emb = 20
num_zhen_layers = 4
tokens = ["ATTENTION", "LINEAR", "DOT"]

[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 8
transport = "NVLink"
platform = "sim"
device = "H100"

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [4]
num_auto_layers = 1
objective = "energy"
max_slowdown = 0.05

[[parallel_spec]]
description = "data parallel"
num_micro_batches = [4]
"(pp, dp, op)" = [1, 8, 1]
"""


def test_a_sweep_records_predicted_energy_and_the_limits_auto_search_chose(tmp_path):
    (tmp_path / "c.toml").write_text(SIM_ENERGY)
    assert run_cli("-c", "c.toml", cwd=tmp_path).returncode == 0
    auto, manual = db_rows(tmp_path / "results.db")
    assert all(r["predicted_energy"] > 0 for r in (auto, manual))
    chosen = json.loads(auto["all_configs"])["prediction"]
    assert chosen["power_limits"] and chosen["energy"] == pytest.approx(auto["predicted_energy"])
    assert auto["predicted_energy"] < manual["predicted_energy"]
    assert auto["predicted_time"] <= 1.05 * manual["predicted_time"]


@pytest.mark.parametrize("field, value, message", [
    ("objective", '"power"', "objective"), ("eta", "1.5", "eta"), ("max_slowdown", "-1", "max_slowdown")])
def test_a_bad_objective_names_the_field_and_changes_nothing(tmp_path, field, value, message):
    text = SIM_ENERGY.replace("max_slowdown = 0.05", f"max_slowdown = 0.05\n{field} = {value}" if field != "max_slowdown"
                              else f"max_slowdown = {value}")
    (tmp_path / "c.toml").write_text(text.replace('objective = "energy"\n', "") if field == "objective" else text)
    proc = run_cli("-c", "c.toml", cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "[[parallel_spec]]" in proc.stderr
    assert not (tmp_path / "results.db").exists()


def test_a_manual_spec_with_an_objective_is_refused(tmp_path):
    (tmp_path / "c.toml").write_text(SIM_ENERGY + 'objective = "energy"\n')
    proc = run_cli("-c", "c.toml", cwd=tmp_path)
    assert proc.returncode == 2 and "objective" in proc.stderr and "applies only to description" in proc.stderr
