"""A GPU's profile from loop-timed sections: matmul peaks, memory bandwidth, each mixer forward
and backward at a grid of widths and micro-batch sizes, and collectives across local devices."""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.optimize import nnls

from codesign.config.types import MIXERS
from codesign.engine.options import run_once_options
from codesign.engine.probe.compiles import compile_side_by_side
from codesign.engine.probe.cpu_benchmarks import dispatch_time, measured
from codesign.engine.probe.loops import INNER, LoopSizes, compiled, inner_count, loop_times, looped, own, pattern, zeros
from codesign.engine.probe.memory import device_memory, scratch_fraction, scratch_step
from codesign.engine.probe.mixers import mixer_module
from codesign.engine.probe.parts import Parts
from codesign.engine.probe.power import WindowHook, idle_windows, measured_power, metered, open_meter
from codesign.engine.programs import DTYPES
from codesign.hardware.collectives import bus_factor, link_terms
from codesign.hardware.links import Link
from codesign.hardware.profiles import (
    ENCODER_PAIR,
    GPU_ACTIVATION_SHARE,
    LAYER,
    DeviceProfile,
    Points,
    Provenance,
    Rate,
    library_versions,
)

log = logging.getLogger("codesign.profile")
FLAT_STEP_ARRAYS = 6  # what a GPU's step call takes (engine.step.FlatView): parameters, Adam's count
# and two moments, the batch's x and y (3 more a leaf kept whole, EngineOptions.whole_leaf)


def matmul_rates(sizes: LoopSizes, window: WindowHook | None = None) -> dict[str, float]:
    """FLOP/s of a square matmul per precision: bf16, and fp32 as XLA runs it (TF32 on an H100);
    `window` gets each precision's loop (compute-bound)."""
    n = sizes.matmul
    inners = [inner_count(2 * n**3)] * len(DTYPES)
    times = loop_times(compiled(looped([lambda c: (c[0], c[1], c[0] @ c[1])] * len(DTYPES), inners)),
                       matmul_carries(n), sizes.seconds, inners, window)
    return {p: 2 * n**3 / t for p, t in zip(DTYPES, times)}


def matmul_carries(n: int) -> tuple:
    """Per precision, (a, a, out) n x n in that precision's dtype (a bf16 array divided by
    np.sqrt's float64 became fp32, and fp32's TF32 was timed twice)."""
    a = jax.random.normal(jax.random.key(0), (n, n)) / n**0.5
    return tuple(own((a.astype(d), a.astype(d), jnp.zeros((n, n), d))) for d in DTYPES.values())


def stream_bytes(nbytes: int) -> int:
    """Bytes one iteration of the stream moves: the array read, and written back."""
    return 2 * nbytes


def stream_bandwidth(sizes: LoopSizes, window: WindowHook | None = None) -> float:
    """Memory bytes/s: an fp32 array of sizes.stream bytes (on a GPU far past L2) read, added
    to and written back in place, each iteration; `window` gets the loop (memory-bound)."""
    x = jnp.zeros((sizes.stream // 4,), jnp.float32)
    [seconds] = loop_times(compiled(looped([lambda c: (c[0] + 1.0,)], [INNER])), ((x,),), sizes.seconds, [INNER],
                           window)
    return stream_bytes(sizes.stream) / seconds


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


def backward_loss(module: nn.Module) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """The mixer's output against a varied cotangent (`pattern`), as a step's backward gets one: against the
    ones of a plain sum, XLA turned a GPU's bf16 skip projection's matmul gradients into row
    sums, so the profile priced them at nothing."""
    return lambda p, x, r: jnp.sum(module.apply(p, x).astype(jnp.float32) * r)


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
    are, the slope is noise, and mispriced large batches); the
    fixed cost what the smallest point adds to it."""
    def slope(points: Points) -> float:
        w1, s1 = points[-1]
        w0, s0 = next(((w, s) for w, s in points if np.isclose(w, ratio * w1, rtol=1e-6)), points[-2])
        return min(peak, (w1 - w0) / (s1 - s0) if s1 > s0 else w1 / s1)

    rate_forward, rate_backward = slope(forward), slope(backward)
    overhead = max(forward[0][1] - forward[0][0] / rate_forward, 1e-6)
    return Rate(rate_forward, rate_backward, overhead, forward, backward)


PROBED = ("all-reduce", "all-gather", "reduce-scatter")  # the collectives a profile times


def collective_body(kind: str) -> Callable[[tuple], tuple]:
    """One collective on the carry (input, output), inside shard_map over axis "d"; nccl-tests'
    size is the input of an all-reduce or reduce-scatter, the output of an all-gather."""
    ops = {"all-reduce": lambda x: lax.psum(x, "d"),
           "all-gather": lambda x: lax.all_gather(x, "d", tiled=True),
           "reduce-scatter": lambda x: lax.psum_scatter(x, "d", tiled=True)}
    return lambda c: (c[0], ops[kind](c[0]))


def collective_times(sizes: LoopSizes, window: WindowHook | None = None) -> dict[str, list[list[float]]]:
    """Per collective, (bytes, seconds) at each size, over every local device; `window` gets the
    largest all-reduce's loop (the collective nearest its bandwidth)."""
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    points = [(kind, size) for kind in PROBED for size in sizes.collectives]
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
    largest = points.index(("all-reduce", max(sizes.collectives)))
    times = loop_times(compiled(sharded), tuple(carries), sizes.seconds, inners,
                       window and (lambda i, call: window(i, call) if i == largest else None))
    found: dict[str, list[list[float]]] = {}
    for (kind, size), seconds in zip(points, times):
        found.setdefault(kind, []).append([size, seconds])
        log.info("  %s of %.3g MiB on %d devices: %.1f us, bus bandwidth %.3g B/s", kind, size / 2**20, n,
                 seconds * 1e6, size / seconds * bus_factor(kind, n))
    return found


def fitted_link(found: dict[str, list[list[float]]], n: int) -> Link:
    """The link the cost model prices these times with where it has no table (collectives.over_link):
    latency and per-device bandwidth, least squares on the relative error of every (collective, size)."""
    rows, seconds = [], []
    for kind, points in found.items():
        latencies, per_byte = link_terms(kind, n)
        for size, t in points:
            rows.append([latencies, per_byte * size])
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
        yield ("scratch", "step"), functools.partial(scratch_step(sizes.widths[0]).compile,
                                                   run_once_options(jax.default_backend()))


def loop_profile(parts: Parts, sizes: LoopSizes) -> DeviceProfile:
    """A GPU's profile (or, with small sizes, the same path on CPU) from loop-timed sections."""
    devices = jax.devices()
    device, n = devices[0], len(devices)
    meter = open_meter(device.platform, [d.local_hardware_id for d in devices], os.environ.get("CUDA_VISIBLE_DEVICES"))
    windows: dict[str, list] = {}
    peaks, windows["compute"] = metered(parts, "matmul", lambda hook: matmul_rates(sizes, hook), meter, 1)
    log.info("  matmul: %s", ", ".join(f"{p} {r:.3g} FLOP/s" for p, r in peaks.items()))
    memory, windows["memory"] = metered(parts, "bandwidth", lambda hook: stream_bandwidth(sizes, hook), meter, 1)
    log.info("  memory bandwidth: %.3g B/s (%.3g GiB read and written per iteration)", memory,
             stream_bytes(sizes.stream) / 2**30)
    windows["idle"] = parts.get("idle energy", lambda: idle_windows(meter))
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
    link = None
    if n > 1:
        times, windows["communication"] = metered(parts, "collectives", lambda hook: collective_times(sizes, hook),
                                                  meter, n)
        link = fitted_link(times, n)
        log.info("  link between local devices: %s", link)
    gpu = device.platform != "cpu"
    return DeviceProfile(kind=device.device_kind, platform="gpu" if gpu else "cpu", memory=device_memory(device),
                         rates=tuple(rates), bandwidth=memory, dispatch=dispatch,
                         activation_share=GPU_ACTIVATION_SHARE if gpu else 1.0,
                         link=link, update_scratch=parts.get("scratch", lambda: scratch_fraction(
                             programs["scratch", "step"], sizes.widths[0])),
                         roofline=False, power=measured_power(device.device_kind, windows, meter),
                         provenance=Provenance("measured", tuple(sorted(library_versions().items()))))
