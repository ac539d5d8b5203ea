"""The job body: build ZHEN under a plan, compile, train num_iters steps, measure.

Runs in its own process (`python -m codesign.runtime JOB.json OUTCOME.json`), with the
platform chosen through the environment before JAX starts; a multi-host job runs one such
process per host, joined by jax.distributed (each writes its outcome; host 0's is kept). Everything it learns goes
into an Outcome; the orchestrator records it.
"""

from __future__ import annotations

import json
import logging
import os
import platform as pyplatform
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from codesign import pipeline, programs
from codesign.energy import open_energy_meter
from codesign.errors import PlanError
from codesign.plan import Plan, make_plan
from codesign.results import FAILED, INVALID, OOM, SUCCEEDED, Outcome
from codesign.specs import Job

log = logging.getLogger(__name__)


@dataclass
class SingleStage:
    """pp = 1: one fused program (micro-batches accumulated in a scan, one update) on one mesh."""

    compiled: Callable  # (params, opt_state, xs, ys) -> (params, opt_state, loss)
    value_and_grad: Callable  # jitted (params, xs, ys) -> (loss, grads)
    state: tuple[Any, Any]  # (params, opt_state)
    x: jax.Array
    y: jax.Array
    compile_time: float
    memory: dict[str, Any]
    shardings: tuple[dict[str, Any], ...]

    def step(self) -> jax.Array:
        params, opt_state, loss = self.compiled(*self.state, self.x, self.y)
        self.state = (params, opt_state)
        return loss

    def gradients(self) -> tuple[jax.Array, dict]:
        return self.value_and_grad(self.state[0], self.x, self.y)

    def params(self) -> dict:
        return self.state[0]


def loss_fn(job: Job, groups: tuple[tuple[int, ...], ...], remat: bool) -> Callable:
    """Mean squared error of ZHEN applied group by group, each group optionally rematerialised."""
    apply = programs.apply_groups(job, groups, remat)

    def loss(params, x, y):
        _, out = apply(params, (x.astype(programs.DTYPES[job.training.precision]), None))
        return programs.mse(out, y)

    return loss


def accumulate(loss: Callable, grad_shardings: Any = None) -> Callable:
    """Loss and gradients averaged over micro-batches (leading axis), one sync per step.

    With grad_shardings (ZeRO-2), each micro-batch's gradients are reduce-scattered into them.
    """

    def place(grads):
        return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

    def value_and_grad(params, xs, ys):
        if xs.shape[0] == 1:
            value, grads = jax.value_and_grad(loss)(params, xs[0], ys[0])
            return value, place(grads)

        def body(acc, batch):
            value, grads = jax.value_and_grad(loss)(params, *batch)
            return jax.tree.map(jnp.add, acc, (value, place(grads))), None

        zeros = (jnp.zeros((), jnp.float32), place(jax.tree.map(jnp.zeros_like, params)))
        (value, grads), _ = jax.lax.scan(body, zeros, (xs, ys))
        n = xs.shape[0]
        return value / n, jax.tree.map(lambda g: g / n, grads)

    return value_and_grad


def build_training(job: Job, plan: Plan) -> programs.Training:
    """The plan's training iteration, compiled (and its memory analysed) before it runs."""
    if len(plan.stages) > 1:
        training = pipeline.build_pipeline(job, plan)
        ensure_fits(training.memory)
        return training
    return build_single_stage(job, plan)


def build_single_stage(job: Job, plan: Plan) -> SingleStage:
    """Shard parameters by the plan's rules, then lower and compile the step on abstract
    arrays: a plan that cannot fit fails before anything is allocated on the devices."""
    stage = plan.stages[0]
    mesh = programs.stage_mesh(stage)
    shardings = programs.param_shardings(job, plan, stage, mesh)
    abstract = programs.abstract_params(job, stage)
    grad_shardings = programs.gradient_shardings(plan, shardings, abstract)
    optimizer = optax.adam(job.training.learning_rate)
    opt_shardings = programs.optimizer_shardings(optimizer, abstract, grad_shardings, mesh)
    batch = programs.batch_sharding(mesh, plan, leading=1)
    grad_fn = accumulate(loss_fn(job, stage.groups, plan.remat),
                         grad_shardings if plan.reduce_scatter else None)

    def step(params, opt_state, xs, ys):
        loss, grads = grad_fn(params, xs, ys)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = (abstract, jax.eval_shape(optimizer.init, abstract))
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1),
                       out_shardings=(shardings, opt_shardings, NamedSharding(mesh, P()))
                       ).lower(*_placed(state, (shardings, opt_shardings)),
                               *_placed(programs.batch_shapes(job, plan.num_micro_batches), (batch, batch))
                               ).compile()
    compile_time = time.perf_counter() - start
    memory = programs.compiled_memory(compiled)
    ensure_fits(memory)
    params, opt_state = programs.init_state(job, stage, optimizer, (shardings, opt_shardings))
    x, y = programs.synthetic_batch(job, plan.num_micro_batches, batch, batch)
    return SingleStage(compiled, jax.jit(grad_fn), (params, opt_state), x, y, compile_time, memory,
                       (programs.describe_shardings(shardings, grad_shardings),))


def _placed(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


class DoesNotFit(Exception):
    """The compiled iteration needs more memory per device than the device has."""


def ensure_fits(memory: dict[str, Any]) -> None:
    stats = jax.local_devices()[0].memory_stats() or {}
    limit, need = stats.get("bytes_limit"), memory.get("peak")
    if limit and need and need > limit:
        raise DoesNotFit(f"the compiled step needs {need / 2**30:.2f} GiB per device, the device has "
                         f"{limit / 2**30:.2f} GiB: raise op or pp, add micro-batches or remat")


def train_steps(training: programs.Training, steps: int) -> tuple[list[float], list[float]]:
    """Run synchronised steps; returns the losses and the wall time of each step."""
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = training.step()
        jax.block_until_ready((training.params(), loss))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return losses, times


def measure_steps(training: programs.Training, job: Job, devices) -> tuple[list[float], list[float], float | None]:
    """Warm-up steps, then the measured ones: every loss, the measured steps' wall times and
    the GPU joules per measured step on this process's devices."""
    warmup = job.training.warmup_iters
    losses, _ = train_steps(training, warmup)
    meter = open_energy_meter(devices)
    start = meter() if meter else None
    measured_losses, times = train_steps(training, job.training.num_iters - warmup)
    energy = (meter() - start) / len(times) if meter else None
    return losses + measured_losses, times, energy


def peak_memory(training: programs.Training, devices) -> int | None:
    """Allocator peak where the runtime has one (GPU), else the compiled program's analysis."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    if all(p is not None for p in peaks):
        return max(peaks)
    return training.memory.get("peak")


def run_job(job: Job) -> Outcome:
    try:
        plan = make_plan(job)
    except PlanError as err:
        return Outcome(INVALID, error=str(err))
    try:
        training = build_training(job, plan)
        devices = [jax.devices()[i] for s in plan.stages for i in s.device_ids]
        local = [d for d in devices if d.process_index == jax.process_index()]  # others' stats are theirs
        losses, times, energy = measure_steps(training, job, local)
    except DoesNotFit as err:
        return Outcome(OOM, error=str(err), plan=plan.describe())
    except Exception as err:  # a job's failure is data, not a crash
        status = OOM if _is_oom(err) else FAILED
        return Outcome(status, error=traceback.format_exc(), plan=plan.describe())
    measured = np.array(times)
    metrics = {"energy_per_iter": energy, "avg": float(measured.mean()), "median": float(np.median(measured)),
               "p90": float(np.percentile(measured, 90)),
               "max_memory": peak_memory(training, local),
               "throughput": job.global_batch / float(measured.mean()),
               "compile_time": training.compile_time,
               "predicted_memory": training.memory.get("peak"),
               "device_kind": devices[0].device_kind, "versions": versions(), "losses": losses}
    return Outcome(SUCCEEDED, metrics=metrics, plan=describe(plan, training))


def describe(plan: Plan, training: programs.Training) -> dict[str, Any]:
    """all_configs["plan"]: the plan, each stage's shardings, and the predicted memory behind max_memory."""
    return {**plan.describe(training.shardings), "predicted_memory": training.memory}


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
        job = Job.from_dict(json.load(f))
    outcome = run_job(job)
    with open(outcome_path, "w") as f:
        json.dump(asdict(outcome), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
