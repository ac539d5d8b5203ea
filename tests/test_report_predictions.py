"""The report's Predictions and Energy sections, and the co-design ranking's energy frontier: every
number in their tables against one computed here from the DB's rows (or the CSV's)."""

import json
import math
import statistics

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

from codesign.report.frame import plan_kind
from codesign.store.database import Store
from tests.report_db import C2, C4, MODEL_A, MODEL_B, SIM8, build_learning
from tests.test_report import Page, report_cli, shown

# plan kind of each (pp, dp, op) and micro-batch count of tests/report_db.py's LEARNING
KINDS = {((1, 4, 1), 1): "dp", ((1, 1, 4), 1): "op", ((1, 2, 2), 1): "dp x op", ((1, 4, 1), 2): "dp, accumulating",
         ((2, 2, 1), 2): "pp x dp", ((1, 2, 1), 1): "dp", ((1, 1, 2), 1): "op"}


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("learned")
    build_learning(tmp / "l.db")
    code, _, stderr = report_cli("report", "-d", str(tmp / "l.db"), "-o", str(tmp / "out"))
    assert code == 0, stderr
    store = Store(tmp / "l.db", read_only=True)
    rows = store.attempts()
    store.close()
    return Page((tmp / "out" / "report.html").read_text()), rows, tmp / "out"


def titled(page: Page, section: str, column: str) -> list[dict[str, str]]:
    """The rows of the section's one table with this column."""
    (index,) = [i for i, t in enumerate(page.sections[section]["tables"]) if column in t[0]]
    return page.rows(section, index)


def timed(rows) -> list[dict]:
    """Measured, succeeded attempts with a predicted time, in the order they ran (Store.attempts: by id)."""
    return [r for r in rows if r["status"] == "succeeded" and r["predicted_time"] is not None]


def error(row, predicted="predicted_time", measured="median") -> float:
    return (row[predicted] - row[measured]) / row[measured]


def test_time_error_by_third_of_the_run(learned):
    page, rows, _ = learned
    errors = [abs(error(r)) for r in timed(rows)]
    assert len(errors) == 10
    thirds = [statistics.median(errors[:4]), statistics.median(errors[4:7]), statistics.median(errors[7:])]
    cells = titled(page, "predictions", "part of the run")
    assert [(c["platform"], c["part of the run"], c["attempts"]) for c in cells] == [
        ("cpu", "first third", "1-4"), ("cpu", "second third", "5-7"), ("cpu", "last third", "8-10")]
    assert [shown(c["median |error|"]) for c in cells] == pytest.approx([100 * t for t in thirds], abs=0.05)
    assert [c["vs first third"] for c in cells] == [f"{t / thirds[0]:.2f}x" for t in thirds]
    assert len(page.sections["predictions"]["images"]) == 2  # predicted against measured; error in run order


def test_time_error_by_plan_kind(learned):
    page, rows, _ = learned
    by_kind: dict[str, list[float]] = {}
    for row in timed(rows):
        kind = KINDS[(tuple(json.loads(row["pp_dp_op"])), row["num_micro_batches"])]
        by_kind.setdefault(kind, []).append(error(row))
    cells = {c["plan kind"]: c for c in titled(page, "predictions", "plan kind")}
    assert set(cells) == set(by_kind) and len(by_kind) == 5
    for kind, errors in by_kind.items():
        assert int(cells[kind]["attempts"]) == len(errors)
        assert shown(cells[kind]["median error"]) == pytest.approx(100 * statistics.median(errors), abs=0.05)
        assert shown(cells[kind]["median |error|"]) == pytest.approx(
            100 * statistics.median(map(abs, errors)), abs=0.05)
    assert [int(c["attempts"]) for c in cells.values()] == sorted((len(e) for e in by_kind.values()), reverse=True)


def test_plan_kind_is_the_kind_a_calibration_learns_by():
    assert plan_kind(1, 1, 1, 1) == "single"
    assert plan_kind(2, 4, 1, 8) == "pp x dp"
    assert plan_kind(1, 4, 1, 2) == "dp, accumulating"
    assert plan_kind(1, 2, 2, float("nan")) == "other"
    assert plan_kind(float("nan"), float("nan"), float("nan"), 2) == "other"


def test_time_error_by_calibration(learned):
    page, rows, _ = learned
    versions: dict[str, list[float]] = {}
    for row in timed(rows):
        version = json.loads(row["all_configs"])["prediction"].get("calibration")
        versions.setdefault("none" if version is None else str(version), []).append(abs(error(row)))
    cells = titled(page, "predictions", "calibration")
    assert [(c["calibration"], c["first attempt"], int(c["attempts"])) for c in cells] == [
        ("none", "1", 4), ("1", "5", 3), ("2", "8", 3)]
    assert [shown(c["median |error|"]) for c in cells] == pytest.approx(
        [100 * statistics.median(versions[c["calibration"]]) for c in cells], abs=0.05)


def test_rank_correlation_per_group_of_three_or_more_plans(learned):
    page, rows, _ = learned
    groups: dict[tuple, list[dict]] = {}
    for row in timed(rows):
        groups.setdefault((row["input_features"], row["gpus_per_node"]), []).append(row)
    labels = {(8, 4): (MODEL_A, C4), (16, 4): (MODEL_B, C4), (8, 2): (MODEL_A, C2)}
    cells = {(c["model"], c["cluster"]): c for c in titled(page, "predictions", "Spearman")}
    expected = {}
    for key, group in groups.items():
        if len(group) >= 3:
            model, cluster = labels[key]
            chosen = min(group, key=lambda r: r["predicted_time"])["median"]
            expected[(model.summary(), cluster.summary())] = (
                len(group), spearmanr([r["predicted_time"] for r in group], [r["median"] for r in group]).statistic,
                chosen / min(r["median"] for r in group))
    assert set(cells) == set(expected) and len(expected) == 2  # model A on two devices has two plans
    for key, (plans, rho, ratio) in expected.items():
        assert int(cells[key]["plans"]) == plans
        assert float(cells[key]["Spearman"]) == pytest.approx(rho, abs=1e-3)
        assert cells[key]["predicted fastest / fastest, measured time"] == f"{ratio:.2f}x"


def test_share_of_memory_predictions_below_the_measured_peak(learned):
    page, rows, _ = learned
    errors = [error(r, "predicted_memory", "max_memory") for r in timed(rows)]
    (cells,) = titled(page, "predictions", "predicted below measured")
    assert int(cells["attempts"]) == len(errors) == 10
    assert shown(cells["predicted below measured"]) == pytest.approx(100 * np.mean([e < 0 for e in errors]))
    assert shown(cells["below by > 5%"]) == pytest.approx(100 * np.mean([e < -0.05 for e in errors]))
    assert shown(cells["median over-prediction"]) == pytest.approx(100 * statistics.median(errors), abs=0.05)
    assert 0 < shown(cells["below by > 5%"]) < shown(cells["predicted below measured"])


def frontier(points: list[tuple[float, float]]) -> list[bool]:
    """Each point is on it when no other is at most as slow and as costly, and better in one."""
    return [not any(t2 <= t and e2 <= e and (t2, e2) != (t, e) for t2, e2 in points) for t, e in points]


def test_energy_frontier_of_every_group(learned):
    page, rows, out = learned
    priced = [r for r in rows if r["predicted_energy"] is not None and r["predicted_time"] is not None
              and r["status"] in ("succeeded", "simulated")]
    assert any(r["status"] == "oom" and r["predicted_energy"] is not None for r in rows)  # never on it
    expected = []
    for cluster in (C4, SIM8):
        group = [r for r in priced if r["gpus_per_node"] == cluster.num_devices_per_host]
        on = frontier([(r["predicted_time"], r["predicted_energy"]) for r in group])
        expected += sorted((r for r, keep in zip(group, on) if keep), key=lambda r: r["predicted_time"])
    cells = titled(page, "energy", "predicted J/iter")
    assert [(c["cluster"], c["plan"].split(" | ")[0]) for c in cells] == [
        ({4: C4.summary(), 8: "1x8 NVLink (sim H100)"}[r["gpus_per_node"]], r["description"]) for r in expected]
    assert len(cells) == 6 and {c["status"] for c in cells} == {"succeeded", "simulated"}
    for cell, row in zip(cells, expected):
        batch = row["input_batch_size"]
        assert shown(cell["predicted time (ms)"]) == pytest.approx(row["predicted_time"] * 1e3)
        assert shown(cell["predicted J/iter"]) == row["predicted_energy"]
        assert shown(cell["predicted samples/J"]) == pytest.approx(batch / row["predicted_energy"], rel=1e-3)
        if row["energy_per_iter"] is None:
            assert cell["measured J/iter"] == cell["measured samples/J"] == "-"
        else:
            assert shown(cell["measured J/iter"]) == row["energy_per_iter"]
            assert shown(cell["measured samples/J"]) == pytest.approx(batch / row["energy_per_iter"], rel=1e-3)
            assert shown(cell["measured time (ms)"]) == pytest.approx(row["median"] * 1e3)
    measured = titled(page, "energy", "J/sample")
    assert {(c["plan"].split(" | ")[0], c["W/device"], c["source"]) for c in measured} == {
        ("dp", "100", "zeus:nvml"), ("dp x op", "100", "zeus:nvml")}
    assert (out / "energy_frontier.png").exists() and len(page.sections["energy"]["images"]) == 2


def ranking_csv(path, with_energy: bool) -> pd.DataFrame:
    """A co-design CSV of two clusters; samples per joule where the ranking priced energy."""
    speed = [900.0, 800.0, 700.0, 650.0, 500.0, math.nan, 400.0, 300.0, 350.0]
    joules = [1.0, 3.0, 2.0, 2.0, 4.0, math.nan, 5.0, 2.0, math.nan]
    table = pd.DataFrame({
        "cluster": ["1x8 NVLink (sim H100)"] * 6 + ["2x8 EFAx4 (sim H100)"] * 3, "micro_batches": 1,
        "rank": [1, 2, 3, 4, 5, None, 1, 2, 3], "model": [f"M{i}" for i in range(9)],
        "params": [1e6 + i for i in range(9)], "predicted_samples_per_s": speed,
        "predicted_memory_gib": 1.5, "plan": "pp1 dp8 op1", "pareto": [1, 0, 0, 0, 0, 0, 1, 0, 0],
        "measured_samples_per_s": math.nan})
    if with_energy:
        table["samples_per_joule"] = joules
    table.to_csv(path, index=False)
    return table


def test_the_rankings_energy_frontier_is_the_csvs(tmp_path):
    table = ranking_csv(tmp_path / "rank.csv", with_energy=True)
    Store(tmp_path / "r.db").close()
    code, _, stderr = report_cli("report", "-d", str(tmp_path / "r.db"), "-o", str(tmp_path / "out"),
                                 "--codesign", str(tmp_path / "rank.csv"))
    assert code == 0, stderr
    page = Page((tmp_path / "out" / "report.html").read_text())
    expected = []
    for cluster, group in table.groupby("cluster", sort=True):
        fit = group.dropna(subset=["predicted_samples_per_s", "samples_per_joule"])
        # both maximised: negate them for frontier(), which keeps what nothing beats downwards
        on = frontier(list(zip(-fit["predicted_samples_per_s"], -fit["samples_per_joule"])))
        expected += fit[on].sort_values("predicted_samples_per_s", ascending=False).to_dict("records")
    cells = titled(page, "codesign", "predicted samples/J")
    assert [(c["cluster"], c["model"]) for c in cells] == [(r["cluster"], r["model"]) for r in expected]
    assert [c["model"] for c in cells] == ["M0", "M1", "M4", "M6"]
    assert [shown(c["predicted samples/J"]) for c in cells] == [r["samples_per_joule"] for r in expected]
    assert [shown(c["predicted samples/s"]) for c in cells] == [r["predicted_samples_per_s"] for r in expected]
    assert (tmp_path / "out" / "codesign_energy.png").exists()


def test_a_ranking_without_energy_shows_no_energy_frontier(tmp_path):
    ranking_csv(tmp_path / "rank.csv", with_energy=False)
    Store(tmp_path / "r.db").close()
    code, _, stderr = report_cli("report", "-d", str(tmp_path / "r.db"), "-o", str(tmp_path / "out"),
                                 "--codesign", str(tmp_path / "rank.csv"))
    assert code == 0, stderr
    page = Page((tmp_path / "out" / "report.html").read_text())
    assert len(page.sections["codesign"]["tables"]) == 1  # the parameters-throughput frontier only
    assert not (tmp_path / "out" / "codesign_energy.png").exists()


def test_repriced_attempts_leave_the_forecasts_alone_and_are_shown_apart_labelled_in_sample(learned, tmp_path):
    """`codesign reprice` since the runs: every forecast table is as it was (what was predicted
    before the jobs ran); one table more gives the repriced errors, in-sample and not apart."""
    before_page, _, _ = learned
    build_learning(tmp_path / "l.db")
    store = Store(tmp_path / "l.db")
    attempts = timed(store.attempts())
    for i, row in enumerate(attempts):
        store.reprice(row["id"], {"predicted_time": 9.0, "prediction": {"calibration": 2}}, in_sample=False)
        exact = i < 6  # the latest repricing counts: the first six exact and fitted to them, the rest 10% slow
        store.reprice(row["id"], {"predicted_time": row["median"] * (1 if exact else 1.1),
                                  "prediction": {"calibration": 3}}, in_sample=exact)
    store.close()
    code, _, stderr = report_cli("report", "-d", str(tmp_path / "l.db"), "-o", str(tmp_path / "out"))
    assert code == 0, stderr
    page = Page((tmp_path / "out" / "report.html").read_text())
    *forecasts, _ = page.sections["predictions"]["tables"]
    assert forecasts == before_page.sections["predictions"]["tables"]
    befores = [abs(error(r)) for r in attempts]
    cells = titled(page, "predictions", "in-sample")
    assert [(c["re-priced by calibration"], c["in-sample"], int(c["attempts"])) for c in cells] == [
        ("3", "no", 4), ("3", "yes", 6)]
    assert [shown(c["median |error|, re-priced"]) for c in cells] == pytest.approx([10.0, 0.0], abs=0.05)
    assert [shown(c["median |error| before they ran"]) for c in cells] == pytest.approx(
        [100 * statistics.median(befores[6:]), 100 * statistics.median(befores[:6])], abs=0.05)
