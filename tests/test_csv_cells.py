"""Every CSV codesign writes neutralises cells a spreadsheet would run as formulas (OWASP's CSV
injection advice): text starting with =, +, -, @, tab or carriage return gets a leading quote;
numbers, negative ones too, stay numbers."""

import csv
import io

import pytest

from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.csv_cells import safe_cell
from codesign.outcome import Outcome
from codesign.planner import listing
from codesign.planner import ranking
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


def test_the_rankings_csv_quotes_formulas(tmp_path):
    """A ranking's text cells (here a plan name and a reason set to formulas) behind a quote;
    its numbers, negative ones too (params_vs_base below the base), stay numbers."""
    from codesign.cli import build_search_parser
    from codesign.hardware.profiles import ProfileBook
    from codesign.zhen import search

    query = search.search_from_args(build_search_parser().parse_args(
        ["--base-features", "32", "--base-emb-dim", "16", "--base-output-per-emb", "4", "--slots", "3",
         "--max-layers", "1", "--param-tolerance", "1"]))
    found = ranking.candidates(query)
    target = ranking.Target(ClusterSpec(1, 2, "NVLink", "sim", "H100"), "sim", ParallelSpec("Auto search", (1,)), 1)
    ranked = ranking.rank_target(target, TrainingSpec(8, 5), ProfileBook(), (), found, top=1)
    ranked.plans[0], ranked.reasons[1] = "=1+1", "@x"
    assert ranking.write_csv(found, [ranked], str(tmp_path / "rank.csv")) == len(found)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "rank.csv").read_text())))
    assert (rows[0]["plan"], rows[1]["reason"]) == ("'=1+1", "'@x")
    below = [r for r in rows if float(r["params_vs_base"]) < 0]
    assert below and all(not r["params_vs_base"].startswith("'") for r in below)
