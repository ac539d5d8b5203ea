"""The job body: build ZHEN under a plan, compile, train num_iters steps, measure.

Runs in its own process (`python -m codesign.engine.job JOB.json OUTCOME.json`), with the
platform chosen through the environment before JAX starts; a multi-host job runs one such
process per host, joined by jax.distributed (each writes its outcome; host 0's is kept). Everything it learns goes
into an Outcome; the orchestrator records it. JOB.json may also carry, under "chosen_plans", plans
the toolkit chose (Plan.to_dict(), best predicted first): the plan runs instead of the plan of the
job's manual spec; with several (auto_trials), each is trialled for a few steps and the fastest runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform as pyplatform
import sys
import time
import traceback
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from codesign import gpu_power
from codesign.engine import pipeline, programs
from codesign.engine.energy import Energy, open_meter
from codesign.engine.options import EngineOptions, engine_options
from codesign.engine.programs import DoesNotFit
from codesign.engine.step import build_single_stage
from codesign.errors import PlanError
from codesign.outcome import FAILED, INVALID, OOM, SUCCEEDED, Outcome, write_outcome
from codesign.planner.columns import plan_columns
from codesign.cost.plan import Plan, check_plan, make_plan
from codesign.config.types import Job

log = logging.getLogger(__name__)
# Steps of each auto_trials candidate; the first (compilation's warm-up) is not timed: a median of
# fewer steps could not tell twins of one plan apart from different plans on CPU devices.
TRIAL_STEPS = 8


def build_training(job: Job, plan: Plan, values: programs.StartingValues = programs.JOB_VALUES,
                   options: EngineOptions | None = None) -> programs.Training:
    """The plan's training iteration, compiled (and its memory analysed) before it runs, built as
    `options` say (by default as engine_options chooses for its devices and the job's precision)."""
    if len(plan.stages) > 1:
        return pipeline.build_pipeline(job, plan, values, options)
    return build_single_stage(job, plan, values, options)


def train_steps(training: programs.Training, steps: int, min_seconds: float = 0.0) -> tuple[list[float], list[float]]:
    """Run synchronised steps: `steps` of them, then more, in rounds priced at their median pace,
    until they add up to min_seconds; returns the losses and the wall time of each step."""
    losses, times = [], []
    count = steps
    while count:
        for _ in range(count):
            run_step(training, losses, times)
        count = more_steps(times, min_seconds)
    return losses, times


def run_step(training: programs.Training, losses: list[float], times: list[float]) -> None:
    start = time.perf_counter()
    loss = training.step()
    training.synchronize()
    times.append(time.perf_counter() - start)
    losses.append(float(loss))


def more_steps(times: list[float], min_seconds: float) -> int:
    """Steps still to run for the timed ones to add up to min_seconds; every process of a
    multi-host job runs process 0's count (each step is a collective program)."""
    if min_seconds <= 0:  # every process reads it from the same config: none broadcasts
        return 0
    short = min_seconds - sum(times)
    count = math.ceil(short / float(np.median(times))) if short > 0 and times else 0
    if jax.process_count() > 1:
        count = int(multihost_utils.broadcast_one_to_all(np.int32(count)))
    return count


def measure_steps(training: programs.Training, job: Job, devices) -> tuple[list[float], list[float], Energy]:
    """Warm-up steps, then the measured ones: every loss, the measured steps' wall times and
    the energy of the measured steps on this process's devices."""
    warmup = job.training.warmup_iters
    losses, _ = train_steps(training, warmup)
    meter = open_meter(devices)
    meter.begin()
    measured_losses, times = train_steps(training, job.training.num_iters - warmup, job.training.min_measured_seconds)
    return losses + measured_losses, times, meter.end(len(times))


def peak_memory(training: programs.Training, devices) -> int | None:
    """Allocator peak where the runtime has one (GPU), else the compiled program's analysis."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    if all(p is not None for p in peaks):
        return max(peaks)
    return training.memory.get("peak")


def run_job(job: Job, chosen: Sequence[Plan] = ()) -> Outcome:
    """Run the job under the plan the toolkit chose for it (checked against the job; the outcome
    carries it), the fastest as measured of several, or, without one, under the plan its manual
    spec describes."""
    try:
        for plan in chosen:
            check_plan(job, plan)
        plans = list(chosen) or [make_plan(job)]
    except PlanError as err:
        return Outcome(INVALID, error=str(err))
    options = engine_options(jax.default_backend(), job.training.precision)
    trials = [trial(job, plan, options) for plan in plans] if len(plans) > 1 else []
    timed = [(t["measured_time"], i) for i, t in enumerate(trials) if t["measured_time"] is not None]
    plan = plans[min(timed)[1] if timed else 0]
    outcome = run_plan(job, plan, options)
    if chosen:
        outcome.chosen_plan = plan.to_dict()
    if trials:
        outcome.metrics["auto_trials"] = trials
    outcome.metrics["engine_options"] = options.to_dict()  # how its steps were built: a point says so
    power = gpu_power.record(os.environ)  # the power limits it was given, and whether its guard set them
    if power:
        outcome.metrics["power"] = power
    return outcome


def trial(job: Job, plan: Plan, options: EngineOptions) -> dict[str, Any]:
    """A few steps of one candidate plan (all_configs["auto_trials"]): the plan in the manual
    spec's columns, its median step time after the first, or why it could not run."""
    columns = {**plan_columns(plan, job.cluster.num_devices_per_host),
               "layers": [list(s.layers) for s in plan.stages]}
    try:
        _, times = train_steps(build_training(job, plan, options=options), TRIAL_STEPS)
    except Exception as err:  # a plan that fails its trial just loses it
        return {**columns, "measured_time": None, "error": f"{type(err).__name__}: {str(err)[:500]}"}
    log.info("trial of %s: %.4f s per step", columns["pp_dp_op"], float(np.median(times[1:])))
    return {**columns, "measured_time": float(np.median(times[1:]))}


def run_plan(job: Job, plan: Plan, options: EngineOptions) -> Outcome:
    """Compile, train and measure a checked plan; whatever goes wrong becomes the outcome."""
    try:
        training = build_training(job, plan, options=options)
        devices = [jax.devices()[i] for s in plan.stages for i in s.device_ids]
        local = [d for d in devices if d.process_index == jax.process_index()]  # others' stats are theirs
        losses, times, energy = measure_steps(training, job, local)
    except DoesNotFit as err:
        return Outcome(OOM, error=str(err), plan=plan.describe())
    except Exception as err:  # a job's failure is data, not a crash
        status = OOM if _is_oom(err) else FAILED
        return Outcome(status, error=traceback.format_exc(), plan=plan.describe())
    measured = np.array(times)
    metrics = {**energy.metrics(), "avg": float(measured.mean()), "median": float(np.median(measured)),
               "p90": float(np.percentile(measured, 90)),
               "max_memory": peak_memory(training, local),
               "throughput": job.global_batch / float(measured.mean()),
               "compile_time": training.compile_time,
               "compiled_memory": training.memory.get("peak"),
               "device_kind": devices[0].device_kind, "versions": versions(), "losses": losses}
    return Outcome(SUCCEEDED, metrics=metrics, plan=describe(plan, training))


def describe(plan: Plan, training: programs.Training) -> dict[str, Any]:
    """all_configs["plan"]: the plan, each stage's shardings, and XLA's memory analysis behind
    compiled_memory (and, on CPU, max_memory)."""
    return {**plan.describe(training.shardings), "compiled_memory": training.memory}


def _is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def versions() -> dict[str, str]:
    import flax

    return {"python": pyplatform.python_version(), "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__,
            "flax": flax.__version__, "optax": optax.__version__}


def configure_jax(cache_dir: str | None) -> None:
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def join_hosts() -> None:
    """One process of a multi-host job (env set by the Ray executor): join the others before
    JAX touches a device, so jax.devices() lists every host's devices, host-major."""
    coordinator = os.environ.get("CODESIGN_COORDINATOR")
    if not coordinator:
        return
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=int(os.environ["CODESIGN_NUM_PROCESSES"]),
                               process_id=int(os.environ["CODESIGN_PROCESS_ID"]))


def main(argv: list[str]) -> int:
    job_path, outcome_path = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    join_hosts()
    configure_jax(os.environ.get("CODESIGN_CACHE_DIR"))
    with open(job_path) as f:
        data = json.load(f)
    chosen = [Plan.from_dict(plan) for plan in data.get("chosen_plans", ())]
    write_outcome(outcome_path, run_job(Job.from_dict(data), chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
