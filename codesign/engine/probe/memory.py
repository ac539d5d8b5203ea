"""What a device holds: its memory, and the scratch XLA gives a training step's update."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import psutil

from codesign.config.types import MIXERS, ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.engine.options import engine_options, run_once_options
from codesign.engine.step import accumulate, loss_fn
from codesign.zhen import counts, network


def device_memory(device) -> int:
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit") or psutil.virtual_memory().total)


def update_scratch(widths: tuple[int, int, int]) -> float:
    """Gradient-sized scratch buffers, beyond the gradients, that XLA gives a compiled pp = 1
    training step (loss, gradients and Adam in one program, state donated), per its memory
    analysis of the probe model at one sample (activations negligible), without a DOT mixer
    (the cost model counts the folded DOT's backward scratch apart)."""
    return scratch_fraction(scratch_step(widths).compile(run_once_options(jax.default_backend())), widths)


def scratch_model(widths: tuple[int, int, int]) -> ModelSpec:
    f_in, out, emb = widths
    return ModelSpec(f_in, emb, out, 2, (tuple(m for m in MIXERS if m != "DOT"),) * 2)


def scratch_fraction(compiled: Any, widths: tuple[int, int, int]) -> float:
    """update_scratch from the compiled scratch_step (buffers are assigned before the backend)."""
    stats = compiled.memory_analysis()
    param_bytes = 4 * counts.param_count(scratch_model(widths))
    return max(float(stats.temp_size_in_bytes) / param_bytes - 1, 0.0) if stats is not None else 0.0


def scratch_step(widths: tuple[int, int, int]) -> Any:
    """update_scratch's training step, lowered on abstract arrays."""
    f_in, _, emb = widths
    platform = "cpu" if jax.devices()[0].platform == "cpu" else "gpu"
    model = scratch_model(widths)
    job = Job(model, ClusterSpec(1, 1, "NVLink", platform), TrainingSpec(1, 2), ParallelSpec("probe", (1,)), 1,
              platform)
    params = nn.meta.unbox(jax.eval_shape(lambda k: network.init_params(model, k), jax.random.key(0)))
    optimizer = optax.adam(1e-3)
    grad_fn = accumulate(loss_fn(job, ((0, 1),), False, engine_options(platform, job.training.precision)))

    def step(p, s, xs, ys):
        _, grads = grad_fn(p, xs, ys)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    x = jax.ShapeDtypeStruct((1, 1, emb, f_in), jnp.float32)
    y = jax.ShapeDtypeStruct((1, 1, counts.output_width(model)), jnp.float32)
    return jax.jit(step, donate_argnums=(0, 1)).lower(params, jax.eval_shape(optimizer.init, params), x, y)
