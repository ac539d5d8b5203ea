"""Attempts as a labelled table, and plans: one row per job of its (model, cluster) group.

A plan is a job key: within a (model, cluster) group, two jobs differ only in their parallel
spec, micro-batch count and training setup, which is what a user compares. Rows the cost model
priced without running (status `simulated`, or platform `sim`) keep a flag so that no table
ever ranks them with measured ones.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from codesign.outcome import (
    FAILED,
    INTERRUPTED,
    INVALID,
    OOM,
    SIMULATED,
    SUCCEEDED,
    TIMEOUT,
)
from codesign.config.types import AUTO_SEARCH, ClusterSpec, ModelSpec, TransformerSpec
from codesign.cost.plan import stage_kind

SIM_PLATFORM = "sim"
FAILURES = (FAILED, TIMEOUT, OOM, INVALID, INTERRUPTED)
GROUP = ["model", "cluster"]
SETUP = ["global_batch", "precision"]  # what two plans must share for one's time to be the other's baseline

COLUMNS = (
    "id", "job_key", "status", "datetime", "num_zhen_layers", "token_mixer", "input_features",
    "emb_dimensions", "output_per_ensemble", "num_nodes", "gpus_per_node", "transport",
    "input_batch_size", "description", "num_micro_batches", "num_auto_layers", "pp_dp_op",
    "physical_mesh_shapes", "host_ids", "device_ids", "remat_layer", "avg", "median", "p90",
    "max_memory", "error", "all_configs", "throughput", "compile_time", "predicted_time",
    "predicted_memory", "platform", "device_kind", "precision", "energy_per_iter", "predicted_energy",
    "avg_power", "energy_source", "repriced_time", "repriced_calibration", "repriced_in_sample"
)  # a column an older DB lacks reads as absent (NaN)
NUMERIC = ("avg", "median", "p90", "max_memory", "throughput", "compile_time", "predicted_time",
           "predicted_memory", "energy_per_iter", "predicted_energy", "avg_power", "input_batch_size",
           "num_micro_batches", "remat_layer", "num_auto_layers", "repriced_time", "repriced_calibration",
           "repriced_in_sample")


def attempts_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Store.attempts() rows, with the labels and derived figures every section uses."""
    frame = pd.DataFrame(list(rows)).reindex(columns=list(COLUMNS))
    for column in NUMERIC:
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    frame = frame.rename(columns={"input_batch_size": "global_batch"})
    frame["simulated"] = frame["status"].eq(SIMULATED) | frame["platform"].eq(SIM_PLATFORM)
    frame["auto"] = frame["description"].eq(AUTO_SEARCH)
    frame["model"] = _labels(frame, ["token_mixer", "num_zhen_layers", "input_features", "emb_dimensions",
                                     "output_per_ensemble"], model_label)
    frame["cluster"] = _labels(frame.assign(kind=frame["device_kind"].where(frame["simulated"])),
                               ["num_nodes", "gpus_per_node", "transport", "platform", "kind"], cluster_label)
    degrees = _labels(frame, ["pp_dp_op"], _degrees)
    for i, name in enumerate(("pp", "dp", "op")):
        frame[name] = pd.to_numeric(degrees.str[i], errors="coerce")
    frame["plan"] = frame["job_key"].map(_plan_labels(frame))
    frame["plan_kind"] = _labels(frame, ["pp", "dp", "op", "num_micro_batches"], plan_kind)
    frame["energy_per_sample"] = frame["energy_per_iter"] / frame["global_batch"]
    frame["reason"] = _labels(frame, ["error"], reason)
    return frame


def plans(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per job: its latest attempt (a job that succeeded is never attempted again), ranked
    within its group by throughput, measured or (for simulated rows) predicted."""
    chosen = frame.sort_values("id", kind="stable").drop_duplicates("job_key", keep="last").copy()
    chosen["attempts"] = chosen["job_key"].map(frame["job_key"].value_counts())
    chosen["predicted_throughput"] = chosen["global_batch"] / chosen["predicted_time"]
    measured = ~chosen["simulated"] & chosen["status"].eq(SUCCEEDED)
    priced = chosen["simulated"] & chosen["status"].eq(SIMULATED)
    chosen["score"] = chosen["throughput"].where(measured, chosen["predicted_throughput"].where(priced))
    ranks = chosen.groupby(["simulated", *GROUP], dropna=False)["score"].rank(ascending=False, method="first")
    chosen["rank"] = ranks  # NaN for plans without a score (not succeeded)
    return chosen.sort_values(["simulated", *GROUP, "rank", "id"], na_position="last", kind="stable")


def model_label(tokens: Any, layers: Any, features: Any, emb: Any, out: Any) -> str:
    """ModelSpec.summary() of the columns, e.g. "F32 D16 O4 L2 [ALDC/ALDC]"."""
    try:
        parsed = json.loads(tokens)
        if isinstance(parsed, dict):  # another family's whole [[model]] table
            return TransformerSpec(**{k: v for k, v in parsed.items() if k != "family"}).summary()
        per_layer = [parsed] * int(layers) if isinstance(parsed[0], str) else parsed
        return ModelSpec(int(features), int(emb), int(out), int(layers),
                         tuple(tuple(layer) for layer in per_layer)).summary()
    except (TypeError, ValueError, IndexError):
        return "unknown model"


def cluster_label(nodes: Any, devices: Any, transport: Any, platform: Any, sim_device: Any) -> str:
    """ClusterSpec.summary(), e.g. "1x4 NVLink (cpu)"; a simulated cluster names its device kind."""
    where = f"{platform} {sim_device}" if isinstance(sim_device, str) else platform
    try:
        return ClusterSpec(int(nodes), int(devices), str(transport), str(where)).summary()
    except (TypeError, ValueError):
        return "unknown cluster"


def reason(error: Any) -> str:
    """The line of an error that says why: a traceback's last line, at most 160 characters."""
    if not isinstance(error, str) or not error.strip():
        return ""
    line = error.strip().splitlines()[-1].strip()
    return line if len(line) <= 160 else line[:157] + "..."


def plan_label(row: dict[str, Any]) -> str:
    """The parallel spec in one line: description, degrees, micro-batches and what is not default."""
    parallel = _parallel(row.get("all_configs"))
    parts = [str(row["description"])]
    if not np.isnan(row["pp"]):
        parts.append(f"pp{row['pp']:.0f} dp{row['dp']:.0f} op{row['op']:.0f}")
    elif isinstance(row.get("pp_dp_op"), str):  # a chosen plan whose stages differ: [pp, dp, op] with lists
        parts.append(f"pp_dp_op {row['pp_dp_op']}")
    if not np.isnan(row["num_micro_batches"]):
        parts.append(f"mb{row['num_micro_batches']:.0f}")
    if row["num_auto_layers"] > 1:
        parts.append(f"groups {row['num_auto_layers']:.0f}")
    if row["remat_layer"] == 1:
        parts.append("remat")
    options = dict(parallel.get("auto_sharding_option") or ())
    if options.get("prefer_reduce_scatter"):
        parts.append("ZeRO-2")
    if "force_batch_dim_to_mesh_dim" in options:
        parts.append(f"batch on axis {options['force_batch_dim_to_mesh_dim']}")
    if parallel.get("pipeline_schedule", "1F1B") != "1F1B":
        parts.append(str(parallel["pipeline_schedule"]))
    if isinstance(row.get("physical_mesh_shapes"), str):
        parts.append(f"mesh {'x'.join(map(str, json.loads(row['physical_mesh_shapes'])))}")
    if isinstance(row.get("host_ids"), str) or isinstance(row.get("device_ids"), str):
        parts.append("placed")
    return " | ".join(parts)


def plan_kind(pp: float, dp: float, op: float, micro_batches: float) -> str:
    """The plan kind a learned calibration keeps a time factor under (plan.stage_kind), so that
    the report's error by kind is the one the cost model learns by; "other" for a chosen plan
    whose stages have their own dp and op, or no recorded degrees."""
    if any(np.isnan(value) for value in (pp, dp, op, micro_batches)):
        return "other"
    return stage_kind(int(pp), int(dp), int(op), int(micro_batches))


def _plan_labels(frame: pd.DataFrame) -> dict[str, str]:
    """Job key -> plan label, from the job's latest attempt (all_configs parsed once per job)."""
    latest = frame.drop_duplicates("job_key", keep="last")
    return {row["job_key"]: plan_label(row) for row in latest.to_dict("records")}


def _parallel(configs: Any) -> dict[str, Any]:
    try:
        return json.loads(configs).get("parallel") or {}
    except (TypeError, ValueError, AttributeError):
        return {}


def _degrees(pp_dp_op: Any) -> tuple[float, float, float]:
    try:
        pp, dp, op = json.loads(pp_dp_op)
        return float(pp), float(dp), float(op)
    except (TypeError, ValueError):
        return (np.nan, np.nan, np.nan)


def _labels(frame: pd.DataFrame, columns: list[str], label: Callable[..., Any]) -> pd.Series:
    """label(*values) per row, computed once per distinct combination of the columns."""
    if frame.empty:
        return pd.Series([], index=frame.index, dtype=object)
    ids = frame.groupby(columns, dropna=False, sort=False).ngroup()
    first = ~ids.duplicated()
    names = {i: label(*values) for i, values in zip(ids[first], frame.loc[first, columns].itertuples(index=False))}
    return ids.map(names)
