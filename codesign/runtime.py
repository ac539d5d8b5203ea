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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from codesign import zhen
from codesign.energy import open_energy_meter
from codesign.errors import PlanError
from codesign.plan import MESH_AXES, Plan, StagePlan, make_plan
from codesign.results import FAILED, INVALID, OOM, SUCCEEDED, Outcome
from codesign.specs import Job

log = logging.getLogger(__name__)
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclass
class Training:
    """A compiled training step and the state it runs on."""

    step: Callable  # (params, opt_state, x, y) -> (params, opt_state, loss)
    value_and_grad: Callable  # (params, x, y) -> (loss, grads), accumulated over micro-batches
    params: Any
    opt_state: Any
    x: jax.Array
    y: jax.Array
    compile_time: float
    memory: dict[str, int]


def stage_mesh(stage: StagePlan) -> Mesh:
    devices = np.array(jax.devices())[list(stage.device_ids)]
    return Mesh(devices.reshape(stage.dp, stage.op), MESH_AXES)


def synthetic_batch(job: Job, micro_batches: int, sharding: NamedSharding) -> tuple[jax.Array, jax.Array]:
    """Fixed random inputs and targets, identical for every plan of the same job."""
    m, b = job.model, job.global_batch
    kx, ky = jax.random.split(jax.random.key(job.training.seed + 1))

    def make():
        x = jax.random.normal(kx, (b, m.emb_dim, m.num_features), jnp.float32)
        y = jax.random.normal(ky, (b, zhen.output_width(m)), jnp.float32)
        return (x.reshape(micro_batches, b // micro_batches, *x.shape[1:]),
                y.reshape(micro_batches, b // micro_batches, -1))

    return jax.jit(make, out_shardings=(sharding, sharding))()


def loss_fn(job: Job, groups: tuple[tuple[int, ...], ...], remat: bool) -> Callable:
    """Mean squared error of ZHEN applied group by group, each group optionally rematerialised."""
    dtype = DTYPES[job.training.precision]

    def apply_group(layers, params, carry):
        return zhen.apply_layers(job.model, params, carry, layers, dtype)

    def loss(params, x, y):
        carry = (x.astype(dtype), None)
        for layers in groups:
            run = jax.checkpoint(apply_group, static_argnums=0) if remat else apply_group
            carry = run(layers, params, carry)
        out = carry[1].astype(jnp.float32)
        return jnp.mean((out.reshape(out.shape[0], -1) - y) ** 2)

    return loss


def accumulate(loss: Callable) -> Callable:
    """Loss and gradients summed over micro-batches (leading axis), one sync per step."""

    def value_and_grad(params, xs, ys):
        if xs.shape[0] == 1:
            return jax.value_and_grad(loss)(params, xs[0], ys[0])

        def body(acc, batch):
            value, grads = jax.value_and_grad(loss)(params, *batch)
            return jax.tree.map(jnp.add, acc, (value, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(body, zeros, (xs, ys))
        n = xs.shape[0]
        return value / n, jax.tree.map(lambda g: g / n, grads)

    return value_and_grad


def build_training(job: Job, plan: Plan) -> Training:
    """Shard parameters by the plan's rules, then lower and compile the step before running it."""
    stage = plan.stages[0]
    mesh = stage_mesh(stage)
    boxed = jax.eval_shape(lambda k: zhen.init_params(job.model, k), jax.random.key(0))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, plan.rules)
    init = jax.jit(lambda k: nn.meta.unbox(zhen.init_params(job.model, k)), out_shardings=shardings)
    params = init(jax.random.key(job.training.seed))
    optimizer = optax.adam(job.training.learning_rate)
    opt_state = jax.jit(optimizer.init)(params)
    x, y = synthetic_batch(job, plan.num_micro_batches, NamedSharding(mesh, P(None, plan.batch_axis)))
    grad_fn = accumulate(loss_fn(job, stage.groups, plan.remat))

    def step(params, opt_state, xs, ys):
        loss, grads = grad_fn(params, xs, ys)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, x, y).compile()
    compile_time = time.perf_counter() - start
    return Training(compiled, grad_fn, params, opt_state, x, y, compile_time, _memory_analysis(compiled))


def _memory_analysis(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    return {"peak": int(peak), "temp": int(stats.temp_size_in_bytes),
            "arguments": int(stats.argument_size_in_bytes)}


def check_fits(training: Training) -> str:
    """Why the compiled program cannot fit on the devices, or "" (unknown limits fit)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit, need = stats.get("bytes_limit"), training.memory.get("peak")
    if limit and need and need > limit:
        return (f"the compiled step needs {need / 2**30:.2f} GiB per device, the device has "
                f"{limit / 2**30:.2f} GiB: raise op or pp, add micro-batches or remat")
    return ""


def train_steps(training: Training, steps: int) -> tuple[list[float], list[float]]:
    """Run synchronised steps; returns the losses and the wall time of each step."""
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        training.params, training.opt_state, loss = training.step(
            training.params, training.opt_state, training.x, training.y)
        jax.block_until_ready((training.params, loss))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return losses, times


def measure_steps(training: Training, job: Job, devices) -> tuple[list[float], list[float], float | None]:
    """Warm-up steps, then the measured ones: every loss, the measured steps' wall times and
    the GPU joules per measured step on this process's devices."""
    warmup = job.training.warmup_iters
    losses, _ = train_steps(training, warmup)
    meter = open_energy_meter(devices)
    start = meter() if meter else None
    measured_losses, times = train_steps(training, job.training.num_iters - warmup)
    energy = (meter() - start) / len(times) if meter else None
    return losses + measured_losses, times, energy


def peak_memory(training: Training, devices) -> int | None:
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
        too_big = check_fits(training)
        if too_big:
            return Outcome(OOM, error=too_big, plan=plan.describe())
        devices = [jax.devices()[i] for s in plan.stages for i in s.device_ids]
        local = [d for d in devices if d.process_index == jax.process_index()]  # others' stats are theirs
        losses, times, energy = measure_steps(training, job, local)
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
    return Outcome(SUCCEEDED, metrics=metrics, plan=plan.describe())


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
