"""`codesign report` on a DB with every status: files, figures, numbers against the DB, escaping."""

import base64
import contextlib
import csv
import io
import sqlite3
import subprocess
import sys
from html.parser import HTMLParser

import markupsafe
import pandas as pd
import pytest

from codesign.cli import main
from codesign.outcome import Outcome
from codesign.report.tables import sweep_summary
from codesign.store.database import Store
from tests.conftest import REPO
from tests.report_db import HOSTILE, build

FIGURES = {"throughput", "speedup", "predicted", "prediction_order", "energy", "compile_vs_step", "failures",
           "simulated", "auto_search"}
SECTIONS = ["overview", "best", "ranking", "throughput", "speedup", "predictions", "energy", "compile",
            "failures", "simulated", "auto", "codesign"]


class Page(HTMLParser):
    """Per <section id>: its tables (rows of cell texts), images (src) and empty note."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.sections: dict[str, dict] = {}
        self.current = self.cell = None
        self.in_empty = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.current = self.sections.setdefault(attrs["id"], {"tables": [], "images": [], "empty": ""})
        elif tag == "table":
            self.current["tables"].append([])
        elif tag == "tr":
            self.current["tables"][-1].append([])
        elif tag in ("td", "th"):
            self.cell = ""
        elif tag == "img":
            self.current["images"].append(attrs["src"])
        elif tag == "p" and attrs.get("class") == "empty-note":
            self.in_empty = True

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.current["tables"][-1][-1].append(self.cell)
            self.cell = None
        elif tag == "p":
            self.in_empty = False

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data
        elif self.in_empty:
            self.current["empty"] += data

    def rows(self, section: str, table: int = 0) -> list[dict[str, str]]:
        header, *body = self.sections[section]["tables"][table]
        return [dict(zip(header, row)) for row in body]


def report_cli(*args: str) -> tuple[int, str, str]:
    """`codesign ARGS` in this process (a subprocess costs seconds of imports): code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The rich DB of tests/report_db.py, reported once through the CLI."""
    tmp = tmp_path_factory.mktemp("report")
    build(tmp / "r.db")
    code, stdout, stderr = report_cli("report", "-d", str(tmp / "r.db"), "-o", str(tmp / "out"))
    assert code == 0, stderr
    assert stdout == "" and "codesign: report of 16 attempts" in stderr
    store = Store(tmp / "r.db", read_only=True)
    rows = store.attempts()
    store.close()
    html = (tmp / "out" / "report.html").read_text()
    return tmp / "out", html, Page(html), rows


def db_rows(rows, **where):
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def same(value, expected) -> bool:
    """A CSV cell equals the DB's value: both absent, or equal numbers/texts."""
    if expected is None:
        return pd.isna(value)
    return value == expected


def shown(cell: str) -> float:
    """A formatted number of the page back to a float (12,346 / 2.00x / 14.8%)."""
    return float(cell.replace(",", "").rstrip("x%"))


def test_report_writes_every_figure_inlined_and_nothing_external(report):
    out, html, page, _ = report
    assert {p.stem for p in out.glob("*.png")} == FIGURES
    assert {p.name for p in out.iterdir()} == {f"{f}.png" for f in FIGURES} | {"report.html", "summary.csv",
                                                                                "plans.csv"}
    for name in FIGURES:
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"data:image/png;base64,{base64.b64encode(data).decode()}" in html
    srcs = [src for s in page.sections.values() for src in s["images"]]
    assert len(srcs) == len(FIGURES) and all(src.startswith("data:image/png;base64,") for src in srcs)
    assert list(page.sections) == SECTIONS
    assert "<script" not in html and "<link" not in html and "url(" not in html and "@import" not in html
    # every section with data has content, none says it is empty
    with_data = [s for s in SECTIONS if s != "codesign"]  # its data is a ranking's CSV (tests/test_ranking.py)
    assert {s: page.sections[s]["empty"] for s in with_data} == {s: "" for s in with_data}


def test_a_hostile_description_is_text(report):
    out, html, page, _ = report
    assert "<script>alert" not in html
    assert str(markupsafe.escape(HOSTILE)) in html
    plans = [row["plan"] for row in page.rows("ranking", 1)]
    assert f"{HOSTILE} | pp1 dp2 op1 | mb2 | remat | ZeRO-2" in plans
    assert f"{HOSTILE} | pp1 dp2 op1 | mb2 | remat | ZeRO-2" in set(pd.read_csv(out / "plans.csv")["plan"])


def test_best_plan_is_the_fastest_measured_one_and_its_numbers_are_the_dbs(report):
    out, _, page, rows = report
    on_two = db_rows(rows, status="succeeded", gpus_per_node=2, input_features=8)
    best = max(on_two, key=lambda r: r["throughput"])
    assert best["description"] == "operator parallel"
    dp = min((r for r in on_two if r["pp_dp_op"] == "[1, 2, 1]" and r["description"] != "Auto search"),
             key=lambda r: r["avg"])
    summary = pd.read_csv(out / "summary.csv")
    row = summary[(summary["kind"] == "measured") & (summary["cluster"] == "1x2 NVLink (cpu)")].iloc[0]
    assert row["job_key"] == best["job_key"] and row["plan"] == "operator parallel | pp1 dp1 op2 | mb1"
    for csv_column, db_column in [("throughput", "throughput"), ("step_time", "avg"), ("median", "median"),
                                  ("p90", "p90"), ("max_memory", "max_memory"),
                                  ("predicted_time", "predicted_time"), ("predicted_memory", "predicted_memory"),
                                  ("global_batch", "input_batch_size")]:
        assert row[csv_column] == best[db_column], csv_column
    assert row["dp_plan"] == "data parallel | pp1 dp2 op1 | mb1"  # not Auto search, although it chose pp1 op1
    assert row["dp_throughput"] == dp["throughput"]
    assert row["speedup_over_dp"] == pytest.approx(dp["avg"] / best["avg"]) == 2.0
    assert set(row["failed_attempts"].split(", ")) == {"1 failed", "1 invalid", "1 timeout", "1 oom", "1 interrupted"}

    (cells,) = [r for r in page.rows("best") if r["cluster"] == "1x2 NVLink (cpu)"]
    assert cells["best plan"] == row["plan"]
    assert shown(cells["samples/s"]) == pytest.approx(best["throughput"], rel=1e-3)
    assert shown(cells["step time (ms)"]) == pytest.approx(best["avg"] * 1e3, rel=1e-3)
    assert shown(cells["memory (MiB)"]) == pytest.approx(best["max_memory"] / 2**20, rel=1e-3)
    assert cells["speedup over DP"] == "2.00x"


def test_groups_without_a_baseline_or_a_success_say_so(report):
    out, _, page, _ = report
    summary = pd.read_csv(out / "summary.csv")
    four = summary[summary["cluster"] == "1x4 NVLink (cpu)"].set_index("model")
    assert four.loc["F8 D4 O2 L2 [LD/LD]", "plan"] == "dp x op | pp1 dp2 op2 | mb1 | mesh 1x4"
    assert pd.isna(four.loc["F8 D4 O2 L2 [LD/LD]", "speedup_over_dp"])  # no pp = 1, op = 1 plan there
    assert pd.isna(four.loc["F16 D4 O2 L1 [A]", "plan"])
    assert set(four.loc["F16 D4 O2 L1 [A]", "failed_attempts"].split(", ")) == {"1 oom", "1 invalid"}
    (cells,) = [r for r in page.rows("best") if r["cluster"] == "1x4 NVLink (cpu)"]
    assert (cells["speedup over DP"], cells["data-parallel plan"]) == ("-", "-")


def test_every_plan_is_ranked_once_with_its_status_and_the_dbs_numbers(report):
    out, _, page, rows = report
    plans = pd.read_csv(out / "plans.csv")
    assert sorted(plans["job_key"]) == sorted({r["job_key"] for r in rows})
    for plan in plans.to_dict("records"):
        attempts = db_rows(rows, job_key=plan["job_key"])
        shown_attempt = attempts[-1]  # Store.attempts() is oldest first
        assert plan["status"] == shown_attempt["status"] and plan["attempts"] == len(attempts)
        for column in ("throughput", "avg", "median", "p90", "max_memory", "compile_time", "predicted_time",
                       "predicted_memory", "energy_per_iter"):
            assert same(plan[column], shown_attempt[column]), (plan["plan"], column)
    two = plans[(plans["kind"] == "measured") & (plans["cluster"] == "1x2 NVLink (cpu)")]
    ranked = two[two["rank"].notna()]
    assert list(ranked["rank"]) == [1, 2, 3, 4, 5]
    assert list(ranked["throughput"]) == sorted(ranked["throughput"], reverse=True)
    retried = two[two["plan"].str.startswith("pipeline")].iloc[0]
    assert (retried["status"], retried["attempts"]) == ("succeeded", 2)

    table = page.rows("ranking", 1)  # groups in model order: F16 first, then F8 on 1x2
    assert [r["status"] for r in table] == ["succeeded"] * 5 + ["invalid", "timeout", "oom", "interrupted",
                                                               "running"]
    assert [r["rank"] for r in table] == ["1", "2", "3", "4", "5"] + ["-"] * 5
    assert [shown(r["samples/s"]) for r in table[:5]] == pytest.approx(list(ranked["throughput"]), rel=1e-3)


def test_simulated_rows_are_ranked_apart_from_measured_ones(report):
    out, _, page, rows = report
    measured_cells = [c for s in ("best", "ranking", "speedup", "energy") for t in page.sections[s]["tables"]
                      for row in t for c in row]
    assert measured_cells and not any("sim H100" in c for c in measured_cells)
    sim = page.rows("simulated")
    assert [r["plan"] for r in sim] == ["pipeline | pp2 dp4 op1 | mb2 | groups 2", "data parallel | pp1 dp8 op1 | mb1"]
    priced = {r["predicted_time"]: r for r in db_rows(rows, status="simulated")}
    assert shown(sim[0]["predicted samples/s"]) == 32 / 0.0008 and shown(sim[0]["predicted step (ms)"]) == 0.8
    assert shown(sim[1]["predicted memory (MiB)"]) == priced[0.001]["predicted_memory"] / 2**20
    summary = pd.read_csv(out / "summary.csv")
    (row,) = summary[summary["kind"] == "simulated"].to_dict("records")
    assert (row["cluster"], row["throughput"], row["speedup_over_dp"]) == ("1x8 NVLink (sim H100)", 40000, 1.25)


def test_predictions_energy_compile_and_failures_equal_the_db(report):
    _, _, page, rows = report
    ok = db_rows(rows, status="succeeded")
    time_errors = [abs(r["predicted_time"] - r["median"]) / r["median"] for r in ok if r["predicted_time"]]
    memory_errors = [abs(r["predicted_memory"] - r["max_memory"]) / r["max_memory"] for r in ok
                     if r["predicted_memory"]]
    stats = {r["quantity"]: r for r in page.rows("predictions")}
    for quantity, errors in (("time", time_errors), ("memory", memory_errors)):
        assert int(stats[quantity]["attempts"]) == len(errors) > 0
        assert shown(stats[quantity]["median |error|"]) == pytest.approx(100 * float(pd.Series(errors).median()), abs=0.05)
        assert shown(stats[quantity]["p90 |error|"]) == pytest.approx(100 * float(pd.Series(errors).quantile(0.9)),
                                                                      abs=0.05)

    energy = page.rows("energy")
    expected = sorted((r["energy_per_iter"] / r["input_batch_size"], r["description"]) for r in ok if r["energy_per_iter"])
    assert [(shown(r["J/sample"]), r["plan"].split(" | ")[0]) for r in energy] == expected

    compile_rows = {r["cluster"]: r for r in page.rows("compile")}
    assert shown(compile_rows["1x4 NVLink (cpu)"]["median compile (s)"]) == 2.5
    assert int(compile_rows["1x2 NVLink (cpu)"]["attempts"]) == len(db_rows(ok, gpus_per_node=2))

    failed = [r for r in rows if r["status"] in ("failed", "timeout", "oom", "invalid", "interrupted")]
    expected_failures = sorted((r["status"], r["error"].strip().splitlines()[-1]) for r in failed)
    assert sorted((r["status"], r["reason"]) for r in page.rows("failures")) == expected_failures
    assert sum(int(r["attempts"]) for r in page.rows("failures")) == len(failed) == 7


def test_auto_search_is_compared_with_the_best_manual_plan(report):
    _, _, page, rows = report
    (auto,) = db_rows(rows, description="Auto search")
    (row,) = page.rows("auto")
    assert row["Auto search plan"] == "Auto search | pp1 dp2 op1 | mb1 | mesh 1x2 | placed"
    assert row["best manual plan"] == "operator parallel | pp1 dp1 op2 | mb1"
    assert shown(row["Auto search samples/s"]) == pytest.approx(auto["throughput"], rel=1e-3)
    assert shown(row["manual samples/s"]) == 4000
    assert row["auto / manual"] == f"{auto['throughput'] / 4000:.2f}x" == "0.75x"


def test_sweep_summary_table(report):
    _, _, _, rows = report
    lines = sweep_summary(rows).splitlines()
    assert lines[0].split() == ["model", "cluster", "best", "plan", "samples/s", "vs", "data", "parallel",
                                "failed", "attempts"]
    assert len(lines) == 5  # the header, then (A, 1x2), (A, 1x4), (B, 1x4) and the simulated (A, 1x8)
    best = next(line for line in lines if "1x2 NVLink (cpu)" in line)
    assert "operator parallel | pp1 dp1 op2 | mb1" in best and " 4000 " in best and " 2.00x " in best
    nothing = next(line for line in lines if "F16 D4 O2 L1 [A]" in line)
    assert "(none succeeded)" in nothing and "1 oom, 1 invalid" in nothing
    sim = next(line for line in lines if "sim H100" in line)
    assert "40,000 (predicted)" in sim and "1.25x" in sim


def test_an_empty_db_reports_why_each_section_is_empty(tmp_path):
    Store(tmp_path / "r.db").close()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "energy.png").write_bytes(b"an earlier report's figure")
    (tmp_path / "out" / "mine.png").write_bytes(b"the user's file")
    code, stdout, stderr = report_cli("report", "-d", str(tmp_path / "r.db"), "-o", str(tmp_path / "out"))
    assert code == 0 and stdout == "", stderr
    page = Page((tmp_path / "out" / "report.html").read_text())
    assert list(page.sections) == SECTIONS
    assert all(page.sections[s]["empty"] for s in SECTIONS)
    assert "RAPL" in page.sections["energy"]["empty"] and "codesign[energy]" in page.sections["energy"]["empty"]
    assert "platform = \"sim\"" in page.sections["simulated"]["empty"]
    assert [p.name for p in (tmp_path / "out").glob("*.png")] == ["mine.png"]
    assert pd.read_csv(tmp_path / "out" / "summary.csv").empty


def test_the_reports_csvs_quote_formulas_and_keep_numbers_numbers(tmp_path):
    from tests.report_db import C2, MODEL_A, job, measured, record

    store = Store(tmp_path / "r.db")
    hostile = job(MODEL_A, C2, "-dp", (1, 2, 1))
    record(store, hostile, Outcome("succeeded", metrics=measured(0.004, hostile)))
    record(store, job(MODEL_A, C2, "op", (1, 1, 2)), Outcome("failed", error="=cmd|' /C calc'!A0"))
    store.close()
    code, _, stderr = report_cli("report", "-d", str(tmp_path / "r.db"), "-o", str(tmp_path / "out"))
    assert code == 0, stderr
    plans = {r["status"]: r for r in csv.DictReader(io.StringIO((tmp_path / "out" / "plans.csv").read_text()))}
    assert plans["failed"]["error"] == "'=cmd|' /C calc'!A0"
    assert plans["succeeded"]["plan"] == "'-dp | pp1 dp2 op1 | mb1" and float(plans["succeeded"]["avg"]) == 0.004
    (summary,) = csv.DictReader(io.StringIO((tmp_path / "out" / "summary.csv").read_text()))
    assert summary["plan"] == "'-dp | pp1 dp2 op1 | mb1" and summary["global_batch"] == "8"


def test_a_db_of_the_previous_release_reports_its_auto_search_failure(tmp_path):
    conn = sqlite3.connect(tmp_path / "old.db")
    conn.executescript((REPO / "tests" / "data" / "results_v0.1.0.sql").read_text())
    conn.close()
    code, _, stderr = report_cli("report", "-d", str(tmp_path / "old.db"), "-o", str(tmp_path / "out"))
    assert code == 0, stderr
    html = (tmp_path / "out" / "report.html").read_text()
    page = Page(html)
    assert page.sections["auto"]["empty"] == ("No Auto search attempt succeeded (1 invalid): "
                                              "Auto search is not supported yet")
    # 0.1.0 kept XLA's memory analysis as predicted_memory; schema v5 moved it to compiled_memory
    assert page.sections["predictions"]["empty"].startswith("No succeeded attempt recorded a prediction")
    (best,) = page.rows("best")
    assert best["best plan"] == "pipeline | pp2 dp1 op1 | mb2 | groups 2 | GPipe"
    assert best["speedup over DP"] == f"{0.0026671689999915316 / 0.0015200385000042616:.2f}x"


def test_a_missing_db_exits_2_and_writes_nothing(tmp_path):
    code, stdout, stderr = report_cli("report", "-d", str(tmp_path / "missing.db"), "-o", str(tmp_path / "out"))
    assert code == 2
    assert stderr.strip() == (f"codesign: error: {tmp_path / 'missing.db'}: no results DB here; run codesign "
                              "first (or pass -d PATH)")
    assert stdout == "" and list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_a_db_exits_2(tmp_path):
    (tmp_path / "notes.db").write_text("not sqlite")
    code, stdout, stderr = report_cli("report", "-d", str(tmp_path / "notes.db"), "-o", str(tmp_path / "out"))
    assert code == 2 and stdout == ""
    assert stderr.strip() == (f"codesign: error: {tmp_path / 'notes.db'}: not a usable SQLite results DB "
                              "(file is not a database); it was left untouched: move it aside or pass another --db")
    assert not (tmp_path / "out").exists()


def test_python_m_codesign_report_with_defaults_never_imports_jax(tmp_path):
    """The command as users type it (`python -m codesign report`: results.db into report/), in a fresh
    process whose modules are checked at exit."""
    Store(tmp_path / "results.db").close()
    code = ("import runpy, sys\n"
            "try:\n    runpy.run_module('codesign', run_name='__main__')\n"
            "finally:\n    print('jax' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, "report"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "False\n"
    assert (tmp_path / "report" / "report.html").exists() and (tmp_path / "report" / "summary.csv").exists()

