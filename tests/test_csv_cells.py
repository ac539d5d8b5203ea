"""Every CSV codesign writes neutralises cells a spreadsheet would run as formulas (OWASP's CSV
injection advice): text starting with =, +, -, @, tab or carriage return gets a leading quote;
numbers, negative ones too, stay numbers."""

import csv
import io

import pytest

from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.csv_cells import safe_cell
from codesign.outcome import Outcome
from codesign.planner import listing, ranking
from codesign.store.database import Store
from codesign.store.export import export_csv


def job(description: str) -> Job:
    return Job(ModelSpec(4, 2, 1, 1, (("LINEAR",),)), ClusterSpec(1, 1, "NVLink", "cpu"), TrainingSpec(2, 2),
               ParallelSpec(description, (1,), 1, False, (1, 1, 1)), 1, "cpu")


@pytest.mark.parametrize("cell, written", [
    ("=cmd|' /C calc'!A0", "'=cmd|' /C calc'!A0"), ("+SUM(A1)", "'+SUM(A1)"), ("-2+3+cmd", "'-2+3+cmd"),
    ("@SUM(A1)", "'@SUM(A1)"), ("\t=1", "'\t=1"), ("\r=1", "'\r=1"), ("-1.5", "-1.5"), ("+2", "+2"),
    ("data parallel", "data parallel"), ("", ""), (-1.5, -1.5), (-3, -3), (None, None)])
def test_a_cell_that_reads_as_a_formula_gets_a_leading_quote(cell, written):
    assert safe_cell(cell) == written


def test_export_quotes_a_formula_in_an_error_and_keeps_negative_numbers_numbers(tmp_path):
    store = Store(tmp_path / "r.db")
    for description, outcome in (("dp", Outcome("failed", error="=cmd|' /C calc'!A0")),
                                 ("@dp", Outcome("succeeded", metrics={"avg": -1.5, "max_memory": -3}))):
        store.finish(store.claim(description, job(description), retry_failed=False), outcome)
    store.close()
    assert export_csv(tmp_path / "r.db", tmp_path / "all.csv", "all") == 2
    failed, succeeded = csv.DictReader(io.StringIO((tmp_path / "all.csv").read_text()))
    assert failed["error"] == "'=cmd|' /C calc'!A0" and failed["description"] == "dp"
    assert succeeded["description"] == "'@dp" and succeeded["avg"] == "-1.5" and float(succeeded["max_memory"]) == -3


def test_plan_listing_csv_quotes_formulas(tmp_path):
    out = io.StringIO()
    row = {c: "" for c in listing.COLUMNS} | {"model": "=1+1", "plan": "-pp1", "time_ms": -2.5, "rank": 1}
    assert listing.write_csv([row], out) == 1
    (written,) = csv.DictReader(io.StringIO(out.getvalue()))
    assert (written["model"], written["plan"], written["time_ms"], written["rank"]) == ("'=1+1", "'-pp1", "-2.5", "1")


def test_the_rankings_csv_quotes_formulas(tmp_path, monkeypatch):
    cells = ["=1+1", -0.03, "-0.0300", "@x", "plain"]
    monkeypatch.setattr(ranking, "csv_rows", lambda found, rankings, measured: iter([cells]))
    assert ranking.write_csv(None, [], str(tmp_path / "rank.csv")) == 1
    header, row = csv.reader(io.StringIO((tmp_path / "rank.csv").read_text()))
    assert header == list(ranking.COLUMNS) and row == ["'=1+1", "-0.03", "-0.0300", "'@x", "plain"]
