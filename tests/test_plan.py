"""`codesign plan`, simulated clusters through the sweep, and the errors a user can make there."""

import csv
import dataclasses
import io
import json
import sqlite3
import time

import pandas as pd
import pytest

from codesign.config.loader import load_config
from codesign.config.types import AUTO_SEARCH, ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.outcome import Outcome
from codesign.planner.auto import EXHAUSTIVE_LIMIT, choose_plan
from codesign.planner.columns import plan_columns
from codesign.hardware.profiles import BUILTIN, ProfileBook
from codesign.planner.listing import plan_rows
from codesign.cost.plan import MESH_AXES, make_plan, plan_from_stages, plan_name
from codesign.planner.space import MANUAL, all_plans, expressible, same_plan, space_size
from codesign.store.database import Store
from codesign.store.export import export_csv
from codesign.store.schema import MIGRATIONS
from tests.conftest import REPO, db_rows, run_cli

SIM_JOB = Job(ModelSpec(4, 2, 1, 1, (("LINEAR",),)), ClusterSpec(1, 8, "NVLink", "sim", "H100"),
              TrainingSpec(2, 2), ParallelSpec("dp", (1,), 1, False, (1, 8, 1)), 1, "sim")

SEED_SIM = (REPO / "bench" / "plan_sim.toml").read_text()  # seed model on 8, 16, 64 simulated H100s



SEED = ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4)
# The seed model's Auto search with 4 and 2 layer groups on simulated H100s: 2x8's space with 4
# groups is searched by the dynamic program, the others in full.
AUTO_SIM = SEED_SIM.split("[[cluster_spec]]")[0] + """
[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 4
transport = "NVLink"
platform = "sim"
device = "H100"

[[cluster_spec]]
num_hosts = 2
num_devices_per_host = 8
transport = "EFAx4"
platform = "sim"
device = "H100"

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [1, 4]
num_auto_layers = 4

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [4]
num_auto_layers = 2
auto_trials = 2

[[parallel_spec]]
description = "pipeline"
num_micro_batches = [4]
"(pp, dp, op)" = [2, 2, 1]
num_auto_layers = 2
"""


def blocks(table: list[dict]) -> dict[tuple, list[dict]]:
    """(cluster, micro-batches, space) -> its rows, in order."""
    found: dict[tuple, list[dict]] = {}
    for row in table:
        found.setdefault((row["cluster"], int(row["micro_batches"]), row["space"]), []).append(row)
    return found


def sim_job(hosts: int, per_host: int, micro: int, groups: int, transport: str = "EFAx4") -> Job:
    return Job(SEED, ClusterSpec(hosts, per_host, transport, "sim", "H100"), TrainingSpec(1024, 10),
               ParallelSpec(AUTO_SEARCH, (micro,), num_auto_layers=groups), micro, "sim")


def test_plan_ranks_every_plan_of_each_cluster_and_marks_manual_specs(tmp_path):
    (tmp_path / "c.toml").write_text(SEED_SIM)
    start = time.monotonic()
    proc = run_cli("plan", "-c", "c.toml", "--format", "csv", cwd=tmp_path)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    table = list(csv.DictReader(io.StringIO(proc.stdout)))
    found = blocks(table)
    one_host = ("1x8 NVLink (sim H100)", 4)
    assert sorted(found) == [(*one_host, "Auto search groups=1"), (*one_host, "manual groups=4"),
                             ("2x8 EFAx4 (sim H100)", 4, "Auto search groups=1"),
                             ("8x8 EFAx4 (sim H100)", 4, "Auto search groups=1")]
    for key, plans in found.items():
        assert [int(r["rank"]) for r in plans] == list(range(1, len(plans) + 1))
        fitting = [float(r["time_ms"]) for r in plans if r["fits"] == "True"]
        assert fitting == sorted(fitting) and len({r["plan"] for r in plans}) == len(plans)
        (baseline,) = [r for r in plans if r["plan"].startswith("pp1 dp") and float(r["speedup_vs_dp"] or 0) == 1.0]
        assert " op1" in baseline["plan"], key
    # one layer group: Auto search's space is every one-program plan (7 meshes x 4 settings), less
    # ZeRO-2 on one host's two dp = 1 meshes (op 8), which have no dp axis to shard over
    for cluster, size in (("1x8 NVLink (sim H100)", 24), ("2x8 EFAx4 (sim H100)", 28), ("8x8 EFAx4 (sim H100)", 28)):
        plans = found[cluster, 4, "Auto search groups=1"]
        assert len(plans) == size and all(r["plan"].startswith("pp1 ") for r in plans)
        assert not any("zero2" in r["plan"] and r["plan"].startswith("pp1 dp1 ") for r in plans)
        assert [r["manual"] for r in plans] == ["Auto search groups=1"] + [""] * (size - 1)
    manual = found[(*one_host, "manual groups=4")]
    assert {r["plan"].split()[0] for r in manual} == {"pp1", "pp2", "pp4"} and len(manual) > 40
    assert {r["manual"]: r["plan"] for r in manual if r["manual"]} == {"data parallel": "pp1 dp8 op1",
                                                                      "pipeline": "pp2 dp4 op1 layers[1,3] 1F1B"}
    assert not (tmp_path / "results.db").exists()
    print(f"codesign plan on 8, 16 and 64 simulated H100s: {seconds:.2f} s for {len(table)} plans")


def test_plan_top_1_is_auto_searchs_choice_on_every_cluster(tmp_path):
    """No special case: the listing ranks the plans Auto search prices as it does, in full or
    through the dynamic program, so its first is the plan `choose_plan` chooses."""
    (tmp_path / "c.toml").write_text(AUTO_SIM)
    proc = run_cli("plan", "-c", "c.toml", "--top", "1", "--format", "csv", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = blocks(list(csv.DictReader(io.StringIO(proc.stdout))))
    cases = {("1x4 NVLink (sim H100)", (1, 4, "NVLink")), ("2x8 EFAx4 (sim H100)", (2, 8, "EFAx4"))}
    expected = {(name, micro, f"Auto search groups={groups}") for name, _ in cases for micro, groups in
                ((1, 4), (4, 4), (4, 2))} | {("1x4 NVLink (sim H100)", 4, "manual groups=4")}
    assert set(found) == expected
    assert space_size(sim_job(2, 8, 4, 4), EXHAUSTIVE_LIMIT) > EXHAUSTIVE_LIMIT  # the dynamic program's
    book = ProfileBook()
    for name, (hosts, per_host, transport) in cases:
        for micro, groups in ((1, 4), (4, 4), (4, 2)):
            best = choose_plan(sim_job(hosts, per_host, micro, groups, transport), book).best()
            (row,) = found[name, micro, f"Auto search groups={groups}"]
            assert (row["rank"], row["plan"], float(row["time_ms"])) == (
                "1", plan_name(best.plan), best.estimate.seconds * 1e3), (name, micro, groups)
            marks = {4: "Auto search groups=4", 2: "Auto search groups=2 trials=2"}
            assert row["manual"] == marks[groups]
    manual = found["1x4 NVLink (sim H100)", 4, "manual groups=4"]
    assert [r["rank"] for r in manual][0] == "1" and manual[-1]["manual"] == "pipeline"


def test_where_no_plan_fits_the_auto_block_is_listed_unmarked_and_a_warning_says_why(tmp_path, caplog):
    (tmp_path / "c.toml").write_text(SEED_SIM)
    book = ProfileBook()
    book.profiles["H100"] = dataclasses.replace(BUILTIN["H100"], memory=2**28)
    rows = [r for r in plan_rows(load_config(tmp_path / "c.toml"), book) if r["cluster"].startswith("8x8")]
    assert len(rows) == 28 and not any(r["fits"] or r["manual"] for r in rows)
    assert "Auto search groups=1 on 8x8 EFAx4 (sim H100), 4 micro-batches: no plan fits: the smallest predicted " \
           "peak is" in caplog.text


def test_the_manual_filter_keeps_exactly_the_plans_a_manual_spec_runs():
    """Every plan MANUAL admits is what make_plan builds from the manual spec that says it (its
    columns: a tile's host_ids/device_ids); the others split the groups, the devices or the
    meshes unevenly."""
    j = dataclasses.replace(sim_job(2, 4, 4, 4), parallel=ParallelSpec("manual", (4,), 4))
    manual = list(all_plans(j, MANUAL))
    assert manual == [p for p in all_plans(j) if expressible(p)]
    assert {len(p.stages) for p in manual} == {1, 2, 4} and {p.schedule for p in manual} == {"1F1B", "GPipe"}
    assert any(plan_name(p).endswith("tile[2,2]") for p in manual) and any(p.remat for p in manual)
    for plan in manual:
        columns = plan_columns(plan, 4)
        contiguous = "tile[" not in plan_name(plan)
        spec = ParallelSpec(
            "manual", (4,), 4, plan.remat, (len(plan.stages), plan.stages[0].dp, plan.stages[0].op),
            auto_sharding_option=(("force_batch_dim_to_mesh_dim", MESH_AXES.index(plan.batch_axis)),
                                  ("prefer_reduce_scatter", plan.reduce_scatter)),
            host_ids=None if contiguous else tuple(map(tuple, columns["host_ids"])),
            device_ids=None if contiguous else tuple(tuple(map(tuple, s)) for s in columns["device_ids"]),
            pipeline_schedule=plan.schedule)
        assert same_plan(make_plan(dataclasses.replace(j, parallel=spec)), plan), plan_name(plan)
        assert sorted(d for s in plan.stages for d in s.device_ids) == list(range(8))
    uneven = plan_from_stages(j, [[0, 1], [2], [3]], [[0, 1, 2, 3], [4, 5], [6, 7]], [(4, 1), (2, 1), (1, 2)])
    assert not expressible(uneven) and uneven in set(all_plans(j))


def test_a_plan_has_one_name_that_tells_the_plans_of_a_space_apart():
    j = sim_job(2, 4, 4, 4)
    assert len({plan_name(p) for p in all_plans(j)}) == space_size(j, 10**6)
    uneven = plan_from_stages(j, [[0], [1, 2, 3]], [[0, 1, 2, 3], [4, 5]], [(4, 1), (1, 2)], remat=True,
                              reduce_scatter=True, schedule="GPipe", batch_axis="op")
    assert plan_name(uneven) == "pp2 dp[4,1] op[1,2] layers[1,3] remat zero2 GPipe batch@op"
    halves = plan_from_stages(sim_job(2, 4, 4, 2), [[0], [1]], [[0, 1, 2, 3], [4, 5, 6, 7]], [(4, 1)] * 2, remat=True)
    assert plan_name(halves) == "pp2 dp4 op1 layers[1,3] groups1 remat 1F1B"  # 2 groups: FLOP-balanced
    tiled = make_plan(dataclasses.replace(j, parallel=ParallelSpec("t", (4,), 4, False, (2, 4, 1), (2, 2))))
    assert plan_name(tiled) == "pp2 dp4 op1 1F1B tile[2,2]"
    assert plan_name(make_plan(dataclasses.replace(j, parallel=ParallelSpec("dp", (4,), 1, False, (1, 8, 1))))) == (
        "pp1 dp8 op1")


def test_same_plan_ignores_the_placement_name():
    j = sim_job(1, 8, 1, 4)
    a = make_plan(dataclasses.replace(j, parallel=ParallelSpec("a", (1,), 1, False, (1, 8, 1))))
    b = make_plan(dataclasses.replace(j, parallel=ParallelSpec("b", (1,), 4, False, (1, 8, 1), (1, 8))))
    assert a.placement != b.placement and same_plan(a, b)
    assert not same_plan(a, dataclasses.replace(a, reduce_scatter=True))


def test_plan_top_k_table(tmp_path):
    (tmp_path / "c.toml").write_text(SEED_SIM)
    proc = run_cli("plan", "-c", "c.toml", "--top", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:6] == ["model", "cluster", "micro_batches", "space", "rank", "plan"]
    # Two best per block (three Auto search blocks, one manual), and the pipeline spec wherever it ranks.
    assert 8 <= len(lines) - 1 <= 9
    assert "codesign: " in proc.stderr and "plans priced" in proc.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('device = "H100"', 'device = "B200"', 1),
     "c.toml: [[cluster_spec]] #1 field 'device': unknown device kind 'B200'; known kinds: A100, H100, H200, cpu"),
    (lambda t: t.replace('device = "H100"\n', "", 1),
     "c.toml: [[cluster_spec]] #1 field 'device': is required with platform = \"sim\""),
    (lambda t: t + "\n[links.EFAx4]\nbandwidth = -5e9\n",
     "c.toml: [links.EFAx4] field 'bandwidth': expected a positive number, got -5000000000.0"),
    (lambda t: t + "\n[links.Infiniband]\nbandwidth = 5e9\n", "c.toml: top level field 'links': unknown link"),
])
@pytest.mark.parametrize("command", [("plan",), ()])
def test_bad_simulation_input_exits_2_naming_the_field(tmp_path, edit, message, command):
    (tmp_path / "c.toml").write_text(edit(SEED_SIM))
    proc = run_cli(*command, "-c", "c.toml", "-d", "r.db", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == "" and not (tmp_path / "r.db").exists()


def test_link_overrides_change_the_prediction(tmp_path):
    (tmp_path / "fast.toml").write_text(SEED_SIM)
    (tmp_path / "slow.toml").write_text(SEED_SIM + "\n[links.EFAx4]\nbandwidth = 1e9\nlatency = 1e-3\n")
    times = {}
    for name in ("fast", "slow"):
        proc = run_cli("plan", "-c", f"{name}.toml", "--format", "csv", cwd=tmp_path)
        table = [r for r in csv.DictReader(io.StringIO(proc.stdout)) if r["cluster"].startswith("8x8")]
        times[name] = {r["plan"]: float(r["time_ms"]) for r in table}
    assert times["slow"]["pp1 dp64 op1"] > 2 * times["fast"]["pp1 dp64 op1"]


def test_simulated_clusters_are_recorded_with_predictions_and_skipped_on_rerun(tmp_path):
    (tmp_path / "c.toml").write_text(SEED_SIM)
    proc = run_cli("-c", "c.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    attempts = db_rows(tmp_path / "results.db")
    assert [r["status"] for r in attempts].count("simulated") == 5  # two 8-GPU manual specs, 3 Auto search
    for r in attempts:
        if r["status"] == "simulated":
            assert r["predicted_time"] > 0 and r["predicted_memory"] > 0 and r["platform"] == "sim"
            assert r["median"] is None and r["compiled_memory"] is None
            prediction = json.loads(r["all_configs"])["prediction"]
            assert prediction["device_kind"] == "H100" and prediction["fits"] is True
            assert prediction["seconds"] == r["predicted_time"]
    auto = [r for r in attempts if r["description"] == "Auto search"]
    assert [(r["num_nodes"] * r["gpus_per_node"], "chosen_plan" in r["all_configs"]) for r in auto] == [
        (8, True), (16, True), (64, True)]
    again = run_cli("-c", "c.toml", "--retry-failed", cwd=tmp_path)  # simulated counts as finished
    assert "attempted: none; skipped (already recorded or running elsewhere): 5" in again.stderr
    assert export_csv(tmp_path / "results.db", tmp_path / "all.csv", "all") == 5
    frame = pd.read_csv(tmp_path / "all.csv")
    assert (frame["status"] == "simulated").sum() == 5 and frame["predicted_time"].notna().sum() == 5


def test_migration_allows_simulated_keeps_views_and_moves_xla_memory(tmp_path):
    """A DB of the previous release, with a user's view over attempts."""
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript((REPO / "tests" / "data" / "results_v0.1.0.sql").read_text())
    conn.execute("CREATE VIEW mine AS SELECT id, status FROM attempts WHERE avg IS NOT NULL")
    conn.commit()
    before = [dict(zip(("id", "mem"), r)) for r in conn.execute("SELECT id, predicted_memory FROM attempts")]
    conn.close()
    store = Store(db)
    after = store.attempts()
    assert [(r["id"], r["compiled_memory"], r["predicted_memory"]) for r in after] == [
        (b["id"], b["mem"], None) for b in before]
    assert store.conn.execute("SELECT count(*) FROM mine").fetchone()[0] == sum(r["avg"] is not None for r in after) > 0
    assert store.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall()
    attempt = store.claim("sim-key", SIM_JOB, retry_failed=False)
    assert store.finish(attempt, Outcome("simulated", metrics={"predicted_time": 0.5}))
    assert store.decide("sim-key", retry_failed=True).action == "skip"
    with pytest.raises(sqlite3.IntegrityError):
        store.conn.execute("UPDATE attempts SET status = 'bogus' WHERE id = ?", (attempt,))


def test_a_db_keeps_one_copy_of_each_profile_by_id_and_its_v5_profiles_as_legacy(tmp_path):
    db = tmp_path / "r.db"
    conn = sqlite3.connect(db, isolation_level=None)
    for migrate in MIGRATIONS[:6]:  # a DB of the previous release (schema 6), with a measured profile
        migrate(conn)
    conn.execute("PRAGMA user_version = 6")
    conn.execute("INSERT INTO profiles (device_kind, versions, platform, profile, host, created_at) VALUES "
                 "('cpu', '{}', 'cpu', '{\"kind\": \"cpu\", \"source\": \"measured\", \"n\": 0}', 'h', 0)")
    conn.close()
    store = Store(db)
    legacy = [tuple(r) for r in store.conn.execute("SELECT profile_id, source FROM profiles")]
    assert legacy == [("legacy-1", "measured")]
    store.keep_profile("cpu@1", {"kind": "cpu", "platform": "cpu", "source": "measured", "n": 1})
    store.keep_profile("cpu@1", {"kind": "cpu", "platform": "cpu", "source": "measured", "n": 2})  # kept once
    store.keep_profile("H100@2", {"kind": "H100", "platform": "gpu", "source": "built-in", "n": 3})
    assert [p["n"] for p in store.stored_profiles()] == [0, 1, 3]
    assert [r[0] for r in store.conn.execute("SELECT profile_id FROM profiles ORDER BY created_at, rowid")] == [
        "legacy-1", "cpu@1", "H100@2"]


def test_a_simulated_row_is_priced_again_when_its_links_change_and_not_otherwise(tmp_path):
    (tmp_path / "c.toml").write_text(SEED_SIM)
    assert run_cli("-c", "c.toml", cwd=tmp_path).returncode == 0
    first = {r["id"]: r for r in db_rows(tmp_path / "results.db")}
    same = run_cli("-c", "c.toml", cwd=tmp_path)
    assert "re-priced" not in same.stderr and {r["id"]: r for r in db_rows(tmp_path / "results.db")} == first
    (tmp_path / "c.toml").write_text(SEED_SIM + "\n[links.EFAx4]\nbandwidth = 1e9\nlatency = 1e-3\n")
    slow = run_cli("-c", "c.toml", cwd=tmp_path)
    assert slow.returncode == 0 and "re-priced 5 simulated attempt(s)" in slow.stderr
    after = db_rows(tmp_path / "results.db")
    assert len(after) == len(first)
    changed = [r for r in after if r["predicted_time"] != first[r["id"]]["predicted_time"]]
    assert {r["num_nodes"] for r in changed} == {2, 8} and all(
        r["predicted_time"] > first[r["id"]]["predicted_time"] for r in changed)
    assert all(json.loads(r["all_configs"])["prediction"]["links"] for r in changed)


def test_reprice_recomputes_recorded_predictions_with_the_profiles_at_hand(tmp_path):
    store = Store(tmp_path / "r.db")
    attempt = store.claim("k", SIM_JOB, retry_failed=False)
    store.finish(attempt, Outcome("simulated", metrics={"predicted_time": 123.0, "predicted_memory": 1}))
    store.close()
    proc = run_cli("reprice", "-d", "r.db", cwd=tmp_path)
    assert proc.returncode == 0 and "re-priced 1 attempts of r.db" in proc.stderr
    (row,) = db_rows(tmp_path / "r.db")
    assert 0 < row["predicted_time"] < 1 and row["predicted_memory"] > 1
    assert row["profile_id"].startswith("H100@") and row["cost_model"]
    conn = sqlite3.connect(tmp_path / "r.db")
    assert conn.execute("SELECT device_kind FROM profiles WHERE profile_id = ?", (row["profile_id"],)).fetchone() == (
        "H100",)


def test_reprice_prices_an_attempt_by_the_measured_profile_of_the_device_it_ran_on(tmp_path):
    """A GPU DB re-priced on a machine without GPUs: each attempt by the DB's copy of the profile
    measured on the device kind it ran on, where the DB has one; else as before (the built-in)."""
    import dataclasses

    from codesign.cost.model import predict
    from codesign.hardware.profiles import BUILTIN, ProfileBook, Provenance, profile_id

    h100 = BUILTIN["H100"]
    slower = tuple((p, tuple((k, dataclasses.replace(r, forward=r.forward / 100, backward=r.backward / 100)) for k, r in t))
                   for p, t in h100.rates)
    measured = dataclasses.replace(h100, kind="NVIDIA H100 80GB HBM3", rates=slower,
                                   provenance=Provenance("measured"), gemms=False)
    job = Job(ModelSpec(64, 16, 4, 2, (("ATTENTION", "DOT"),) * 2), ClusterSpec(1, 1, "NVLink", "gpu"),
              TrainingSpec(256, 2), ParallelSpec("one", (1,), 1, False, (1, 1, 1)), 1, "gpu")
    store = Store(tmp_path / "r.db")
    store.keep_profile(profile_id(measured), measured.to_dict())
    for key, kind in (("ran", measured.kind), ("elsewhere", "NVIDIA A10G")):
        attempt = store.claim(key, job, retry_failed=False)
        store.finish(attempt, Outcome("succeeded", metrics={"median": 0.01, "device_kind": kind, "predicted_time": 1.0}))
    store.close()
    assert run_cli("reprice", "-d", "r.db", cwd=tmp_path).returncode == 0
    assert [r["predicted_time"] for r in db_rows(tmp_path / "r.db")] == [1.0, 1.0]  # what they predicted before
    ran, elsewhere = db_rows(tmp_path / "r.db", "repricings")
    book = ProfileBook()
    book.add(measured)
    book.local["gpu"] = measured.kind
    assert ran["profile_id"] == profile_id(measured)
    assert ran["predicted_time"] == pytest.approx(predict(job, book)["predicted_time"])
    assert elsewhere["profile_id"] == profile_id(h100)
    assert elsewhere["predicted_time"] == pytest.approx(predict(job, ProfileBook())["predicted_time"])
    assert ran["predicted_time"] > 1.05 * elsewhere["predicted_time"]  # a hundredth of the data sheet's FLOP rates
