"""`codesign report`: the DB's attempts -> report.html (self-contained), one PNG per figure, CSVs.

Every section is a title, a note on how to read it, its figures and tables, or the reason it is
empty. The HTML comes from one jinja2 template with autoescaping (a description is always text);
figures are inlined as base64 PNGs, so the page opens offline and fetches nothing.
"""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd
from matplotlib.figure import Figure

from codesign.csv_cells import safe_frame
from codesign.errors import StoreError
from codesign.outcome import SIMULATED
from codesign.report import figures, fmt, page, tables
from codesign.report.frame import GROUP, attempts_frame, plans
from codesign.report.page import Column, Image, Section
from codesign.store.database import Store

# PNG names; those of an earlier report in the same folder are removed first
FIGURES = ("throughput", "speedup", "predicted", "prediction_order", "energy_frontier", "energy", "compile_vs_step",
           "failures", "simulated", "auto_search", "codesign", "codesign_energy", "codesign_measured")
KINDS = {False: "measured", True: SIMULATED}  # the `simulated` flag, in words


PLAN_COLUMNS: list[Column] = [
    ("rank", "rank", fmt.integer), ("plan", "plan", fmt.text), ("global batch", "global_batch", fmt.integer),
    ("precision", "precision", fmt.text), ("status", "status", fmt.text), ("attempts", "attempts", fmt.integer),
    ("samples/s", "throughput", fmt.number), ("step time (ms)", "avg", page.ms), ("p90 (ms)", "p90", page.ms),
    ("memory (MiB)", "max_memory", page.mib), ("compile (s)", "compile_time", fmt.number),
    ("J/sample", "energy_per_sample", fmt.number)]
SIMULATED_COLUMNS: list[Column] = [
    ("rank", "rank", fmt.integer), ("plan", "plan", fmt.text), ("global batch", "global_batch", fmt.integer),
    ("status", "status", fmt.text), ("predicted samples/s", "predicted_throughput", fmt.number),
    ("predicted step (ms)", "predicted_time", page.ms), ("predicted memory (MiB)", "predicted_memory", page.mib)]
BEST_COLUMNS: list[Column] = [
    ("model", "model", fmt.text), ("cluster", "cluster", fmt.text), ("best plan", "plan", fmt.text),
    ("global batch", "global_batch", fmt.integer), ("samples/s", "throughput", fmt.number),
    ("step time (ms)", "avg", page.ms), ("memory (MiB)", "max_memory", page.mib),
    ("speedup over DP", "speedup", fmt.ratio), ("data-parallel plan", "dp_plan", fmt.text)]
SPEEDUP_COLUMNS: list[Column] = [
    ("model", "model", fmt.text), ("cluster", "cluster", fmt.text), ("global batch", "global_batch", fmt.integer),
    ("precision", "precision", fmt.text), ("best plan", "plan", fmt.text), ("samples/s", "score", fmt.number),
    ("data-parallel plan", "dp_plan", fmt.text), ("DP samples/s", "dp_score", fmt.number),
    ("speedup", "speedup", fmt.ratio)]

ERROR_COLUMNS: list[Column] = [
    ("quantity", "quantity", fmt.text), ("platform", "platform", fmt.text), ("attempts", "attempts", fmt.integer),
    ("median |error|", "median", fmt.percent), ("p90 |error|", "p90", fmt.percent)]
THIRD_COLUMNS: list[Column] = [
    ("platform", "platform", fmt.text), ("part of the run", "part", fmt.text), ("attempts", "range", fmt.text),
    ("median |error|", "median", fmt.percent), ("vs first third", "vs_first", fmt.ratio)]
KIND_COLUMNS: list[Column] = [
    ("platform", "platform", fmt.text), ("plan kind", "plan_kind", fmt.text), ("attempts", "attempts", fmt.integer),
    ("median error", "median", fmt.percent), ("median |error|", "median_abs", fmt.percent)]
CALIBRATION_COLUMNS: list[Column] = [
    ("platform", "platform", fmt.text), ("calibration", "calibration", fmt.text),
    ("first attempt", "first", fmt.integer), ("attempts", "attempts", fmt.integer),
    ("median |error|", "median", fmt.percent)]
RANK_COLUMNS: list[Column] = [
    ("model", "model", fmt.text), ("cluster", "cluster", fmt.text), ("plans", "plans", fmt.integer),
    ("Spearman", "spearman", fmt.number), ("predicted fastest / fastest, measured time", "chosen_vs_best", fmt.ratio)]
REPRICED_COLUMNS: list[Column] = [
    ("platform", "platform", fmt.text), ("re-priced by calibration", "calibration", fmt.text),
    ("in-sample", "in_sample", fmt.text), ("attempts", "attempts", fmt.integer),
    ("median |error|, re-priced", "repriced", fmt.percent),
    ("median |error| before they ran", "before", fmt.percent)]
MEMORY_COLUMNS: list[Column] = [
    ("platform", "platform", fmt.text), ("attempts", "attempts", fmt.integer),
    ("predicted below measured", "below", fmt.percent),
    (f"below by > {tables.UNDER:.0%}", "far_below", fmt.percent), ("median over-prediction", "median", fmt.percent)]
FRONTIER_COLUMNS: list[Column] = [
    ("model", "model", fmt.text), ("cluster", "cluster", fmt.text), ("global batch", "global_batch", fmt.integer),
    ("plan", "plan", fmt.text), ("status", "status", fmt.text), ("predicted time (ms)", "predicted_time", page.ms),
    ("predicted J/iter", "predicted_energy", fmt.number), ("measured time (ms)", "median", page.ms),
    ("measured J/iter", "energy_per_iter", fmt.number),
    ("predicted samples/J", "predicted_samples_per_joule", fmt.number),
    ("measured samples/J", "samples_per_joule", fmt.number)]
ENERGY_COLUMNS: list[Column] = [
    ("model", "model", fmt.text), ("cluster", "cluster", fmt.text), ("plan", "plan", fmt.text),
    ("J/step", "energy_per_iter", fmt.number), ("J/sample", "energy_per_sample", fmt.number),
    ("samples/s", "throughput", fmt.number), ("W/device", "avg_power", fmt.number),
    ("source", "energy_source", fmt.text)]

CODESIGN_COLUMNS: list[Column] = [
    ("cluster", "cluster", fmt.text), ("micro-batches", "micro_batches", fmt.integer), ("rank", "rank", fmt.integer),
    ("model", "model", fmt.text), ("parameters", "params", fmt.number),
    ("predicted samples/s", "predicted_samples_per_s", fmt.number),
    ("predicted GiB/device", "predicted_memory_gib", fmt.number), ("plan", "plan", fmt.text),
    ("measured samples/s", "measured_samples_per_s", fmt.number)]
AGREEMENT_COLUMNS: list[Column] = [
    ("cluster", "cluster", fmt.text), ("micro-batches", "micro_batches", fmt.integer), ("runs", "runs", fmt.integer),
    ("Spearman", "spearman", fmt.number), ("predicted best, measured samples/s", "predicted_best_measured", fmt.number),
    ("measured best samples/s", "measured_best", fmt.number), ("predicted best / measured best", "best_ratio",
                                                                fmt.percent)]
ENERGY_COLUMN = "samples_per_joule"  # the ranking's predicted samples per joule, in CSVs that price energy
CODESIGN_ENERGY_COLUMNS: list[Column] = [
    ("cluster", "cluster", fmt.text), ("micro-batches", "micro_batches", fmt.integer), ("model", "model", fmt.text),
    ("parameters", "params", fmt.number), ("plan", "plan", fmt.text),
    ("predicted samples/s", "predicted_samples_per_s", fmt.number),
    ("predicted samples/J", ENERGY_COLUMN, fmt.number)]
CODESIGN_NEEDS = sorted({c for _, c, _ in CODESIGN_COLUMNS} | {"pareto", "predicted_samples_per_s"})

SUMMARY_CSV = {"kind": "kind", "model": "model", "cluster": "cluster", "plan": "plan",
               "global_batch": "global_batch", "precision": "precision", "throughput": "score",
               "step_time": "avg", "median": "median", "p90": "p90", "max_memory": "max_memory",
               "predicted_time": "predicted_time", "predicted_memory": "predicted_memory",
               "dp_plan": "dp_plan", "dp_throughput": "dp_score", "speedup_over_dp": "speedup",
               "failed_attempts": "failures", "job_key": "job_key"}
INTEGERS = ["rank", "global_batch", "max_memory", "predicted_memory", "attempts"]  # whole numbers, NaN aside
PLANS_CSV = ["kind", "model", "cluster", "rank", "plan", "status", "attempts", "global_batch", "precision",
             "throughput", "avg", "median", "p90", "max_memory", "compile_time", "predicted_time",
             "predicted_memory", "predicted_throughput", "energy_per_iter", "energy_per_sample", "error",
             "job_key"]


@dataclass(frozen=True)
class Written:
    html: Path
    figures: list[Path]
    attempts: int


class Report:
    """Builds the sections of one DB's report, writing each figure's PNG into `out` as it goes."""

    def __init__(self, rows: list[dict[str, Any]], out: Path, ranking: pd.DataFrame | None = None,
                 ranking_path: str = ""):
        self.codesign, self.codesign_path = ranking, ranking_path  # `codesign search --rank`'s CSV, if any
        self.frame = attempts_frame(rows)
        self.plans = plans(self.frame)
        self.measured = self.plans[~self.plans["simulated"]]
        self.best = tables.best_plans(self.plans)
        self.out = out
        self.images: list[Path] = []

    def sections(self) -> list[Section]:
        return [self.overview(), self.best_section(), self.ranking(), self.throughput_section(),
                self.speedup_section(), self.predictions_section(), self.energy_section(),
                self.compile_section(), self.failures_section(), self.simulated_section(), self.auto_section(),
                self.codesign_section()]

    def image(self, name: str, figure: Figure, alt: str) -> Image:
        assert name in FIGURES, name
        data = figures.png(figure)
        path = self.out / f"{name}.png"
        path.write_bytes(data)
        self.images.append(path)
        return Image(path.name, "data:image/png;base64," + base64.b64encode(data).decode(), alt)

    def no_success(self) -> str:
        """Why nothing measured can be ranked."""
        if self.measured.empty:
            return "No measured attempt in this DB (nothing ran on real or virtual devices)."
        return (f"No measured plan succeeded ({len(self.measured)} plans attempted); "
                "see Failures for why.")

    def overview(self) -> Section:
        frame = self.frame
        kinds = frame.assign(kind=frame["simulated"].map(KINDS))
        grouped = kinds.groupby(["kind", "status"])
        counts = pd.DataFrame({"attempts": grouped.size(), "jobs": grouped["job_key"].nunique()}).reset_index()
        note = (f"{len(frame)} attempts of {frame['job_key'].nunique()} jobs: "
                f"{frame['model'].nunique()} models, {frame['cluster'].nunique()} clusters.")
        if frame.empty:
            return Section("overview", "Overview", note, "The DB holds no attempt yet.")
        return Section("overview", "Overview", note,
                       tables=[page.table(counts, [("kind", "kind", fmt.text), ("status", "status", fmt.text),
                                               ("attempts", "attempts", fmt.integer),
                                               ("jobs", "jobs", fmt.integer)])])

    def best_section(self) -> Section:
        best = self.best[~self.best["simulated"]]
        note = ("Per model and cluster, the measured plan with the highest throughput (samples/s = global "
                "batch / mean step time after warm-up), and its speedup over the fastest manual data-parallel "
                "plan (pp = 1, op = 1) of the same global batch and precision; - where there is none.")
        return Section("best", "Best plan per model and cluster", note, "" if len(best) else self.no_success(),
                       tables=[page.table(best, BEST_COLUMNS)] if len(best) else [])

    def ranking(self) -> Section:
        note = ("Every plan (a job: parallel spec, micro-batches, training setup) of each model and cluster, "
                "ranked by throughput; plans that did not succeed follow, with their status. A plan with "
                "several attempts (retries) shows its latest.")
        shown = page.group_tables(self.measured, PLAN_COLUMNS)
        empty = "" if shown else "No measured attempt in this DB."
        return Section("ranking", "Every plan, ranked", note, empty, tables=shown)

    def throughput_section(self) -> Section:
        ranked = tables.ranked(self.measured)
        note = "Measured throughput of each plan, one panel per cluster, best first; colours tell the models apart."
        if ranked.empty:
            return Section("throughput", "Throughput by plan", note, self.no_success())
        return Section("throughput", "Throughput by plan", note,
                       images=[self.image("throughput", figures.throughput(ranked, "throughput"),
                                          "throughput by plan for each cluster")])

    def speedup_section(self) -> Section:
        speed = tables.dp_speedups(self.measured)
        note = ("Best plan against the fastest manual data-parallel plan (pp = 1, op = 1, every device a "
                "replica) of the same model, cluster, global batch and precision: the ratio of their step "
                "times (DAPPLE's headline figure).")
        title = "Speedup over data parallel"
        if speed.empty:
            return Section("speedup", title, note, self.no_success())
        with_dp = speed[speed["speedup"].notna()]
        table = page.table(speed, SPEEDUP_COLUMNS)
        if with_dp.empty:
            return Section("speedup", title, note, "No group has a succeeded manual data-parallel plan "
                           "(pp = 1, op = 1) to compare with: add one to the config.", tables=[table])
        return Section("speedup", title, note, tables=[table],
                       images=[self.image("speedup", figures.speedups(with_dp), "speedup over data parallel")])

    def predictions_section(self) -> Section:
        errors = tables.prediction_errors(self.frame)
        note = ("What was predicted before a job ran against what it measured: time per step against the "
                "median step, peak memory per device against the measured peak. Error = (predicted - "
                "measured) / measured (> 0: priced slower or bigger than measured). Whether the cost model "
                "learns from the runs: the time error in the order the attempts ran, by plan kind (the axes "
                "of degree > 1, and micro-batches) and by the calibration that priced it; per model and "
                f"cluster with at least {tables.MIN_RANKED} measured plans, whether it ranks them in the "
                "measured order; and how often the memory prediction, which must bound the peak from above "
                "(an under-prediction is an OOM), fell below the measured peak. Each is what was predicted "
                "before the job ran; attempts priced again since (`codesign reprice`) are shown apart, last: "
                "hindsight, in-sample where the calibration that priced them again was fitted to them.")
        title = "Predictions"
        if errors.empty:
            return Section("predictions", title, note, "No succeeded attempt recorded a prediction "
                           "(predicted_time, predicted_memory): the cost model fills them.")
        missing = [q for q in tables.PREDICTIONS if q not in set(errors["quantity"])]
        if missing:
            note += f" No succeeded attempt recorded a predicted {' or '.join(missing)}."
        images = [self.image("predicted", figures.predictions(errors), "predicted against measured, with y = x")]
        shown = [page.table(tables.error_stats(errors), ERROR_COLUMNS)]
        times = tables.run_order(errors)
        if len(times):
            images.append(self.image("prediction_order", figures.prediction_order(times),
                                     "|time error| of each attempt in the order they ran"))
            shown += self.learning_tables(times)
        memory = tables.memory_bound(errors)
        if len(memory):
            shown.append(page.table(memory, MEMORY_COLUMNS, "Memory: is the prediction an upper bound?"))
        repriced = tables.repriced_errors(self.frame)
        if len(repriced):
            shown.append(page.table(repriced, REPRICED_COLUMNS, "Time error re-priced since they ran: hindsight, "
                                    "not forecasts"))
        return Section("predictions", title, note, images=images, tables=shown)

    def learning_tables(self, times: pd.DataFrame) -> list[page.Table]:
        """Time error by third of the run, by plan kind, by calibration (once one was learned) and
        the rank correlation per group."""
        shown = [page.table(tables.error_by_third(times), THIRD_COLUMNS, "Time error in the order the attempts ran"),
                 page.table(tables.error_by_kind(times), KIND_COLUMNS, "Time error by plan kind")]
        calibrations = tables.error_by_calibration(times)
        if calibrations["calibration"].ne(tables.BASE_CALIBRATION).any():
            shown.append(page.table(calibrations, CALIBRATION_COLUMNS, "Time error by calibration"))
        agree = tables.rank_agreement(times)
        if len(agree):
            shown.append(page.table(agree, RANK_COLUMNS, "Predicted against measured order of the plans"))
        return shown

    def energy_section(self) -> Section:
        points = tables.energy_points(self.plans)
        measured = tables.energy(self.plans)
        note = ("Time and energy per iteration of every plan as predicted (the cost model prices every device "
                "of the cluster, busy and idle), the predicted frontier (the plans no other is predicted to "
                "beat on both time and energy) and the measured points, each joined to its prediction; then "
                "the joules the job's devices used per measured step, divided by the global batch.")
        title = "Energy"
        if points.empty:
            return Section("energy", title, note, "No attempt recorded a predicted or measured energy: the cost "
                           "model predicts it, and measuring it needs an NVIDIA or AMD GPU, or a CPU with "
                           "RAPL, and the `energy` extra (pip install 'codesign[energy]').")
        images, shown = [], []
        frontier = tables.energy_frontier(points)
        if len(frontier):
            images.append(self.image("energy_frontier", figures.energy_frontier(points),
                                     "predicted time against energy per iteration, frontier and measured points"))
            shown.append(page.table(frontier, FRONTIER_COLUMNS, "The predicted time-energy frontier"))
        else:
            note += " No plan recorded a predicted energy, so there is no predicted frontier."
        if len(measured):
            images.append(self.image("energy", figures.energy(measured), "energy per sample by plan"))
            shown.append(page.table(measured, ENERGY_COLUMNS, "Measured energy, cheapest sample first"))
        return Section("energy", title, note, images=images, tables=shown)

    def compile_section(self) -> Section:
        points, stats = tables.compile_vs_step(self.frame)
        note = ("Compile time (lower, compile, memory analysis; cached across retries) against the mean "
                "step time; 'steps per compile' is how many steps one compile costs.")
        if points.empty:
            return Section("compile", "Compile time against step time", note,
                           "No succeeded measured attempt recorded a compile time.")
        return Section("compile", "Compile time against step time", note,
                       images=[self.image("compile_vs_step", figures.compile_vs_step(points),
                                          "compile time against step time")],
                       tables=[page.table(stats, [("cluster", "cluster", fmt.text),
                                              ("attempts", "attempts", fmt.integer),
                                              ("median compile (s)", "compile_time", fmt.number),
                                              ("median step (ms)", "step_time", page.ms),
                                              ("steps per compile", "steps_per_compile", fmt.number)])])

    def failures_section(self) -> Section:
        table = tables.failures(self.frame)
        note = ("Attempts that did not succeed, by status and reason (the last line of the recorded "
                "error): failed, timeout, oom, invalid, interrupted.")
        if table.empty:
            return Section("failures", "Failures", note, f"No attempt failed ({len(self.frame)} recorded).")
        return Section("failures", "Failures", note,
                       images=[self.image("failures", figures.failures(tables.failure_counts(self.frame)),
                                          "failed attempts per cluster and status")],
                       tables=[page.table(table, [("status", "status", fmt.text), ("reason", "reason", fmt.text),
                                              ("attempts", "attempts", fmt.integer),
                                              ("jobs", "jobs", fmt.integer),
                                              ("clusters", "clusters", fmt.text)])])

    def simulated_section(self) -> Section:
        simulated = self.plans[self.plans["simulated"]]
        note = ("Clusters priced by the cost model without running (status simulated, platform sim), "
                "ranked by predicted throughput among themselves only, never with measured plans.")
        title = "Simulated clusters"
        if simulated.empty:
            return Section("simulated", title, note, "No simulated rows: a cluster with platform = \"sim\" "
                           "records the cost model's predictions without running.")
        shown = page.group_tables(simulated, SIMULATED_COLUMNS)
        ranked = tables.ranked(simulated)
        images = [self.image("simulated", figures.throughput(ranked, "predicted throughput"),
                             "predicted throughput by plan for each simulated cluster")] if len(ranked) else []
        return Section("simulated", title, note, images=images, tables=shown)

    def auto_section(self) -> Section:
        table = tables.auto_vs_manual(self.plans)
        note = ("Where Auto search ran and succeeded: the plan it chose against the best manual plan of the "
                "same model, cluster, global batch and precision (ratio > 1: Auto search was faster).")
        title = "Auto search against the best manual plan"
        if table.empty:
            return Section("auto", title, note, self.no_auto())
        return Section("auto", title, note,
                       images=[self.image("auto_search", figures.auto_vs_manual(table),
                                          "Auto search against the best manual plan")],
                       tables=[page.table(table, [("model", "model", fmt.text), ("cluster", "cluster", fmt.text),
                                              ("global batch", "global_batch", fmt.integer),
                                              ("Auto search plan", "plan_auto", fmt.text),
                                              ("Auto search samples/s", "score_auto", fmt.number),
                                              ("best manual plan", "plan_manual", fmt.text),
                                              ("manual samples/s", "score_manual", fmt.number),
                                              ("auto / manual", "ratio", fmt.ratio)])])

    def codesign_section(self) -> Section:
        note = ("`codesign search --rank`: every candidate model of equal capacity (parameters within the "
                "tolerance of the base) ranked by its best plan's predicted samples/s on each cluster. The "
                "Pareto frontier holds the candidates no other beats on both parameters and samples/s; with "
                "--run-top, the winners' measured samples/s against the prediction (Spearman's rho, and the "
                f"predicted best's measured samples/s over the measured best). From {self.codesign_path or '-'}.")
        title = "Co-design"
        if self.codesign is None:
            return Section("codesign", title, note, "No co-design ranking: run `codesign search --rank -c CONFIG` "
                           "(it writes codesign_rank.csv) and pass its CSV with --codesign (default: "
                           "codesign_rank.csv beside the DB).")
        frontier = tables.codesign_frontier(self.codesign)
        if frontier.empty:
            return Section("codesign", title, note, "No candidate of the ranking fits any plan; the CSV's "
                           "`reason` column says why.")
        images = [self.image("codesign", figures.codesign_frontier(self.codesign),
                             "parameters against predicted samples/s, Pareto frontier in colour")]
        shown = [page.table(frontier, CODESIGN_COLUMNS)]
        agree = tables.codesign_agreement(self.codesign)
        if agree.empty:
            note += " No winner was measured (run with --run-top N)."
        else:
            images.append(self.image("codesign_measured", figures.codesign_measured(self.codesign),
                                     "predicted against measured samples/s of the winners run"))
            shown.insert(0, page.table(agree, AGREEMENT_COLUMNS))
        energy = tables.codesign_energy_frontier(self.codesign) if ENERGY_COLUMN in self.codesign else None
        if energy is not None and len(energy):
            note += (" Per cluster, the time-energy frontier: the candidates no other is predicted to beat on "
                     "both samples/s and samples per joule.")
            images.append(self.image("codesign_energy", figures.codesign_energy(self.codesign, energy),
                                     "predicted samples per joule against samples/s, time-energy frontier in colour"))
            shown.append(page.table(energy, CODESIGN_ENERGY_COLUMNS, "Time-energy frontier per cluster"))
        return Section("codesign", title, note, images=images, tables=shown)

    def no_auto(self) -> str:
        auto = self.frame[self.frame["auto"] & ~self.frame["simulated"]]
        if auto.empty:
            return "No Auto search job was measured in this DB."
        counts = ", ".join(f"{n} {s}" for s, n in auto["status"].value_counts().items())
        reasons = "; ".join(sorted(set(auto["reason"]) - {""})[:3])
        return f"No Auto search attempt succeeded ({counts})" + (f": {reasons}" if reasons else ".")

    def summary_csv(self) -> pd.DataFrame:
        """summary.csv: the best plan per (model, cluster), raw DB units, measured and simulated apart."""
        table = tables.summary_table(self.frame, self.plans)
        best = self.best.drop(columns=["plan", "score", "speedup"])
        out = table.merge(best, on=["simulated", *GROUP], how="left")
        out["kind"] = out["simulated"].map(KINDS)
        return _integers(out.reindex(columns=list(SUMMARY_CSV.values())).set_axis(list(SUMMARY_CSV), axis=1))

    def plans_csv(self) -> pd.DataFrame:
        out = self.plans.assign(kind=self.plans["simulated"].map(KINDS))
        return _integers(out[PLANS_CSV])


def _integers(frame: pd.DataFrame) -> pd.DataFrame:
    """Whole-number columns as integers in the CSVs (a NaN made them floats)."""
    present = [c for c in INTEGERS if c in frame.columns]
    return frame.astype({c: "Int64" for c in present})


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("codesign.report", "templates"),
                              autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                              lstrip_blocks=True)


def read_ranking(path: str | Path | None, db: str | Path) -> tuple[pd.DataFrame | None, str]:
    """The co-design CSV: `path`, else codesign_rank.csv beside the DB when there; (None, "") without."""
    found = Path(path) if path else Path(db).resolve().parent / "codesign_rank.csv"
    if not found.exists():
        if path:
            raise StoreError(f"{path}: no co-design CSV here; `codesign search --rank --csv {path}` writes it")
        return None, ""
    try:
        ranking = pd.read_csv(found)
    except (ValueError, pd.errors.ParserError) as err:
        raise StoreError(f"{found}: not a co-design CSV: {err}") from None
    missing = [c for c in CODESIGN_NEEDS if c not in ranking.columns]
    if missing:
        raise StoreError(f"{found}: not a co-design CSV of `codesign search --rank`: no column {missing[0]!r}")
    return ranking, str(found)


def write_report(db: str | Path, out: str | Path, codesign: str | Path | None = None) -> Written:
    """Read every attempt of `db` (and the co-design CSV), write report.html, the figures' PNGs,
    summary.csv and plans.csv."""
    if not Path(db).exists():
        raise StoreError(f"{db}: no results DB here; run codesign first (or pass -d PATH)")
    store = Store(db, read_only=True)
    try:
        rows = store.attempts_repriced()
    finally:
        store.close()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FIGURES:
        (out / f"{name}.png").unlink(missing_ok=True)
    report = Report(rows, out, *read_ranking(codesign, db))
    sections = report.sections()
    html = _environment().get_template("report.html.j2").render(
        db=str(db), sections=sections,
        generated=datetime.datetime.now().isoformat(timespec="seconds"))
    (out / "report.html").write_text(html, encoding="utf-8")
    safe_frame(report.summary_csv()).to_csv(out / "summary.csv", index=False)
    safe_frame(report.plans_csv()).to_csv(out / "plans.csv", index=False)
    return Written(out / "report.html", report.images, len(report.frame))
