"""The questions users ask of a sweep, answered as pandas tables (raw DB units: seconds, bytes)."""

from __future__ import annotations

import pandas as pd

from codesign.outcome import SUCCEEDED
from codesign.report import fmt
from codesign.report.frame import FAILURES, GROUP, SETUP, attempts_frame, plans

KEYS = ["simulated", *GROUP, *SETUP]
# predicted column against the measured one it predicts (time: the median step, as the cost model's bench)
PREDICTIONS = {"time": ("predicted_time", "median"), "memory": ("predicted_memory", "max_memory")}


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
                                   "cluster": rows["cluster"], "plan": rows["plan"],
                                   "predicted": rows[predicted], "measured": rows[measured]}))
    out = pd.concat(parts, ignore_index=True)
    out["error"] = (out["predicted"] - out["measured"]) / out["measured"]
    return out


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
