"""CPU micro-benchmarks: each mixer per call, an Adam update, a program call, the speed of
several busy virtual devices, all-reduces. Each is a generator: it compiles and runs its
programs once, yields, and times them when resumed, so a profile compiles everything first and
times with the machine quiet."""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any, Callable, Generator, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from codesign.engine.options import engine_options
from codesign.engine.probe.mixers import mixer_module
from codesign.engine.probe.probe_steps import drawn, probe_params
from codesign.engine.step import loss_fn
from codesign.cost.calibration import PROBE_WIDTHS, probe_job
from codesign.cost.formulas import ADAM_TRAFFIC
from codesign.hardware.links import Link
from codesign.hardware.profiles import Rate
from codesign.zhen import counts

T = TypeVar("T")
SPEEDUP_SAMPLES = 16  # per device, in the shared-core speed-up probe (small steps: what a CPU sweep runs)
SPEEDUP_SECONDS = 0.5  # ... each device count's steps timed for this long in all
MIXER_BATCHES = (8, 128)  # micro-batch sizes each mixer is timed at (the fit scales the line through them)


def median_time(fn: Callable[[], object], repeats: int, best: bool = True, min_seconds: float = 0.0) -> float:
    """Seconds of one call: the fastest of `repeats` for micro-benchmarks (other processes only
    ever add time), the median for whole steps (what a job's median sees); with min_seconds,
    more calls until they add up to that."""
    jax.block_until_ready(fn())
    times: list[float] = []
    while len(times) < repeats or sum(times) < min_seconds:
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.min(times) if best else np.median(times))


# A CPU micro-benchmark is a generator: it compiles its programs and runs each once, yields, and
# times them when resumed, so that a profile compiles everything first (its probe children
# compiling beside it) and times with the machine quiet.
Bench = Generator[None, None, T]


def prepared(bench: Bench[T]) -> Callable[[], T]:
    """The benchmark compiled and run once now; the call returned times it."""
    next(bench)

    def timed() -> T:
        try:
            next(bench)
        except StopIteration as done:
            return done.value
        raise RuntimeError("a micro-benchmark yields once, between compiling and timing")

    return timed


def measured(bench: Bench[T]) -> T:
    return prepared(bench)()


def call_times(module: nn.Module, z: jax.Array, repeats: int) -> Bench[tuple[float, float]]:
    """(forward, backward) seconds of one module call on z: backward = forward-and-backward - forward."""
    params = jax.device_put(drawn(jax.eval_shape(lambda: module.init(jax.random.key(0), z)), 0))
    fwd = jax.jit(lambda p, x: module.apply(p, x))
    both = jax.jit(jax.grad(lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32)), argnums=(0, 1)))
    jax.block_until_ready((fwd(params, z), both(params, z)))
    yield
    forward = median_time(lambda: fwd(params, z), repeats)
    return forward, max(median_time(lambda: both(params, z), repeats) - forward, 0.05 * forward)


def mixer_times(kind: str, repeats: int) -> Bench[list[tuple[float, float]]]:
    """call_times of a kind's one-mixer layer at each of MIXER_BATCHES (fp32, probe widths)."""
    f_in, out, emb = PROBE_WIDTHS
    module, _ = mixer_module(kind, f_in, out, emb, "fp32")
    calls = [prepared(call_times(module, jax.device_put(drawn(jax.ShapeDtypeStruct((b, emb, f_in), jnp.float32), b)),
                                 repeats)) for b in MIXER_BATCHES]
    yield
    return [call() for call in calls]


def kind_rate(kind: str, times: list[tuple[float, float]], dispatch: float, peak: float) -> Rate:
    """A least-squares line through mixer_times: slope -> effective FLOP/s at the probed widths,
    activation traffic included (at most the device's matmul peak: noise can flatten a slope),
    intercept less the dispatch -> the fixed cost per call."""
    f_in, out, emb = PROBE_WIDTHS
    _, flops = mixer_module(kind, f_in, out, emb, "fp32")
    seconds = np.array(times)

    def fit(found: np.ndarray, work: float) -> tuple[float, float]:
        slope, intercept = np.polyfit(np.array(MIXER_BATCHES, float), found, 1)
        slope = max(slope, work / peak)
        return float(work / slope), float(max(intercept - dispatch, 1e-6))

    forward, overhead = fit(seconds[:, 0], flops)
    backward, _ = fit(seconds[:, 1], 2 * flops)
    return Rate(forward, backward, overhead)


def bandwidth(repeats: int, size: int = 2**21) -> Bench[float]:
    """Bytes/s of what the cost model prices as memory traffic: an Adam update of `size` fp32
    parameters with its state donated (updated in place, as the step does), ADAM_TRAFFIC
    parameter-sized arrays moved. (A large element-wise op writing a fresh output measures the
    allocator's page faults instead.)"""
    optimizer = optax.adam(1e-3)
    params = jnp.ones((size,), jnp.float32)
    grads = jnp.full((size,), 0.1, jnp.float32)

    def update(p, s, g):
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(update, donate_argnums=(0, 1))
    state = [params, optimizer.init(params)]

    def run():
        state[0], state[1] = step(state[0], state[1], grads)
        return state[0]

    jax.block_until_ready(run())
    yield
    return ADAM_TRAFFIC * 4 * size / median_time(run, repeats)


def dispatch_time(repeats: int, arrays: int = 64) -> Bench[float]:
    """One call of a compiled program taking as many arrays as a stage's parameters and state."""
    f = jax.jit(lambda xs: [x + 1.0 for x in xs])
    xs = [jnp.ones((8,)) for _ in range(arrays)]
    jax.block_until_ready(f(xs))
    yield
    return median_time(lambda: f(xs), 4 * repeats)


def speedup(repeats: int) -> Bench[tuple[float, list[tuple[int, float]]]]:
    """One device's matmul FLOP/s, and the aggregate speed of n devices each computing the
    gradients of the probe model's first layer on its own SPEEDUP_SAMPLES samples at once (a
    data-parallel step's small ops without its collectives), relative to one device. (The first
    layer alone: both would double its share of a profile's compiles.)"""
    devices = jax.devices()
    w = jax.device_put(np.ones((256, 256), np.float32))
    big = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b)
    jax.block_until_ready(big(w, w))
    job = probe_job(1, (1, 1, 1), 1, SPEEDUP_SAMPLES)
    job = replace(job, model=replace(job.model, num_zhen_layers=1, tokens=job.model.tokens[:1]))
    loss = loss_fn(job, ((0,),), False, engine_options(jax.default_backend(), job.training.precision))
    params = probe_params(job.model, (0,), job.training.seed)

    def local(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return (value + sum(jnp.sum(g) for g in jax.tree.leaves(grads)))[None]

    busy = {}
    for n in (1, 2, 4, 8):
        if n > len(devices):
            break
        mesh = Mesh(np.array(devices[:n]), ("d",))
        sharded, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
        x = jax.device_put(np.ones((n * SPEEDUP_SAMPLES, job.model.emb_dim, job.model.num_features), np.float32),
                           sharded)
        y = jax.device_put(np.ones((n * SPEEDUP_SAMPLES, counts.output_width(job.model)), np.float32), sharded)
        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P("d")))
        busy[n] = functools.partial(f, jax.device_put(params, replicated), x, y)
        jax.block_until_ready(busy[n]())
    yield
    peak = 4 * 256**3 / median_time(lambda: big(w, w), repeats)
    base, points = 0.0, []
    for n, step in busy.items():
        seconds = median_time(step, 2 * repeats, best=False, min_seconds=SPEEDUP_SECONDS)
        base = base or seconds
        points.append((n, max(1.0, n * base / seconds)))  # at worst they take turns; less is others' load
    return peak, points


def link(repeats: int) -> Bench[Link]:
    """All-reduces over every local device: a large one gives the bandwidth; the latency is the
    marginal cost of one more array in a program reducing many, as a step's gradients go on CPU,
    each array paying its own rendezvous (back to back, cheaper than a lone call's)."""
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    sharded, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    size = 2**22
    big = jax.device_put(np.ones((n, size // 4), np.float32), sharded)
    reduce = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=replicated)
    small = jax.device_put(np.ones((n, 16), np.float32), sharded)
    few, many = small_reduces(mesh, 8), small_reduces(mesh, 32)
    jax.block_until_ready((reduce(big), reduce(small)))
    yield
    reduce_small = median_time(lambda: reduce(small), repeats)
    one_call = (median_time(many, repeats) - median_time(few, repeats)) / 24
    moving = max(median_time(lambda: reduce(big), repeats) - reduce_small, 1e-9)
    return Link(2 * (n - 1) / n * size / moving, max(one_call, 1e-7) / (2 * (n - 1)))


def small_reduces(mesh: Mesh, arrays: int) -> Callable[[], Any]:
    """One program all-reducing `arrays` small arrays, as a step's gradients go on CPU, compiled
    and run once: the call runs it again."""
    n = mesh.devices.size
    xs = [jax.device_put(np.ones((n, 16 + k), np.float32), NamedSharding(mesh, P("d"))) for k in range(arrays)]
    reduce = jax.jit(lambda xs: [jnp.sum(x, axis=0) for x in xs], out_shardings=[NamedSharding(mesh, P())] * arrays)
    jax.block_until_ready(reduce(xs))
    return lambda: reduce(xs)
