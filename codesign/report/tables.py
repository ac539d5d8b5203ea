"""The questions users ask of a sweep, answered as pandas tables (raw DB units: seconds, bytes)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from codesign.outcome import SIMULATED, SUCCEEDED
from codesign.report import fmt
from codesign.report.frame import FAILURES, GROUP, SETUP, attempts_frame, plans

KEYS = ["simulated", *GROUP, *SETUP]
# predicted column against the measured one it predicts (time: the median step, as the cost model's bench)
PREDICTIONS = {"time": ("predicted_time", "median"), "memory": ("predicted_memory", "max_memory")}
THIRDS = ("first third", "second third", "last third")  # of the attempts, in the order they ran
MIN_RANKED = 3  # measured plans a group needs for a rank correlation to mean anything
UNDER = 0.05  # a memory prediction this far below the measured peak risks an OOM (issue 49's bound)
BASE_CALIBRATION = "none"  # an attempt priced before the cost model learned from runs


def ranked(plans_: pd.DataFrame) -> pd.DataFrame:
    """Plans with a score (measured throughput, or predicted for simulated rows), best first."""
    return plans_[plans_["score"].notna()].sort_values("score", ascending=False, kind="stable")


def dp_speedups(plans_: pd.DataFrame) -> pd.DataFrame:
    """Per group and setup (global batch, precision): the best plan against the fastest manual
    data-parallel plan (pp = 1, op = 1: every device a replica). With the same global batch,
    the throughput ratio is the step-time ratio."""
    scored = ranked(plans_)
    best = scored.drop_duplicates(KEYS)[[*KEYS, "plan", "score"]]
    dp = scored[scored["pp"].eq(1) & scored["op"].eq(1) & ~scored["auto"]].drop_duplicates(KEYS)
    out = best.merge(dp[[*KEYS, "plan", "score"]].rename(columns={"plan": "dp_plan", "score": "dp_score"}),
                     on=KEYS, how="left")
    out["speedup"] = out["score"] / out["dp_score"]
    return out


def best_plans(plans_: pd.DataFrame) -> pd.DataFrame:
    """Per (model, cluster), measured and simulated apart: the top plan and its speedup over DP."""
    top = plans_[plans_["rank"].eq(1)]
    speed = dp_speedups(plans_)[[*KEYS, "dp_plan", "dp_score", "speedup"]]
    return top.merge(speed, on=KEYS, how="left")


def prediction_errors(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per measured, succeeded attempt and predicted quantity: predicted, measured, error."""
    ok = frame[~frame["simulated"] & frame["status"].eq(SUCCEEDED)]
    parts = []
    for quantity, (predicted, measured) in PREDICTIONS.items():
        rows = ok[ok[predicted].notna() & ok[measured].gt(0)]
        parts.append(pd.DataFrame({"quantity": quantity, "id": rows["id"], "platform": rows["platform"],
                                   "model": rows["model"], "cluster": rows["cluster"], "plan": rows["plan"],
                                   "job_key": rows["job_key"], "plan_kind": rows["plan_kind"],
                                   "configs": rows["all_configs"],
                                   "predicted": rows[predicted], "measured": rows[measured]}))
    out = pd.concat(parts, ignore_index=True).sort_values(["quantity", "id"], kind="stable", ignore_index=True)
    out["error"] = (out["predicted"] - out["measured"]) / out["measured"]
    out["calibration"] = out.pop("configs").map(calibration_version)
    return out


def calibration_version(configs: Any) -> str:
    """The version of the learned calibration that priced an attempt (all_configs' prediction)."""
    try:
        version = json.loads(configs)["prediction"].get("calibration")
    except (TypeError, ValueError, KeyError, AttributeError):
        version = None
    return BASE_CALIBRATION if version is None else str(version)


def repriced_errors(frame: pd.DataFrame) -> pd.DataFrame:
    """Measured, succeeded attempts priced again since they ran (their latest repricing), per
    platform, calibration and whether it was fitted to them: median |time error| as re-priced and
    as predicted before they ran. Hindsight: kept apart from the forecasts' tables."""
    ok = frame[~frame["simulated"] & frame["status"].eq(SUCCEEDED) & frame["repriced_time"].notna()
               & frame["median"].gt(0)]
    out = pd.DataFrame({"platform": ok["platform"],
                        "calibration": ok["repriced_calibration"].map(
                            lambda v: BASE_CALIBRATION if pd.isna(v) else f"{v:.0f}"),
                        "in_sample": ok["repriced_in_sample"].map({1: "yes", 0: "no"}),
                        "repriced": (ok["repriced_time"] / ok["median"] - 1).abs(),
                        "before": (ok["predicted_time"] / ok["median"] - 1).abs()})
    grouped = out.groupby(["platform", "calibration", "in_sample"], dropna=False)
    return pd.DataFrame({"attempts": grouped.size(), "repriced": grouped["repriced"].median(),
                         "before": grouped["before"].median()}).reset_index()


def run_order(errors: pd.DataFrame) -> pd.DataFrame:
    """Time errors in the order the attempts ran (their ids), numbered from 0 per platform (a DB
    may hold two machines' runs), with the third of the platform's attempts each falls in."""
    times = errors[errors["quantity"].eq("time")].sort_values("id", kind="stable").copy()
    by_platform = times.groupby("platform", dropna=False)
    times["order"] = by_platform.cumcount()
    times["third"] = times["order"] * len(THIRDS) // by_platform["id"].transform("size")
    times["abs_error"] = times["error"].abs()
    return times


def error_by_third(times: pd.DataFrame) -> pd.DataFrame:
    """Median |time error| of the first, second and last third of each platform's attempts: whether
    the cost model learned from the runs before."""
    grouped = times.groupby(["platform", "third"], dropna=False)
    out = pd.DataFrame({"attempts": grouped.size(), "first": grouped["order"].min() + 1,
                        "last": grouped["order"].max() + 1, "median": grouped["abs_error"].median()}).reset_index()
    out["part"] = out["third"].map(dict(enumerate(THIRDS)))
    out["range"] = [f"{first}-{last}" for first, last in zip(out["first"], out["last"])]
    first = out[out["third"].eq(0)].set_index("platform")["median"]
    out["vs_first"] = out["median"] / out["platform"].map(first)
    return out


def error_by_kind(times: pd.DataFrame) -> pd.DataFrame:
    """Per plan kind: median signed time error (the side the cost model errs on) and median |error|."""
    grouped = times.groupby(["platform", "plan_kind"], dropna=False)
    out = pd.DataFrame({"attempts": grouped.size(), "median": grouped["error"].median(),
                        "median_abs": grouped["abs_error"].median()}).reset_index()
    return out.sort_values(["platform", "attempts", "plan_kind"], ascending=[True, False, True], kind="stable")


def error_by_calibration(times: pd.DataFrame) -> pd.DataFrame:
    """Per calibration version, in the order they first priced an attempt: attempts and median |error|."""
    grouped = times.groupby(["platform", "calibration"], dropna=False, sort=False)
    out = pd.DataFrame({"attempts": grouped.size(), "first": grouped["order"].min() + 1,
                        "median": grouped["abs_error"].median()}).reset_index()
    return out.sort_values(["platform", "first"], kind="stable")


def rank_agreement(times: pd.DataFrame) -> pd.DataFrame:
    """Per (model, cluster) with at least MIN_RANKED measured plans (a plan's latest attempt):
    Spearman's rho of predicted and measured time, and the measured time of the plan predicted
    fastest over the fastest measured (1 = the prediction chose the best). Spearman's rho is the
    correlation of the ranks (ties share their mean rank), computed here: importing scipy.stats
    costs a report more than the rest of this section."""
    latest = times.drop_duplicates("job_key", keep="last")
    rows = []
    for (model, cluster), group in latest.groupby(GROUP, sort=True):
        if len(group) >= MIN_RANKED:
            chosen = group.loc[group["predicted"].idxmin(), "measured"]
            rows.append({"model": model, "cluster": cluster, "plans": len(group),
                         "spearman": group["predicted"].rank().corr(group["measured"].rank()),
                         "chosen_vs_best": chosen / group["measured"].min()})
    return pd.DataFrame(rows, columns=["model", "cluster", "plans", "spearman", "chosen_vs_best"])


def memory_bound(errors: pd.DataFrame) -> pd.DataFrame:
    """Per platform: the share of predicted peaks below the measured one (an OOM risk), and below by
    more than UNDER, and the median over-prediction ((predicted - measured) / measured)."""
    memory = errors[errors["quantity"].eq("memory")]
    grouped = memory.groupby("platform", dropna=False)["error"]
    return pd.DataFrame({"attempts": grouped.size(), "below": grouped.agg(lambda e: (e < 0).mean()),
                         "far_below": grouped.agg(lambda e: (e < -UNDER).mean()),
                         "median": grouped.median()}).reset_index()


def error_stats(errors: pd.DataFrame) -> pd.DataFrame:
    """Median and p90 of |predicted - measured| / measured, per quantity and platform."""
    absolute = errors.assign(abs_error=errors["error"].abs())
    grouped = absolute.groupby(["quantity", "platform"], dropna=False)["abs_error"]
    return pd.DataFrame({"attempts": grouped.size(), "median": grouped.median(),
                         "p90": grouped.quantile(0.9)}).reset_index()


def energy(plans_: pd.DataFrame) -> pd.DataFrame:
    """Measured plans that recorded joules per step, cheapest sample first."""
    ok = plans_[~plans_["simulated"] & plans_["status"].eq(SUCCEEDED) & plans_["energy_per_iter"].notna()]
    return ok.sort_values("energy_per_sample", kind="stable")


def energy_points(plans_: pd.DataFrame) -> pd.DataFrame:
    """Plans with a predicted or measured energy per iteration (succeeded measured plans, simulated
    ones), each flagged when on its group's predicted time-energy frontier: no other plan of the same
    model, cluster and setup is predicted faster and cheaper (codesign.planner.objective.pareto)."""
    from codesign.planner.objective import pareto

    ran = ~plans_["simulated"] & plans_["status"].eq(SUCCEEDED)
    priced = plans_["simulated"] & plans_["status"].eq(SIMULATED)
    predicted = plans_["predicted_time"].notna() & plans_["predicted_energy"].notna()
    measured = plans_["median"].notna() & plans_["energy_per_iter"].notna()
    points = plans_[(ran | priced) & (predicted | measured)].copy()
    points["predicted_samples_per_joule"] = points["global_batch"] / points["predicted_energy"]
    points["samples_per_joule"] = points["global_batch"] / points["energy_per_iter"]
    points["frontier"] = False
    both = points[points["predicted_time"].notna() & points["predicted_energy"].notna()]
    for _, group in both.groupby([*GROUP, *SETUP], dropna=False):
        on = pareto(-group["predicted_time"].to_numpy(float), -group["predicted_energy"].to_numpy(float))
        points.loc[group.index[on], "frontier"] = True
    return points


def energy_frontier(points: pd.DataFrame) -> pd.DataFrame:
    """The predicted frontier's plans, per group fastest first."""
    on = points[points["frontier"]]
    return on.sort_values([*GROUP, *SETUP, "predicted_time"], na_position="last", kind="stable")


def compile_vs_step(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measured, succeeded attempts with both times; per cluster, how many steps one compile costs."""
    ok = frame[~frame["simulated"] & frame["status"].eq(SUCCEEDED)
               & frame["compile_time"].notna() & frame["avg"].gt(0)]
    grouped = ok.groupby("cluster")
    stats = pd.DataFrame({"attempts": grouped.size(), "compile_time": grouped["compile_time"].median(),
                          "step_time": grouped["avg"].median()}).reset_index()
    stats["steps_per_compile"] = stats["compile_time"] / stats["step_time"]
    return ok, stats


def failures(frame: pd.DataFrame) -> pd.DataFrame:
    """Failed attempts by status and reason: how many attempts, how many jobs, where."""
    failed = frame[frame["status"].isin(FAILURES)]
    grouped = failed.groupby(["status", "reason"], dropna=False)
    out = pd.DataFrame({"attempts": grouped.size(), "jobs": grouped["job_key"].nunique(),
                        "clusters": grouped["cluster"].agg(lambda c: ", ".join(sorted(set(c))))}).reset_index()
    out["order"] = out["status"].map({s: i for i, s in enumerate(FAILURES)})
    return out.sort_values(["order", "attempts"], ascending=[True, False], kind="stable").drop(columns="order")


def failure_counts(frame: pd.DataFrame) -> pd.DataFrame:
    """Failed attempts per cluster and status (one column per status that occurred)."""
    failed = frame[frame["status"].isin(FAILURES)]
    counts = pd.crosstab(failed["cluster"], failed["status"])
    return counts.reindex(columns=[s for s in FAILURES if s in counts.columns])


def auto_vs_manual(plans_: pd.DataFrame) -> pd.DataFrame:
    """Per measured group and setup where Auto search succeeded: its plan against the best manual one."""
    scored = ranked(plans_[~plans_["simulated"]])
    columns = [*KEYS, "plan", "score"]
    auto = scored[scored["auto"]].drop_duplicates(KEYS)[columns]
    manual = scored[~scored["auto"]].drop_duplicates(KEYS)[columns]
    out = auto.merge(manual, on=KEYS, how="left", suffixes=("_auto", "_manual"))
    out["ratio"] = out["score_auto"] / out["score_manual"]
    return out


def summary_table(frame: pd.DataFrame, plans_: pd.DataFrame) -> pd.DataFrame:
    """The sweep summary: per (model, cluster), best plan, throughput, speedup over DP, failures."""
    groups = frame[["simulated", *GROUP]].drop_duplicates()
    best = best_plans(plans_)[["simulated", *GROUP, "plan", "score", "speedup"]]
    out = groups.merge(best, on=["simulated", *GROUP], how="left")
    failed = frame[frame["status"].isin(FAILURES)].groupby(["simulated", *GROUP])["status"]
    counts = failed.agg(_count_text)
    out["failures"] = [counts.get(tuple(key), "") for key in out[["simulated", *GROUP]].itertuples(index=False)]
    return out.sort_values(["simulated", *GROUP], kind="stable")


def _count_text(statuses: pd.Series) -> str:
    """"1 failed, 2 oom": how many of each failing status, in FAILURES order."""
    counts = statuses.value_counts()
    return ", ".join(f"{counts[s]} {s}" for s in FAILURES if s in counts)


def sweep_summary(rows: list[dict]) -> str:
    """The table printed on stderr after a sweep; "" when there is nothing to say."""
    frame = attempts_frame(rows)
    if frame.empty:
        return ""
    table = summary_table(frame, plans(frame))
    shown = pd.DataFrame({
        "model": table["model"], "cluster": table["cluster"],
        "best plan": [p if isinstance(p, str) else "(none succeeded)" for p in table["plan"]],
        "samples/s": [fmt.number(s) + (" (predicted)" if sim and pd.notna(s) else "")
                      for s, sim in zip(table["score"], table["simulated"])],
        "vs data parallel": [fmt.ratio(s) for s in table["speedup"]],
        "failed attempts": [f or "0" for f in table["failures"]],
    })
    left = {c: f"{{:<{max(len(c), shown[c].str.len().max()) + 1}}}".format for c in shown.columns}
    return "\n".join(line.rstrip() for line in
                     shown.to_string(index=False, justify="left", formatters=left).splitlines())


def codesign_frontier(ranking: pd.DataFrame) -> pd.DataFrame:
    """The co-design CSV's Pareto frontier per cluster and micro-batch count, most parameters first."""
    on = ranking[ranking["pareto"].eq(1)]
    return on.sort_values(["cluster", "micro_batches", "params"], ascending=[True, True, False], kind="stable")


def codesign_agreement(ranking: pd.DataFrame) -> pd.DataFrame:
    """Per cluster and micro-batch count where `--run-top` measured candidates: how the prediction
    ranked them (codesign.planner.ranking.agreement)."""
    from codesign.planner.ranking import agreement

    ran = ranking[ranking["measured_samples_per_s"].notna()]
    rows = [{"cluster": cluster, "micro_batches": micro,
             **agreement(group["predicted_samples_per_s"].tolist(), group["measured_samples_per_s"].tolist())}
            for (cluster, micro), group in ran.groupby(["cluster", "micro_batches"], sort=False)]
    return pd.DataFrame(rows, columns=["cluster", "micro_batches", "runs", "spearman", "predicted_best_measured",
                                       "measured_best", "best_ratio"]).dropna(subset=["runs"])


def codesign_energy_frontier(ranking: pd.DataFrame) -> pd.DataFrame:
    """Per cluster of the co-design CSV: the candidates no other beats on both predicted samples/s and
    predicted samples per joule, fastest first."""
    from codesign.planner.objective import pareto

    fit = ranking[np.isfinite(ranking["predicted_samples_per_s"]) & np.isfinite(ranking["samples_per_joule"])]
    marked = [group.index[pareto(group["predicted_samples_per_s"].to_numpy(float),
                                 group["samples_per_joule"].to_numpy(float))]
              for _, group in fit.groupby("cluster", sort=False)]
    on = fit.loc[[i for index in marked for i in index]]
    return on.sort_values(["cluster", "predicted_samples_per_s"], ascending=[True, False], kind="stable")
