"""`codesign profile`'s measurement: the devices at hand, as the cost model needs them.

Runs in its own process (`python -m codesign.engine.profile OUT.json`), the platform and the
virtual device count set in the environment before JAX starts. It times, on one device, each
ZHEN mixer's forward and backward at two micro-batch sizes (a line through them gives the
effective FLOP/s and the fixed cost per call), a memory copy (bandwidth) and a tiny program
(the host's cost per dispatch); across the local devices, the aggregate speed of 1, 2, 4, 8
devices busy at once (virtual CPU devices share the machine's cores) and an all-reduce at two
sizes (the link's bandwidth and latency). Each figure is a median of repeated timings.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import psutil
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from codesign.engine.programs import DTYPES
from codesign.engine.step import accumulate, loss_fn
from codesign.planner.profiles import LAYER, DeviceProfile, Link, Rate, library_versions
from codesign.spec.types import (
    MIXERS,
    ClusterSpec,
    Job,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
)
from codesign.zhen import counts, network

log = logging.getLogger("codesign.profile")
# Widths of the probe layer (F_in, O, D) and its two micro-batch sizes, per platform.
PROBE = {"cpu": ((32, 4, 16), (16, 256)), "gpu": ((256, 20, 160), (256, 2048))}


def median_time(fn: Callable[[], object], repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def call_times(module: nn.Module, z: jax.Array, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of one module call on z: backward = forward-and-backward - forward."""
    params = module.init(jax.random.key(0), z)
    fwd = jax.jit(lambda p, x: module.apply(p, x))
    both = jax.jit(jax.grad(lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32)), argnums=(0, 1)))
    forward = median_time(lambda: fwd(params, z), repeats)
    return forward, max(median_time(lambda: both(params, z), repeats) - forward, 0.05 * forward)


def kind_rate(kind: str, platform: str, precision: str, bandwidth: float, dispatch: float, peak: float,
              repeats: int) -> Rate:
    """A line through two micro-batch sizes: slope -> FLOP/s (the activation traffic the cost
    model adds apart taken out; at most the device's matmul peak, as noise can flatten a slope),
    intercept less the dispatch -> the fixed cost per call."""
    (f_in, out, emb), sizes = PROBE[platform]
    dtype = DTYPES[precision]
    if kind == LAYER:
        module, work = nn.Dense(f_in, dtype=dtype), counts.Work(flops=2 * emb * f_in * f_in, activations=emb * f_in)
    else:
        module, work = network.mixer(kind, _probe_spec(f_in, out, emb), dtype, kind.lower(), True), counts.mixer_work(kind, f_in, out, emb)
    points = []
    for b in sizes:
        z = jax.random.normal(jax.random.key(1), (b, emb, f_in), dtype)
        points.append(call_times(module, z, repeats))
    (f1, b1), (f2, b2) = points
    n1, n2 = sizes
    traffic = work.activations * jnp.dtype(dtype).itemsize / bandwidth

    def rate(t1: float, t2: float, flops: float, passes: int) -> tuple[float, float]:
        slope = max((t2 - t1) / (n2 - n1) - passes * traffic, flops / peak)
        return flops / slope, max(t1 - n1 * slope - dispatch, 1e-6)

    forward, overhead = rate(f1, f2, work.flops, 2)
    backward, _ = rate(b1, b2, 2 * work.flops, 4)
    return Rate(forward, backward, overhead)


def _probe_spec(f_in: int, out: int, emb: int) -> ModelSpec:
    return ModelSpec(f_in, emb, out, 1, (tuple(MIXERS),))


def bandwidth(repeats: int) -> float:
    """Bytes/s of a large element-wise op (read and write)."""
    x = jnp.ones((16 * 2**20,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001 + 1.0)
    return 2 * x.nbytes / median_time(lambda: f(x), repeats)


def dispatch_time(repeats: int) -> float:
    f = jax.jit(lambda a, b: a + b)
    a = jnp.ones((8,))
    return median_time(lambda: f(a, a), 4 * repeats)


def speedup(repeats: int) -> tuple[float, list[tuple[int, float]]]:
    """One device's matmul FLOP/s, and the aggregate speed of n devices each running the same
    matmuls at once, relative to one."""
    devices = jax.devices()
    base, points = 0.0, []
    for n in (1, 2, 4, 8):
        if n > len(devices):
            break
        mesh = Mesh(np.array(devices[:n]), ("d",))
        x = jax.device_put(jnp.ones((n * 256, 256), jnp.float32), NamedSharding(mesh, P("d")))
        w = jax.device_put(jnp.ones((256, 256), jnp.float32), NamedSharding(mesh, P()))
        f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b)
        seconds = median_time(lambda: f(x, w), repeats)
        base = base or seconds
        points.append((n, n * base / seconds))
    return 4 * 256**3 / base, points


def link(repeats: int) -> Link | None:
    """An all-reduce over every local device at two sizes, solved for latency and bandwidth."""
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        return None
    mesh = Mesh(np.array(devices), ("d",))
    times = []
    sizes = (2**10, 2**22)
    for size in sizes:
        x = jax.device_put(jnp.ones((n, size // 4), jnp.float32), NamedSharding(mesh, P("d")))
        f = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, P()))
        times.append(median_time(lambda: f(x), repeats))
    per_byte = max((times[1] - times[0]) / (sizes[1] - sizes[0]), 1e-13)
    bandwidth_ = 2 * (n - 1) / n / per_byte
    latency = max((times[0] - sizes[0] * per_byte) / (2 * (n - 1)), 1e-7)
    return Link(bandwidth_, latency)


def update_scratch(platform: str) -> float:
    """Gradient-sized scratch buffers, beyond the gradients, that XLA gives a compiled pp = 1
    training step (loss, gradients and Adam in one program, state donated), per its memory
    analysis of the probe model at one sample (activations negligible)."""
    import optax

    (f_in, out, emb), _ = PROBE[platform]
    model = ModelSpec(f_in, emb, out, 2, (tuple(MIXERS),) * 2)
    job = Job(model, ClusterSpec(1, 1, "NVLink", platform), TrainingSpec(1, 2), ParallelSpec("probe", (1,)), 1,
              platform)
    params = nn.meta.unbox(jax.eval_shape(lambda k: network.init_params(model, k), jax.random.key(0)))
    optimizer = optax.adam(1e-3)
    grad_fn = accumulate(loss_fn(job, ((0, 1),), False))

    def step(p, s, xs, ys):
        _, grads = grad_fn(p, xs, ys)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    x = jax.ShapeDtypeStruct((1, 1, emb, f_in), jnp.float32)
    y = jax.ShapeDtypeStruct((1, 1, counts.output_width(model)), jnp.float32)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, jax.eval_shape(optimizer.init, params), x, y)
    stats = compiled.compile().memory_analysis()
    param_bytes = 4 * counts.param_count(model)
    return max(float(stats.temp_size_in_bytes) / param_bytes - 1, 0.0) if stats is not None else 0.0


def device_memory(device) -> int:
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit") or psutil.virtual_memory().total)


def measure(repeats: int = 7) -> DeviceProfile:
    device = jax.devices()[0]
    platform = "cpu" if device.platform == "cpu" else "gpu"
    log.info("profiling %d %s device(s) (%s)", len(jax.devices()), platform, device.device_kind)
    bw, dispatch = bandwidth(repeats), dispatch_time(repeats)
    peak, points = speedup(repeats)
    log.info("  matmul %.3g FLOP/s, memory %.3g B/s, dispatch %.3g s; aggregate speed of n busy devices: %s",
             peak, bw, dispatch, points)
    rates = []
    for precision in ("fp32", "bf16") if platform == "gpu" else ("fp32",):
        table = []
        for kind in (*MIXERS, LAYER):
            table.append((kind, kind_rate(kind, platform, precision, bw, dispatch, peak, repeats)))
            log.info("  %s %s: %s", precision, kind, table[-1][1])
        rates.append((precision, tuple(table)))
    return DeviceProfile(kind=device.device_kind if platform == "gpu" else "cpu", platform=platform,
                         memory=device_memory(device), rates=tuple(rates), bandwidth=bw, dispatch=dispatch,
                         speedup=tuple(points) if platform == "cpu" else (), link=link(repeats),
                         update_scratch=update_scratch(platform), combines_collectives=platform == "gpu",
                         versions=tuple(sorted(library_versions().items())), source="measured")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="codesign profile: %(message)s")
    profile = measure()
    with open(argv[0], "w") as f:
        json.dump(profile.to_dict(), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
