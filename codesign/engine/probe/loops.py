"""Work timed inside one compiled loop: one sync for many iterations, so a GPU's figures are
device time (per-call timing on a GPU measures the host), and the sizes each loop runs at."""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PAIR_ENV = "CODESIGN_PROFILE_PAIR"  # "0": the loop-timed path times ATTENTION's later widths as one encoder

INNER = 64  # iterations per trip of an outer loop at most: a known trip count, so XLA:GPU checks
# no condition on the host inside it; the outer loop's check (once per trip) is all the timing pays
TRIP_FLOPS = 2e11  # ... fewer for a large body: about this much work a trip (well under the check's
# cost on a GPU), so that a trip of the largest body does not take INNER of them
LOOP_REPEATS = 3  # short and long loops, in turn: the fastest of each
MAX_TRIPS = 1024  # outer trips of a long loop at most (a body too fast to time on its own)


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
# between that width's two sizes (more sizes: more programs, whose matmuls a GPU autotunes).
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
               inners: Sequence[int], window: Callable[[int, Callable[[], float]], None] | None = None) -> list[float]:
    """Seconds per iteration of each loop of `run` (compiled, carries donated; inners: the
    iterations per trip of each): (wall of a long loop - wall of one trip) / the iterations
    between them, so the launch and the sync cancel; each loop long enough for `seconds` of
    device time, the fastest of LOOP_REPEATS. `window` (an energy meter's) is handed each loop,
    once timed, with a call of its long run to repeat."""
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
        while True:  # longer until the fastest of each reach the aim (one slow long call must not
            # stop it where the fastest pair differ by nothing)
            pairs = [(wall(i, 1), wall(i, 1 + trips)) for _ in range(LOOP_REPEATS)]
            short, long = min(p[0] for p in pairs), min(p[1] for p in pairs)
            if long - short >= seconds or trips >= MAX_TRIPS:
                break
            trips *= 4
        found.append(max(long - short, 1e-12) / (trips * inners[i]))
        if window is not None:
            window(i, functools.partial(wall, i, 1 + trips))
    return found


def compiled(run: Callable[[tuple, jax.Array], tuple]) -> Callable[[tuple, jax.Array], tuple]:
    return jax.jit(run, donate_argnums=0)


def own(tree: Any) -> Any:
    """A copy of every array of a carry: carries are donated, and none may share a buffer."""
    return jax.tree.map(jnp.copy, tree)


def pattern(like: Any, seed: int, scale: float = 1.0, dtype: Any = None) -> jax.Array:
    """Values of `like`'s shape (and dtype), uniform in [-scale, scale), from an integer hash of
    each index (lowbias32) instead of JAX's random generator, whose draws unroll into several times
    the fusions and the compile. The bits still look random: a GPU's matmul can draw less power, and so run faster, on
    smooth or sparse data than on the data a step sees."""
    x = jnp.arange(math.prod(like.shape), dtype=jnp.uint32) + jnp.uint32((seed * 0x9E3779B9) % 2**32)
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = (x ^ (x >> shift)) * jnp.uint32(factor)
    x = x ^ (x >> 16)
    values = ((x >> 8).astype(jnp.float32) * 2.0**-23 - 1.0) * scale
    return values.reshape(like.shape).astype(dtype or like.dtype)


def zeros(like: Any) -> jax.Array:
    return jnp.zeros(like.shape, like.dtype)


def loop_sizes(platform: str) -> LoopSizes:
    """The GPU's sizes (small ones on CPU, for tests); ATTENTION's later widths timed as the pair the
    engine calls (the cost model then prices a layer's encoder pair as it runs)."""
    sizes = GPU_LOOPS if platform != "cpu" else SMALL_LOOPS
    return replace(sizes, pair=os.environ.get(PAIR_ENV, "1") != "0")

