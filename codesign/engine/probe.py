"""`codesign profile`'s measurement: the devices at hand, as the cost model needs them.

Runs in its own process (`python -m codesign.engine.probe OUT.json`), the platform and the
virtual device count set in the environment before JAX starts. Each section's result is kept in
OUT.json.parts as it comes, and a run that finds that file reuses what it holds (a profile cut
off by its timeout resumes where it stopped).

On a GPU every figure is device time, timed inside one compiled loop (per-call timing on a GPU
measures the host: 4.7e11 FLOP/s for an H100's matmul): large matmuls per precision (the peak),
a stream over an array far larger than L2 (memory bandwidth), each ZHEN mixer forward and
backward per precision at a grid of widths and micro-batch sizes (the cost model interpolates
between these points), and, with several GPUs, all-reduce, all-gather and reduce-scatter at
1 MiB-256 MiB (the link, as nccl-tests report it). Nothing is calibrated: device time is what the
cost model adds up.

On CPU the devices are virtual and share the machine's cores, so each mixer is timed per call at
two micro-batch sizes (a line gives the effective FLOP/s and the fixed cost per call), plus an
Adam update (memory bandwidth), a program call (the host's cost per dispatch), the aggregate
speed of 1, 2, 4, 8 devices busy at once, all-reduces; then the result is fitted
(planner/calibration.py) to real training steps of seven probe jobs, each timed as a sweep
runs it: in a process that sees as many virtual devices as the step uses (`--steps R`, serving
rounds of timing on request), since idle virtual devices slow the busy ones (a one-device step
beside seven idle ones took 1.17-1.4x as long). Compiling those steps is most of a CPU profile's
time (twenty probes: 340 s of a 529 s profile on a busy machine; seven pin the same five
factors). Micro-benchmarks keep their fastest time, whole steps their median.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator, Sequence, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.optimize import nnls

from codesign.engine.job import build_training, configure_jax, train_steps
from codesign.engine.options import EngineOptions, engine_options, run_once_options
from codesign.engine.programs import DTYPES, StartingValues, batch_shapes
from codesign.engine.step import accumulate, loss_fn
from codesign.planner.calibration import (
    CONTENTION,
    PROBE_WIDTHS,
    fitted_factors,
    probe_job,
    probe_jobs,
    scaled,
)
from codesign.planner.cost import ADAM_TRAFFIC
from codesign.planner.plan import make_plan
from codesign.planner.device_profiles import (
    ENCODER_PAIR,
    GPU_ACTIVATION_SHARE,
    LAYER,
    DeviceProfile,
    Link,
    Points,
    Rate,
    library_versions,
)
from codesign.run.device_env import device_env
from codesign.config.types import MIXERS, ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.zhen import counts, network

log = logging.getLogger("codesign.profile")
T = TypeVar("T")
LOOPS_ENV = "CODESIGN_PROFILE_LOOPS"  # "small": the GPU's loop-timed path on CPU, at small sizes (tests)
PAIR_ENV = "CODESIGN_PROFILE_PAIR"  # "0": the loop-timed path times ATTENTION's later widths as one encoder
SPEEDUP_SAMPLES = 16  # per device, in the shared-core speed-up probe (small steps: what a CPU sweep runs)
SPEEDUP_SECONDS = 0.5  # ... each device count's steps timed for this long in all
MIXER_BATCHES = (8, 128)  # micro-batch sizes each mixer is timed at (the fit scales the line through them)
PROBE_SECONDS = 0.9  # each probe step's timed steps in all (ten 3 ms steps moved 1.5x between runs)
PROBE_ROUNDS = 3  # ... taken in rounds over all the probes of one process
PREPARE_THREADS = 2  # this process's programs compiled two at a time (XLA compiles outside the GIL): it
# compiles the most (the micro-benchmarks, the 8-device probes), and alone on one core it was the
# profile's critical path (101 of 171 CPU-seconds, a 100 s profile) once its children were done


# -- results so far ----------------------------------------------------------------------------

class Parts:
    """The sections measured so far (name -> JSON data), written to `path` after each one (a
    temporary file, then renamed: a kill leaves the previous version whole)."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        if self.data:
            log.info("resuming from %s: %s", path, ", ".join(self.data))

    def get(self, name: str, measure: Callable[[], Any]) -> Any:
        """The section's data: kept from an earlier run, else measured now and saved."""
        if name not in self.data:
            start = time.perf_counter()
            self.data[name] = measure()
            log.info("  (%s measured in %.1f s)", name, time.perf_counter() - start)
            scratch = self.path.with_name(self.path.name + ".tmp")
            scratch.write_text(json.dumps(self.data))
            os.replace(scratch, self.path)
        return self.data[name]


# -- the loop-timed path (GPUs) -------------------------------------------------------------------

INNER = 64  # iterations per trip of an outer loop at most: a known trip count, so XLA:GPU checks
# no condition on the host inside it; the outer loop's check (once per trip) is all the timing pays
TRIP_FLOPS = 2e11  # ... fewer for a large body: about this much work a trip (under a millisecond on
# an H100, where the check costs microseconds), so that a trip of the largest (an fp32 DOT mixer's
# forward and backward at batch 1024, 5 ms) does not take 64 of them, as the first profile did
LOOP_REPEATS = 3  # short and long loops, in turn: the fastest of each
MAX_TRIPS = 1024  # outer trips of a long loop at most (a body too fast to time on its own)
FLAT_STEP_ARRAYS = 6  # what a GPU's step call takes (engine.step.FlatView): parameters, Adam's count
# and two moments, the batch's x and y (3 more a leaf kept whole, EngineOptions.whole_leaf)


@dataclass(frozen=True)
class LoopSizes:
    """What the loop-timed path measures, and for how long."""

    matmul: int  # side of the square matmuls timed for the peak
    stream: int  # bytes of the array the bandwidth probe reads and writes each iteration
    widths: tuple[tuple[int, int, int], ...]  # mixer widths (F_in, O, D) ...
    batches: tuple[int, ...]  # ... each at these micro-batch sizes
    collectives: tuple[int, ...]  # bytes per collective (nccl-tests' size)
    seconds: float  # device time each long loop aims at
    pair: bool = True  # ATTENTION past the first width: two encoders vmapped in one call (ENCODER_PAIR),
    # as the engine runs a layer's pair, in place of one encoder (PAIR_ENV=0: one; no more programs to compile)


# The seed model's layer widths (F_in 512, then 80), each at two micro-batch sizes: the points
# span a sweep's calls by FLOPs, and past the largest the cost model goes on at the marginal rate
# between that width's two sizes. (Three sizes, 32-1024: the 24 mixer programs did not compile in
# 95 s on an H100; autotuning each program's matmuls is most of it.)
GPU_LOOPS = LoopSizes(8192, 2**29, ((512, 20, 160), (80, 20, 160)), (128, 1024),
                      tuple(2**k for k in range(20, 29, 2)), 0.01)
SMALL_LOOPS = LoopSizes(  # CODESIGN_PROFILE_LOOPS=small, for tests on CPU
    128, 2**20, ((16, 4, 8), (8, 2, 8)), (4, 16), (2**12, 2**16), 0.002)


def inner_count(flops: float) -> int:
    """Iterations per trip of a body of `flops`: a power of two, 4 to INNER, about TRIP_FLOPS a trip."""
    return int(2 ** np.clip(np.floor(np.log2(TRIP_FLOPS / max(flops, 1.0))), 2, np.log2(INNER)))


def repeated(body: Callable[[Any], Any], inner: int) -> Callable[[Any], Any]:
    """`inner` iterations of body, each result behind an optimization barrier: XLA can neither fuse
    iterations, hoist the work out of the loop (the carry is opaque to it) nor drop any."""
    return lambda carry: lax.fori_loop(0, inner, lambda _, c: lax.optimization_barrier(body(c)), carry)


def looped(bodies: Sequence[Callable[[Any], Any]], inners: Sequence[int]) -> Callable[[tuple, jax.Array], tuple]:
    """One program running, for each body, trips[i] x inners[i] iterations on its carry: every
    point of a section compiles once, and is timed alone by giving the others no trips."""
    def run(carries: tuple, trips: jax.Array) -> tuple:
        return tuple(lax.fori_loop(0, trips[i], lambda _, c, inner=repeated(body, n): inner(c), carry)
                     for i, (body, n, carry) in enumerate(zip(bodies, inners, carries)))

    return run


def loop_times(run: Callable[[tuple, jax.Array], tuple], carries: tuple, seconds: float,
               inners: Sequence[int]) -> list[float]:
    """Seconds per iteration of each loop of `run` (compiled, carries donated; inners: the
    iterations per trip of each): (wall of a long loop - wall of one trip) / the iterations
    between them, so the launch and the sync cancel; each loop long enough for `seconds` of
    device time, the fastest of LOOP_REPEATS."""
    state, count = [carries], len(carries)

    def wall(i: int, trips: int) -> float:
        start = time.perf_counter()
        state[0] = run(state[0], jnp.array([trips if j == i else 0 for j in range(count)], jnp.int32))
        jax.block_until_ready(state[0])
        return time.perf_counter() - start

    wall(-1, 0)  # compile
    found = []
    for i in range(count):
        wall(i, 1)  # warm up
        trips = 1
        while True:  # longer until the fastest of each reach the aim (one slow long call stopped it at
            # 1 trip, where the fastest pair then differed by nothing: 3e19 FLOP/s on CPU); never past 4x
            pairs = [(wall(i, 1), wall(i, 1 + trips)) for _ in range(LOOP_REPEATS)]
            short, long = min(p[0] for p in pairs), min(p[1] for p in pairs)
            if long - short >= seconds or trips >= MAX_TRIPS:
                break
            trips *= 4
        found.append(max(long - short, 1e-12) / (trips * inners[i]))
    return found


def compiled(run: Callable[[tuple, jax.Array], tuple]) -> Callable[[tuple, jax.Array], tuple]:
    return jax.jit(run, donate_argnums=0)


def own(tree: Any) -> Any:
    """A copy of every array of a carry: carries are donated, and none may share a buffer."""
    return jax.tree.map(jnp.copy, tree)


def matmul_rates(sizes: LoopSizes) -> dict[str, float]:
    """FLOP/s of a square matmul per precision: bf16, and fp32 as XLA runs it (TF32 on an H100)."""
    n = sizes.matmul
    inners = [inner_count(2 * n**3)] * len(DTYPES)
    times = loop_times(compiled(looped([lambda c: (c[0], c[1], c[0] @ c[1])] * len(DTYPES), inners)),
                       matmul_carries(n), sizes.seconds, inners)
    return {p: 2 * n**3 / t for p, t in zip(DTYPES, times)}


def matmul_carries(n: int) -> tuple:
    """Per precision, (a, a, out) n x n in that precision's dtype (a bf16 array divided by
    np.sqrt's float64 became fp32: the first H100 profile timed TF32 twice)."""
    a = jax.random.normal(jax.random.key(0), (n, n)) / n**0.5
    return tuple(own((a.astype(d), a.astype(d), jnp.zeros((n, n), d))) for d in DTYPES.values())


def stream_bytes(nbytes: int) -> int:
    """Bytes one iteration of the stream moves: the array read, and written back."""
    return 2 * nbytes


def stream_bandwidth(sizes: LoopSizes) -> float:
    """Memory bytes/s: an fp32 array of sizes.stream bytes (on a GPU far past L2) read, added
    to and written back in place, each iteration."""
    x = jnp.zeros((sizes.stream // 4,), jnp.float32)
    [seconds] = loop_times(compiled(looped([lambda c: (c[0] + 1.0,)], [INNER])), ((x,),), sizes.seconds, [INNER])
    return stream_bytes(sizes.stream) / seconds


def mixer_module(kind: str, f_in: int, out: int, emb: int, precision: str) -> tuple[nn.Module, float]:
    """The module timed for a kind, and its FLOPs per sample: a one-mixer ZHEN layer (for
    ENCODER_PAIR a layer of two ATTENTION mixers) built as the engine builds it here, or for LAYER
    the layer's own (skip projection) work."""
    dtype = DTYPES[precision]
    if kind == LAYER:
        return nn.Dense(f_in, dtype=dtype), 2 * emb * f_in * f_in
    options = engine_options(jax.default_backend(), precision)
    if kind == ENCODER_PAIR:
        return (OneMixerLayer(("ATTENTION", "ATTENTION"), f_in, out, emb, options, dtype),
                2 * counts.mixer_work("ATTENTION", f_in, out, emb).flops)
    return OneMixerLayer((kind,), f_in, out, emb, options, dtype), counts.mixer_work(kind, f_in, out, emb).flops


@dataclass
class MixerSection:
    """One kind and precision of mixer: a program timing it forward and forward-and-backward at
    each width and micro-batch size, lowered on abstract carries (compiled before any is made)."""

    lowered: Any  # jax.stages.Lowered: (carries, trips) -> carries
    init: Any  # jax.stages.Lowered: () -> the carries (one program: made eagerly, op by op, they took
    # longer to compile than the loop)
    work: list[float]  # FLOPs of each point's forward call
    inners: list[int]  # iterations per trip of each body (forward, forward-and-backward, per point)
    kinds: list[str]  # the rate each point is a point of: the section's kind, or ENCODER_PAIR


def timed_kind(kind: str, index: int, sizes: LoopSizes) -> str:
    """What a section times at its index-th width: the kind, but with sizes.pair ATTENTION's later widths as a pair."""
    return ENCODER_PAIR if sizes.pair and kind == "ATTENTION" and index > 0 else kind


def mixer_section(kind: str, precision: str, sizes: LoopSizes) -> MixerSection:
    dtype, bodies, makers, work, inners, kinds = DTYPES[precision], [], [], [], [], []
    for index, widths in enumerate(sizes.widths):
        timed = timed_kind(kind, index, sizes)
        module, flops = mixer_module(timed, *widths, precision)
        loss = jax.grad(backward_loss(module), argnums=(0, 1))
        for batch in sizes.batches:
            z = jax.ShapeDtypeStruct((batch, widths[2], widths[0]), dtype)
            params = jax.eval_shape(module.init, jax.random.key(0), z)
            out = jax.eval_shape(module.apply, params, z)
            grads = jax.eval_shape(loss, params, z, jax.ShapeDtypeStruct(out.shape, jnp.float32))

            def carry(backward, params=params, z=z, out=out, grads=grads):
                leaves, tree = jax.tree.flatten(params)
                values = (jax.tree.unflatten(tree, [pattern(p, i, 0.05) for i, p in enumerate(leaves)]), pattern(z, -1))
                if not backward:
                    return *values, jnp.zeros(out.shape, out.dtype)
                return *values, pattern(out, -2, dtype=jnp.float32), jax.tree.map(zeros, grads)

            bodies += [lambda c, m=module: (c[0], c[1], m.apply(c[0], c[1])),
                       lambda c, g=loss: (c[0], c[1], c[2], g(c[0], c[1], c[2]))]
            makers += [functools.partial(carry, False), functools.partial(carry, True)]
            work.append(batch * flops)
            kinds.append(timed)
            inners += [inner_count(batch * flops), inner_count(3 * batch * flops)]
    init = jax.jit(lambda: tuple(make() for make in makers), compiler_options=run_once_options(jax.default_backend()))
    lowered = compiled(looped(bodies, inners)).lower(jax.eval_shape(init),
                                                     jax.ShapeDtypeStruct((len(makers),), jnp.int32))
    return MixerSection(lowered, init.lower(), work, inners, kinds)


def pattern(like: Any, seed: int, scale: float = 1.0, dtype: Any = None) -> jax.Array:
    """Values of `like`'s shape (and dtype), uniform in [-scale, scale), from an integer hash of
    each index (lowbias32) instead of JAX's random generator: the init programs drawing the model's
    random initialisers had 3-4x the fusions (201 for ATTENTION's) and took 5x as long to compile
    on CPU. The bits still look random: a GPU's matmul can draw less power, and so run faster, on
    smooth or sparse data than on the data a step sees."""
    x = jnp.arange(math.prod(like.shape), dtype=jnp.uint32) + jnp.uint32((seed * 0x9E3779B9) % 2**32)
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = (x ^ (x >> shift)) * jnp.uint32(factor)
    x = x ^ (x >> 16)
    values = ((x >> 8).astype(jnp.float32) * 2.0**-23 - 1.0) * scale
    return values.reshape(like.shape).astype(dtype or like.dtype)


def zeros(like: Any) -> jax.Array:
    return jnp.zeros(like.shape, like.dtype)


def backward_loss(module: nn.Module) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """The mixer's output against a varied cotangent (`pattern`), as a step's backward gets one: against the
    ones of a plain sum, XLA turned an H100's bf16 skip projection's matmul gradients into row
    sums (14 us for 1.7e11 FLOPs), so the profile priced them at nothing."""
    return lambda p, x, r: jnp.sum(module.apply(p, x).astype(jnp.float32) * r)


def compile_side_by_side(compiles: Iterable[tuple[Any, Callable[[], Any]]]) -> dict[Any, Any]:
    """Each program compiled (`compiles`: (name, a lowered program's compile, options bound)), several
    at once: XLA compiles (and autotunes) outside the GIL, and on a GPU compiling is most of a
    profile's time (one section after another, the two DOT sections alone took 80 s on an H100).
    Each is compiled as soon as `compiles` yields it: the next is traced while it compiles."""
    start, cpu, spans = time.perf_counter(), cpu_seconds(), {}

    def compile_one(name: Any, compile_program: Callable[[], Any]) -> Any:
        begin = time.perf_counter()
        done = compile_program()
        spans[name] = (begin - start, time.perf_counter() - begin)
        return done

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(compile_one, name, program) for name, program in compiles}
        done = {name: future.result() for name, future in futures.items()}
    if done:
        wall = time.perf_counter() - start
        log.info("  (%d programs compiled side by side in %.1f s, %s; %s)", len(done), wall,
                 cores_busy(cpu_seconds() - cpu, wall), compile_spans(spans))
    return done


def cpu_seconds() -> float:
    """CPU seconds of this process's threads and its finished children (a compiler run as a subprocess)."""
    return sum(os.times()[:4])


def cores_busy(cpu: float, wall: float) -> str:
    """How busy the cores were over `wall`: at the core count, the compiles wait on the CPU; near one,
    on something else (a lock, or autotuning's timed runs on the one GPU)."""
    return f"{cpu:.0f} CPU-s: {cpu / max(wall, 1e-9):.1f} of {os.cpu_count()} cores busy"


def compile_spans(spans: dict[Any, tuple[float, float]]) -> str:
    """Each program's start and compile seconds, in the order they finished: programs that end one
    after another at even steps, each waiting from the start, say that their compiles were serialised."""
    ordered = sorted(spans.items(), key=lambda item: sum(item[1]))
    return "in the order done, start+seconds: " + ", ".join(
        f"{' '.join(name)} {begin:.1f}+{seconds:.1f}" for name, (begin, seconds) in ordered)


def mixer_points(programs: tuple[Callable, Callable], section: MixerSection, sizes: LoopSizes) -> dict[str, Any]:
    """(FLOPs of one call, seconds) forward and backward (the call's backward FLOPs: twice the
    forward's, as the cost model counts them) at each width and micro-batch size, an encoder
    pair's (sizes.pair) under "pair"; programs: the section's loop and init, compiled."""
    loop, init = programs
    times = loop_times(loop, own(init()), sizes.seconds, section.inners)
    forward, both = np.array(times[0::2]), np.array(times[1::2])
    backward = np.maximum(both - forward, 0.05 * forward)

    def points(kind: str) -> dict[str, Points]:
        order = sorted((w, i) for i, (w, k) in enumerate(zip(section.work, section.kinds)) if k == kind)
        return {"forward": monotone([(w, forward[i]) for w, i in order]),
                "backward": monotone([(2 * w, backward[i]) for w, i in order])}

    found: dict[str, Any] = points(section.kinds[0])
    if ENCODER_PAIR in section.kinds:
        found["pair"] = points(ENCODER_PAIR)
    return found


def monotone(points: list[tuple[float, float]]) -> Points:
    """Points with seconds made non-decreasing in FLOPs (one width's call can be slower than
    another's with a few more FLOPs: interpolation keeps the larger)."""
    seconds = np.maximum.accumulate([s for _, s in points])
    return tuple((float(w), float(s)) for (w, _), s in zip(points, seconds))


def points_rate(forward: Points, backward: Points, peak: float, ratio: float) -> Rate:
    """A Rate carrying the points: FLOP/s past the largest (the cost model goes on at it; at most
    the matmul peak), the marginal rate between it and its width's smallest micro-batch, the
    point of `ratio` times its FLOPs (between two widths of about the same FLOPs, as ATTENTION's
    are, the slope is noise: it priced the seed step at batch 4096 60% over on an H200); the
    fixed cost what the smallest point adds to it."""
    def slope(points: Points) -> float:
        w1, s1 = points[-1]
        w0, s0 = next(((w, s) for w, s in points if np.isclose(w, ratio * w1, rtol=1e-6)), points[-2])
        return min(peak, (w1 - w0) / (s1 - s0) if s1 > s0 else w1 / s1)

    rate_forward, rate_backward = slope(forward), slope(backward)
    overhead = max(forward[0][1] - forward[0][0] / rate_forward, 1e-6)
    return Rate(rate_forward, rate_backward, overhead, forward, backward)


# nccl-tests: bus bandwidth = algorithm bandwidth (size / time) x this, per collective over n devices
BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n}
RING_STEPS = {"all-reduce": lambda n: 2 * (n - 1), "all-gather": lambda n: n - 1, "reduce-scatter": lambda n: n - 1}


def collective_body(kind: str) -> Callable[[tuple], tuple]:
    """One collective on the carry (input, output), inside shard_map over axis "d"; nccl-tests'
    size is the input of an all-reduce or reduce-scatter, the output of an all-gather."""
    ops = {"all-reduce": lambda x: lax.psum(x, "d"),
           "all-gather": lambda x: lax.all_gather(x, "d", tiled=True),
           "reduce-scatter": lambda x: lax.psum_scatter(x, "d", tiled=True)}
    return lambda c: (c[0], ops[kind](c[0]))


def collective_times(sizes: LoopSizes) -> dict[str, list[list[float]]]:
    """Per collective, (bytes, seconds) at each size, over every local device."""
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    points = [(kind, size) for kind in BUS_FACTOR for size in sizes.collectives]
    carries = []
    for kind, size in points:
        local = size // 4 // (n if kind == "all-gather" else 1)
        x = jnp.ones((n * local,), jnp.float32)
        out = {"all-reduce": local, "all-gather": n * local, "reduce-scatter": local // n}[kind]
        carries.append(jax.device_put((x, jnp.zeros((n * out,), jnp.float32)), NamedSharding(mesh, P("d"))))
    inners = [INNER] * len(points)
    run = looped([collective_body(kind) for kind, _ in points], inners)
    specs = tuple((P("d"), P("d")) for _ in points)
    sharded = jax.shard_map(run, mesh=mesh, in_specs=(specs, P()), out_specs=specs, check_vma=False)
    times = loop_times(compiled(sharded), tuple(carries), sizes.seconds, inners)
    found: dict[str, list[list[float]]] = {}
    for (kind, size), seconds in zip(points, times):
        found.setdefault(kind, []).append([size, seconds])
        log.info("  %s of %.3g MiB on %d devices: %.1f us, bus bandwidth %.3g B/s", kind, size / 2**20, n,
                 seconds * 1e6, size / seconds * BUS_FACTOR[kind](n))
    return found


def fitted_link(found: dict[str, list[list[float]]], n: int) -> Link:
    """The link the cost model's alpha-beta collectives price these times with: per-step latency
    and per-device bandwidth, least squares on the relative error of every (collective, size)."""
    rows, seconds = [], []
    for kind, points in found.items():
        for size, t in points:
            rows.append([RING_STEPS[kind](n), BUS_FACTOR[kind](n) * size])
            seconds.append(t)
    weights = 1 / np.array(seconds)
    (latency, inverse), _ = nnls(np.array(rows) * weights[:, None], np.ones(len(seconds)))
    return Link(1 / max(inverse, 1e-15), max(latency, 1e-7))


def lowered_programs(parts: Parts, sizes: LoopSizes,
                     sections: dict[str, MixerSection]) -> Iterator[tuple[tuple[str, str], Callable[[], Any]]]:
    """The compiles of the mixer sections not yet in `parts` (each section kept in `sections` as it
    is lowered) and of the scratch step, whose memory analysis alone is read."""
    lowering = 0.0
    for precision in DTYPES:
        for kind in (*MIXERS, LAYER):
            name = f"{precision} {kind}"
            if name in parts.data:
                continue
            begin = time.perf_counter()
            sections[name] = section = mixer_section(kind, precision, sizes)
            lowering += time.perf_counter() - begin
            yield (name, "lowered"), section.lowered.compile
            yield (name, "init"), section.init.compile
    log.info("  (%d mixer sections traced and lowered in %.1f s, beside the compiles)", len(sections), lowering)
    if "scratch" not in parts.data:
        yield ("scratch", "step"), functools.partial(scratch_step(sizes.widths[0]).compile, run_once_options(jax.default_backend()))


def loop_profile(parts: Parts, sizes: LoopSizes) -> DeviceProfile:
    """A GPU's profile (or, with small sizes, the same path on CPU) from loop-timed sections."""
    device, n = jax.devices()[0], len(jax.devices())
    peaks = parts.get("matmul", lambda: matmul_rates(sizes))
    log.info("  matmul: %s", ", ".join(f"{p} {r:.3g} FLOP/s" for p, r in peaks.items()))
    memory = parts.get("bandwidth", lambda: stream_bandwidth(sizes))
    log.info("  memory bandwidth: %.3g B/s (%.3g GiB read and written per iteration)", memory,
             stream_bytes(sizes.stream) / 2**30)
    dispatch = parts.get("dispatch", lambda: measured(dispatch_time(5, FLAT_STEP_ARRAYS)))
    log.info("  dispatch: %.1f us per call of a program of %d arrays", dispatch * 1e6, FLAT_STEP_ARRAYS)
    sections: dict[str, MixerSection] = {}
    programs = compile_side_by_side(lowered_programs(parts, sizes, sections))
    rates = []
    for precision in DTYPES:
        table = []
        for kind in (*MIXERS, LAYER):
            name = f"{precision} {kind}"
            found = parts.get(name, lambda: mixer_points((programs[name, "lowered"], programs[name, "init"]),
                                                         sections[name], sizes))
            for rated, points in ((kind, found), (ENCODER_PAIR, found.get("pair"))):
                if points:
                    table.append((rated, points_rate(*(tuple(map(tuple, points[k])) for k in ("forward", "backward")),
                                                     peaks[precision], sizes.batches[0] / sizes.batches[-1])))
                    log.info("  %s %s: %s", precision, rated, table[-1][1])
        rates.append((precision, tuple(table)))
    link = fitted_link(parts.get("collectives", lambda: collective_times(sizes)), n) if n > 1 else None
    if link is not None:
        log.info("  link between local devices: %s", link)
    gpu = device.platform != "cpu"
    return DeviceProfile(kind=device.device_kind, platform="gpu" if gpu else "cpu", memory=device_memory(device),
                         rates=tuple(rates), bandwidth=memory, dispatch=dispatch,
                         activation_share=GPU_ACTIVATION_SHARE if gpu else 1.0,
                         link=link, update_scratch=parts.get("scratch", lambda: scratch_fraction(
                             programs["scratch", "step"], sizes.widths[0])),
                         roofline=False, versions=tuple(sorted(library_versions().items())), source="measured")


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


class OneMixerLayer(nn.Module):
    """ZHEN's first layer holding these mixers (one, or an encoder pair): what the profile times
    for a kind (the model's own code path: a LINEAR or ATTENTION mixer's feature FC runs in the layer)."""

    kinds: tuple[str, ...]
    f_in: int
    out: int
    emb: int
    options: EngineOptions
    dtype: Any

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        spec = ModelSpec(self.f_in, self.emb, self.out, 1, (self.kinds,))
        return network.ZhenBlock(spec, 0, self.options, self.dtype)((z, None))[1]


def bandwidth(repeats: int, size: int = 2**21) -> Bench[float]:
    """Bytes/s of what the cost model prices as memory traffic: an Adam update of `size` fp32
    parameters with its state donated (updated in place, as the step does), ADAM_TRAFFIC
    parameter-sized arrays moved. (A large element-wise op writing a fresh output measures the
    allocator's page faults instead: 1.6 GB/s here against 30-40 GB/s for this update.)"""
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
    data-parallel step's small ops without its collectives), relative to one device. (Both
    layers: 19-21 CPU-seconds of compiles, a seventh of a profile's; the first alone, 10-14.)"""
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
    each array paying its own rendezvous (XLA:CPU: 6-9 us per ring step back to back, against
    14-22 us for a lone call)."""
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


class LocalProbes:
    """Probe steps compiled in this process, timed a round at a time, as a job times its steps."""

    def __init__(self, jobs: list[Job], repeats: int, pool: ThreadPoolExecutor | None = None):
        self.trainings = list((pool.map if pool else map)(warmed_training, jobs))
        self.steps = max(1, 2 * repeats // PROBE_ROUNDS)

    def round(self) -> list[list[float]]:
        """Each step's wall times over PROBE_SECONDS / PROBE_ROUNDS."""
        return [train_steps(training, self.steps, PROBE_SECONDS / PROBE_ROUNDS)[1] for training in self.trainings]


def warmed_training(job: Job) -> Any:
    """The job's training step compiled and run once (the first run's allocations, not timed)."""
    training = build_training(job, make_plan(job), PROBE_VALUES)
    train_steps(training, 1)
    return training


def probe_params(model: ModelSpec, layers: tuple[int, ...], seed: int) -> dict:
    """A stage's parameters drawn on the host, at their shapes and dtypes: the model's
    initialisation program (its random draws unroll into ~500 fusions) was 14 of a CPU profile's
    compiles (18 CPU-seconds of them on the 1- and 8-device probes alone)."""
    return drawn(jax.eval_shape(lambda: network.init_params(model, jax.random.key(0), layers=layers)), seed)


def probe_batch(job: Job, micro_batches: int, x_sharding: NamedSharding, y_sharding: NamedSharding
                ) -> tuple[jax.Array, jax.Array]:
    """synthetic_batch's shapes and placement, drawn on the host (its two programs: 22 compiles)."""
    x, y = drawn(batch_shapes(job, micro_batches), job.training.seed)
    return jax.device_put(x, x_sharding), jax.device_put(y, y_sharding)


PROBE_VALUES = StartingValues(probe_params, probe_batch)  # a probe step is timed, never compared


def drawn(shapes: Any, seed: int) -> Any:
    """Values for a tree of abstract (possibly boxed) arrays, drawn on the host: nothing compiled.
    NumPy arrays (placed on a sharded layout, a device array is sliced by a compiled program):
    place them before timing calls on them, or each call copies them in."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(a.dtype), nn.meta.unbox(shapes))


class ChildProbes:
    """own_probe_jobs(devices) compiled in a child process that sees that many CPU devices (as a
    sweep's job on them does), timed a round at a time when asked; between rounds it waits."""

    def __init__(self, devices: int, repeats: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "codesign.engine.probe", "--steps", str(repeats)],
                                     env=device_env(os.environ, "cpu", devices), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.devices = devices

    def ready(self) -> None:
        seen = self._reply()["devices"]
        if seen != self.devices:
            raise RuntimeError(f"the probe child saw {seen} devices, not {self.devices}")

    def round(self) -> list[list[float]]:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._reply()["times"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the probe child on {self.devices} device(s) exited with {self.proc.wait()}")
        return json.loads(line)


def probe_step_times(jobs: list[Job], local: LocalProbes, children: list[ChildProbes]) -> list[float]:
    """The probe steps' median seconds, every group compiled (`local`: the steps on all devices;
    each child's: those on the n it sees, as a sweep's job on n devices does). Every group is
    timed in PROBE_ROUNDS rounds, one group at a time, so that all of them see the same mix of
    the machine's drifting speed (8-device probes timed a minute after the others ran 1.3x
    slower, and the fit read that as contention)."""
    groups: dict[int, LocalProbes | ChildProbes] = {len(jax.devices()): local}
    groups.update((child.devices, child) for child in children)
    pooled: dict[int, list[list[float]]] = {}
    for _ in range(PROBE_ROUNDS):
        for n, group in groups.items():
            times = group.round()
            pooled[n] = [a + b for a, b in zip(pooled.get(n, [[] for _ in times]), times)]
    medians = {n: iter(float(np.median(t)) for t in times) for n, times in pooled.items()}
    found = [next(medians[job.cluster.num_devices]) for job in jobs]
    for job, seconds in zip(jobs, found):
        log.info("  probe step on %d device(s), (pp, dp, op) = %s, %d micro-batch(es) of %d: %.3g s",
                 job.cluster.num_devices, job.parallel.pp_dp_op, job.num_micro_batches,
                 job.global_batch // job.num_micro_batches, seconds)
    return found


def own_probe_jobs(devices: int) -> list[Job]:
    return [j for j in probe_jobs(devices) if j.cluster.num_devices == devices]


def serve_probes(repeats: int) -> None:
    """The child's side of ChildProbes: compile, say how many devices it sees, then time a round
    for each line read until stdin closes."""
    probes = LocalProbes(own_probe_jobs(len(jax.devices())), repeats)
    print(json.dumps({"devices": len(jax.devices())}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"times": probes.round()}), flush=True)


def device_memory(device) -> int:
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit") or psutil.virtual_memory().total)


def cpu_profile(parts: Parts, repeats: int = 5) -> DeviceProfile:
    """Virtual CPU devices: micro-benchmarks per call, then fitted to real training steps of the
    probe models (kernels probed one by one are not a compiled step: fused, scheduled together,
    laid out for it). Every program is compiled first, the children's probe steps beside this
    process's micro-benchmarks and probe steps, and nothing is timed before all are: the
    compiles fill both cores, and no timing sees a compile (timed while the children compiled,
    a profile priced a cost sweep at 48% median time error against 21%)."""
    n = len(jax.devices())
    jobs = probe_jobs(n)
    steps = "probe steps" not in parts.data
    apart = sorted({j.cluster.num_devices for j in jobs} - {n}) if steps else []
    children = [ChildProbes(devices, repeats) for devices in apart]
    try:
        with ThreadPoolExecutor(max_workers=PREPARE_THREADS) as pool:
            pending = {name: pool.submit(prepared, bench) for name, bench in micro_benchmarks(repeats).items()
                       if name not in parts.data}
            scratch = pool.submit(update_scratch, PROBE_WIDTHS) if "scratch" not in parts.data else None
            local = (LocalProbes([j for j in jobs if j.cluster.num_devices not in apart], repeats, pool)
                     if steps else None)
            benches = {name: future.result() for name, future in pending.items()}
        parts.get("scratch", lambda: scratch.result())
        for child in children:
            child.ready()
        probed = probed_cpu(parts, benches)
        found = parts.get("probe steps", lambda: probe_step_times(jobs, local, children))
    finally:
        for child in children:
            child.close()
    factors = fitted_factors(probed, jobs, found)
    log.info("  fitted factors: %s", ", ".join(f"{k} x {v:.2f}" for k, v in factors.items()))
    profile = scaled(probed, factors)
    log.info("  calibrated on real steps: memory %.3g B/s, link %s, %.2f gradient copies per all-reduce",
             profile.bandwidth, profile.link, profile.sync_traffic)
    return profile


def micro_benchmarks(repeats: int) -> dict[str, Bench[Any]]:
    """The CPU profile's micro-benchmarks by section, none started."""
    benches: dict[str, Bench[Any]] = {
        "bandwidth": bandwidth(repeats), "dispatch": dispatch_time(repeats), "call": dispatch_time(repeats, 2),
        "speedup": speedup(repeats), **{f"fp32 {kind}": mixer_times(kind, repeats) for kind in (*MIXERS, LAYER)}}
    if len(jax.devices()) > 1:
        benches["link"] = link(repeats)
    return benches


def probed_cpu(parts: Parts, benches: dict[str, Callable[[], Any]]) -> DeviceProfile:
    """The micro-benchmarks' profile, before the fit (benches: those not in parts, prepared)."""
    memory, dispatch, call = (parts.get(name, benches.get(name)) for name in ("bandwidth", "dispatch", "call"))
    peak, points = parts.get("speedup", benches.get("speedup"))
    log.info("  matmul %.3g FLOP/s, memory %.3g B/s, dispatch %.3g s; aggregate speed of n busy devices: %s",
             peak, memory, dispatch, points)
    table = []
    for kind in (*MIXERS, LAYER):
        name = f"fp32 {kind}"
        table.append((kind, Rate.from_dict(parts.get(name, lambda: kind_rate(kind, benches[name](), call,
                                                                              peak).to_dict()))))
        log.info("  %s: %s", name, table[-1][1])
    found = parts.get("link", lambda: vars(benches["link"]()) if "link" in benches else None)
    return DeviceProfile(kind="cpu", platform="cpu", memory=device_memory(jax.devices()[0]),
                         rates=(("fp32", tuple(table)),), bandwidth=memory, dispatch=dispatch,
                         speedup=tuple(map(tuple, points)), link=Link(**found) if found else None,
                         update_scratch=parts.data["scratch"], combines_collectives=False, sync_traffic=1.0,
                         contention=CONTENTION, roofline=False, cores=host_cores(),
                         versions=tuple(sorted(library_versions().items())), source="measured")


def host_cores() -> int:
    """The cores this process may run on, which its virtual devices share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure(out: Path) -> DeviceProfile:
    """The local devices' profile; sections so far in OUT.json.parts (removed once OUT.json is whole)."""
    device = jax.devices()[0]
    log.info("profiling %d %s device(s) (%s)", len(jax.devices()), device.platform, device.device_kind)
    parts = Parts(out.with_name(out.name + ".parts"))
    if device.platform == "cpu" and os.environ.get(LOOPS_ENV) != "small":
        return cpu_profile(parts)
    return loop_profile(parts, loop_sizes(device.platform))


def loop_sizes(platform: str) -> LoopSizes:
    """The GPU's sizes (small ones on CPU, for tests); ATTENTION's later widths timed as the pair the engine
    calls (on an H200 the CLI's median error was 6.3% with it, 7.4% without, p90 10.9% against 17.4%)."""
    sizes = GPU_LOOPS if platform != "cpu" else SMALL_LOOPS
    return replace(sizes, pair=os.environ.get(PAIR_ENV, "1") != "0")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="codesign profile: %(message)s")
    configure_jax(os.environ.get("CODESIGN_CACHE_DIR"))  # the probe children's steps too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the micro-benchmarks' small
    # programs too: a profile run again compiles from the cache
    if argv[0] == "--steps":
        serve_probes(int(argv[1]))
        return 0
    out = Path(argv[0])
    start = time.perf_counter()
    profile = measure(out)
    out.write_text(json.dumps(profile.to_dict()))
    out.with_name(out.name + ".parts").unlink(missing_ok=True)
    log.info("profiled in %.1f s", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
