"""A results DB with every status, written through the Store, for the report's tests.

Two things the store of this branch cannot express yet are written by clearly labelled helpers
below: `simulated` rows (issue 11 adds the status) and the plan Auto search chose in the spec
columns (issue 12 records it). The merger switches them to the real API.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from codesign.outcome import SIMULATED, Outcome
from codesign.planner.columns import plan_columns
from codesign.cost.plan import Plan, plan_from_stages
from codesign.config.jobs import job_key
from codesign.config.types import (
    AUTO_SEARCH,
    ClusterSpec,
    Job,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
)
from codesign.store.database import Store

HOSTILE = """<script>alert("x")</script> it's "quoted" $x^2$ & co"""
MODEL_A = ModelSpec(8, 4, 2, 2, (("LINEAR", "DOT"), ("LINEAR", "DOT")))
MODEL_B = ModelSpec(16, 4, 2, 1, (("ATTENTION",),))
C2 = ClusterSpec(1, 2, "NVLink", "cpu")
C4 = ClusterSpec(1, 4, "NVLink", "cpu")
SIM8 = ClusterSpec(1, 8, "NVLink", "sim")
TRAINING = TrainingSpec(4, 3)  # global batch 8 on C2, 16 on C4, 32 on SIM8
MIB = 2 ** 20


def job(model: ModelSpec, cluster: ClusterSpec, description: str, degrees: tuple[int, int, int] | None,
        micro_batches: int = 1, **parallel) -> Job:
    spec = ParallelSpec(description, (micro_batches,), pp_dp_op=degrees, **parallel)
    return Job(model, cluster, TRAINING, spec, micro_batches, cluster.platform)


def measured(avg: float, job_: Job, **extra) -> dict:
    """The metrics a job body reports, throughput as the engine computes it."""
    return {"avg": avg, "median": avg * 0.98, "p90": avg * 1.1, "throughput": job_.global_batch / avg,
            "compile_time": 1.25, "max_memory": 3 * MIB, "device_kind": "cpu", **extra}


def record(store: Store, job_: Job, outcome: Outcome) -> int:
    """As the sweep records it: a chosen plan also fills the manual spec's columns."""
    attempt = store.claim(job_key(job_), job_, retry_failed=True)
    assert attempt is not None
    chosen = plan_columns(Plan.from_dict(outcome.chosen_plan), job_.cluster.num_devices_per_host) \
        if outcome.chosen_plan else None
    assert store.finish(attempt, outcome, chosen)
    return attempt


def record_simulated(store: Store, job_: Job, predicted_time: float, predicted_memory: int) -> int:
    """A `simulated` row: priced by the cost model, never run."""
    return record(store, job_, Outcome(SIMULATED, metrics={"predicted_time": predicted_time,
                                                           "predicted_memory": predicted_memory,
                                                           "device_kind": "H100"}))


def chosen(job_: Job, degrees: tuple[int, int, int]) -> dict:
    """Auto search's chosen plan for the job: one stage of all its groups on every device."""
    _, dp, op = degrees
    plan = plan_from_stages(job_, [list(range(job_.parallel.num_auto_layers))],
                            [list(range(job_.cluster.num_devices))], [(dp, op)])
    return plan.to_dict()


def build(path: Path) -> None:
    """Model A on 2 devices: every status, a retried plan, a hostile description, Auto search;
    model A on 4 devices: one plan, no data-parallel baseline; model B on 4: failures only;
    model A on a simulated 8-device H100 host: two priced plans faster than anything measured."""
    store = Store(path)
    dp = job(MODEL_A, C2, "data parallel", (1, 2, 1))
    record(store, dp, Outcome("succeeded", metrics=measured(0.004, dp, energy_per_iter=0.8, predicted_time=0.0045,
                                                               predicted_memory=int(3.3 * MIB))))
    op = job(MODEL_A, C2, "operator parallel", (1, 1, 2))
    record(store, op, Outcome("succeeded", metrics=measured(0.002, op, energy_per_iter=0.5, predicted_time=0.0018,
                                                               predicted_memory=int(2.5 * MIB))))
    pipe = job(MODEL_A, C2, "pipeline", (2, 1, 1), 2, num_auto_layers=2, pipeline_schedule="GPipe")
    record(store, pipe, Outcome("failed", error="Traceback (most recent call last):\n  ...\nRuntimeError: boom"))
    record(store, pipe, Outcome("succeeded", metrics=measured(0.003, pipe, predicted_time=0.0036)))
    hostile = job(MODEL_A, C2, HOSTILE, (1, 2, 1), 2, remat_layer=True,
                  auto_sharding_option=(("prefer_reduce_scatter", True),))
    record(store, hostile, Outcome("succeeded", metrics=measured(0.005, hostile)))
    record(store, job(MODEL_A, C2, "data parallel", (1, 2, 1), 3),
           Outcome("invalid", error="global batch 8 is not divisible by num_micro_batches = 3"))
    record(store, job(MODEL_A, C2, "slow", (2, 1, 1), 4), Outcome("timeout", error="job exceeded its 600 s timeout"))
    record(store, job(MODEL_A, C2, "big", (1, 1, 2), remat_layer=True),
           Outcome("oom", error="RESOURCE_EXHAUSTED: Out of memory allocating 1.2G"))
    record(store, job(MODEL_A, C2, "gone", (1, 2, 1), 4),
           Outcome("interrupted", error="orchestrator stopped while the job ran"))
    running = job(MODEL_A, C2, "still running", (2, 1, 1))
    store.claim(job_key(running), running, retry_failed=True)
    auto = job(MODEL_A, C2, AUTO_SEARCH, None)
    record(store, auto, Outcome("succeeded", metrics=measured(8 / 3000, auto), chosen_plan=chosen(auto, (1, 2, 1))))

    dpop = job(MODEL_A, C4, "dp x op", (1, 2, 2), physical_mesh_shape=(1, 4))
    record(store, dpop, Outcome("succeeded", metrics=measured(0.004, dpop, compile_time=2.5)))
    record(store, job(MODEL_B, C4, "data parallel", (1, 4, 1)), Outcome("oom", error="RESOURCE_EXHAUSTED: 9G"))
    record(store, job(MODEL_B, C4, "pipeline", (4, 1, 1)),
           Outcome("invalid", error="pp = 4 stages but only 1 layer groups"))

    record_simulated(store, job(MODEL_A, SIM8, "data parallel", (1, 8, 1)), 0.001, 40 * MIB)
    record_simulated(store, job(MODEL_A, SIM8, "pipeline", (2, 4, 1), 2, num_auto_layers=2), 0.0008, 30 * MIB)
    store.close()


# -- a sweep that learns, with energy -----------------------------------------------------------
# Columns schema v8 adds (issue 48); the tests write them with SQL so that they run on a DB of any version.
ENERGY_COLUMNS = {"predicted_energy": "REAL", "avg_power": "REAL", "energy_source": "TEXT"}
# In run order: model, cluster, description, (pp, dp, op), micro-batches, predicted and measured seconds,
# predicted and measured MiB, the calibration version that priced it (None: before learning).
LEARNING = [
    (MODEL_A, C4, "dp", (1, 4, 1), 1, 0.0060, 0.0040, 3.0, 3.2, None),
    (MODEL_A, C4, "op", (1, 1, 4), 1, 0.0030, 0.0050, 4.0, 3.0, None),
    (MODEL_A, C4, "dp x op", (1, 2, 2), 1, 0.0052, 0.0040, 3.5, 3.4, None),
    (MODEL_B, C4, "dp", (1, 4, 1), 2, 0.0090, 0.0060, 2.0, 2.5, None),
    (MODEL_A, C4, "pp x dp", (2, 2, 1), 2, 0.0050, 0.0040, 3.3, 3.3, 1),
    (MODEL_B, C4, "op", (1, 1, 4), 1, 0.0055, 0.0050, 2.6, 2.5, 1),
    (MODEL_A, C2, "dp", (1, 2, 1), 1, 0.0044, 0.0040, 3.1, 3.0, 1),
    (MODEL_B, C4, "dp x op", (1, 2, 2), 1, 0.0047, 0.0050, 2.4, 2.5, 2),
    (MODEL_A, C4, "dp accumulating", (1, 4, 1), 2, 0.0042, 0.0040, 3.6, 3.0, 2),
    (MODEL_A, C2, "op", (1, 1, 2), 1, 0.0031, 0.0030, 3.2, 3.0, 2),
]
# Per description of MODEL_A on C4: predicted joules per iteration, and measured ones where measured.
PREDICTED_ENERGY = {"dp": 2.0, "op": 3.5, "dp x op": 1.6, "pp x dp": 1.9, "dp accumulating": 2.1}
MEASURED_ENERGY = {"dp": 2.2, "dp x op": 1.5}
SIMULATED_ENERGY = [("data parallel", (1, 8, 1), 1, 0.0010, 40.0), ("pipeline", (2, 4, 1), 2, 0.0012, 30.0),
                    ("slow", (1, 4, 2), 1, 0.0015, 45.0)]  # description, degrees, micro, seconds, joules


def build_learning(path: Path) -> None:
    """LEARNING's measured attempts (errors that fall as calibrations are learned), one oom attempt
    with a prediction, energy predicted and measured on MODEL_A on C4, and simulated plans on SIM8."""
    store = Store(path)
    ids = {}
    for model, cluster, description, degrees, micro, predicted, median, predicted_mib, peak_mib, version \
            in LEARNING:
        job_ = job(model, cluster, description, degrees, micro)
        metrics = measured(median, job_, median=median, max_memory=int(peak_mib * MIB), predicted_time=predicted,
                           predicted_memory=int(predicted_mib * MIB),
                           prediction={"calibration": version} if version is not None else {"profile": "builtin"})
        if model is MODEL_A and cluster is C4:
            metrics["energy_per_iter"] = MEASURED_ENERGY.get(description)
        ids[(model.summary(), cluster.summary(), description)] = record(store, job_, Outcome("succeeded",
                                                                                          metrics=metrics))
    oom = job(MODEL_A, C4, "too big", (1, 1, 4), 4)
    ids["oom"] = record(store, oom, Outcome("oom", error="RESOURCE_EXHAUSTED", metrics={"predicted_time": 0.001}))
    for description, degrees, micro, seconds, joules in SIMULATED_ENERGY:
        ids[("sim", description)] = record_simulated(store, job(MODEL_A, SIM8, description, degrees, micro),
                                                     seconds, 40 * MIB)
    store.close()
    energy = {ids[(MODEL_A.summary(), C4.summary(), d)]: (joules, MEASURED_ENERGY.get(d))
              for d, joules in PREDICTED_ENERGY.items()}
    energy.update({ids[("sim", d)]: (joules, None) for d, _, _, _, joules in SIMULATED_ENERGY})
    energy[ids["oom"]] = (0.5, None)
    write_energy(path, energy)


def write_energy(path: Path, energy: dict[int, tuple[float, float | None]]) -> None:
    """attempt id -> (predicted joules, measured joules or None): predicted_energy, and for a measured
    one avg_power and energy_source as a GPU would record them (adding schema v8's columns if missing)."""
    conn = sqlite3.connect(path)
    with conn:
        have = {row[1] for row in conn.execute("PRAGMA table_info(attempts)")}
        for column, kind in ENERGY_COLUMNS.items():
            if column not in have:
                conn.execute(f"ALTER TABLE attempts ADD COLUMN {column} {kind}")
        for attempt, (predicted, measured_) in energy.items():
            conn.execute("UPDATE attempts SET predicted_energy = ?, avg_power = ?, energy_source = ? WHERE id = ?",
                         (predicted, 100.0 if measured_ else None, "zeus:nvml" if measured_ else None, attempt))
    conn.close()
