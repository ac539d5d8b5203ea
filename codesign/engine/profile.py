"""`codesign profile`'s measurement: the devices at hand, as the cost model needs them.

Runs in its own process (`python -m codesign.engine.profile OUT.json`), the platform and the
virtual device count set in the environment before JAX starts. It times, on one device, each
ZHEN mixer (in a one-mixer ZHEN layer, the model's own code path) forward and backward at three
micro-batch sizes (a line through them gives the effective FLOP/s and the fixed cost per call),
an Adam update (memory bandwidth) and a program call (the host's cost per dispatch); across the
local devices, the aggregate speed of 1, 2, 4, 8 devices busy at once (virtual CPU devices
share the machine's cores), all-reduces (the link's bandwidth and latency) and the scratch XLA
gives a compiled step. Then it fits the result to real training steps of a probe model, each
timed as a sweep runs it: on CPU in a process that sees as many virtual devices as the step uses
(`--steps R`, serving rounds of timing on request), since idle virtual devices slow the busy ones
(a one-device step beside seven idle ones took 1.17-1.4x as long). Micro-benchmarks keep their
fastest time, whole steps their median.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.optimize import least_squares, nnls

from codesign.engine.job import build_training, train_steps
from codesign.engine.programs import DTYPES
from codesign.engine.step import accumulate, loss_fn
from codesign.planner.cost import ADAM_TRAFFIC, Workload, estimate
from codesign.planner.plan import make_plan
from codesign.planner.profiles import LAYER, DeviceProfile, Link, Rate, library_versions
from codesign.spec.hosts import device_env
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
PROBE = {"cpu": ((32, 4, 16), (8, 48, 128)), "gpu": ((256, 20, 160), (256, 1024, 2048))}
WIDE_PROBE = {"cpu": (48, 8, 8), "gpu": (512, 20, 160)}
# The probe steps' models: (widths per platform, layers, each layer's mixers). "probe": every
# mixer; "wide": gradients large enough to time their all-reduce's copies; "attention", "dot":
# matmul-heavy layers, whose pipelines contend for shared cores as the models of CPU sweeps do
# (fitted to the first two alone, contention came out at 0.006 and 8-device pipelines of those
# models were priced at 0.5-0.6 of their measured time).
PROBE_WIDTHS = {platform: widths for platform, (widths, _) in PROBE.items()}
PROBE_MODELS = {"probe": (PROBE_WIDTHS, 2, tuple(MIXERS)), "wide": (WIDE_PROBE, 2, tuple(MIXERS)),
                "attention": (PROBE_WIDTHS, 4, ("ATTENTION", "LINEAR")),
                "dot": (PROBE_WIDTHS, 4, ("DOT", "ATTENTION", "LINEAR"))}
SPEEDUP_SAMPLES = 16  # per device, in the shared-core speed-up probe (small steps: what a CPU sweep runs)
# What the calibration fits a factor to: fixed costs per mixer call, FLOP-proportional time,
# memory traffic, XLA:CPU's copies around a gradient all-reduce, and the contention of a
# pipeline's stages on shared cores (how far from perfectly packed). The dispatch cost and the
# collectives' latency keep their micro-benchmarks: fitted, they traded against the fixed costs.
PROBE_SECONDS = 1.5  # each probe step's timed steps in all: ten 3 ms steps moved 1.5x between runs
PROBE_ROUNDS = 3  # ... taken in rounds over all the probes of one process
COMPONENTS = ("fixed", "flops", "memory", "sync", "contention")
FACTOR_BOUNDS = (0.05, 20.0)
# Twenty probe steps, each a few % noisy, do not pin five factors: unpenalised, fresh profiles fitted
# all-reduce copies x6-x9 and fixed costs x0.08-x0.5, and priced their own sweeps at 14.1% and 14.2%
# median error; drawn toward the micro-benchmarks (a factor of e costs as much as a 32% miss on one
# probe), 11.4% and 12.8%.
FACTOR_PRIOR = 0.1
CONTENTION = 0.05  # the pipelines' contention on CPU the fit starts from: cost sweeps on 2-8 devices fit 0.05-0.07


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


def call_times(module: nn.Module, z: jax.Array, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of one module call on z: backward = forward-and-backward - forward."""
    params = module.init(jax.random.key(0), z)
    fwd = jax.jit(lambda p, x: module.apply(p, x))
    both = jax.jit(jax.grad(lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32)), argnums=(0, 1)))
    forward = median_time(lambda: fwd(params, z), repeats)
    return forward, max(median_time(lambda: both(params, z), repeats) - forward, 0.05 * forward)


def kind_rate(kind: str, platform: str, precision: str, dispatch: float, peak: float, repeats: int) -> Rate:
    """A least-squares line through the probe's micro-batch sizes: slope -> effective FLOP/s at
    the probed widths, activation traffic included (at most the device's matmul peak: noise
    can flatten a slope), intercept less the dispatch -> the fixed cost per call."""
    (f_in, out, emb), sizes = PROBE[platform]
    dtype = DTYPES[precision]
    if kind == LAYER:
        module, flops = nn.Dense(f_in, dtype=dtype), 2 * emb * f_in * f_in
    else:
        module, flops = OneMixerLayer(kind, f_in, out, emb, dtype), counts.mixer_work(kind, f_in, out, emb).flops
    times = np.array([call_times(module, jax.random.normal(jax.random.key(1), (b, emb, f_in), dtype), repeats)
                      for b in sizes])

    def fit(seconds: np.ndarray, work: float) -> tuple[float, float]:
        slope, intercept = np.polyfit(np.array(sizes, float), seconds, 1)
        slope = max(slope, work / peak)
        return float(work / slope), float(max(intercept - dispatch, 1e-6))

    forward, overhead = fit(times[:, 0], flops)
    backward, _ = fit(times[:, 1], 2 * flops)
    return Rate(forward, backward, overhead)


class OneMixerLayer(nn.Module):
    """ZHEN's first layer holding one mixer of a kind: what the profile times for that kind (the
    model's own code path: a LINEAR or ATTENTION mixer's feature FC runs in the layer)."""

    kind: str
    f_in: int
    out: int
    emb: int
    dtype: Any

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        spec = ModelSpec(self.f_in, self.emb, self.out, 1, ((self.kind,),))
        return network.ZhenBlock(spec, 0, self.dtype)((z, None))[1]


def bandwidth(repeats: int, size: int = 2**21) -> float:
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

    return ADAM_TRAFFIC * 4 * size / median_time(run, repeats)


def dispatch_time(repeats: int, arrays: int = 64) -> float:
    """One call of a compiled program taking as many arrays as a stage's parameters and state."""
    f = jax.jit(lambda xs: [x + 1.0 for x in xs])
    xs = [jnp.ones((8,)) for _ in range(arrays)]
    return median_time(lambda: f(xs), 4 * repeats)


def speedup(platform: str, repeats: int) -> tuple[float, list[tuple[int, float]]]:
    """One device's matmul FLOP/s, and the aggregate speed of n devices each computing the probe
    model's gradients on its own SPEEDUP_SAMPLES samples at once (a data-parallel step's work
    without its collectives), relative to one device."""
    devices = jax.devices()
    w = jnp.ones((256, 256), jnp.float32)
    big = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b)
    peak = 4 * 256**3 / median_time(lambda: big(w, w), repeats)
    job = probe_job(platform, 1, (1, 1, 1), 1, SPEEDUP_SAMPLES)
    loss = loss_fn(job, ((0, 1),), False)
    params = nn.meta.unbox(network.init_params(job.model, jax.random.key(0)))

    def local(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return (value + sum(jnp.sum(g) for g in jax.tree.leaves(grads)))[None]

    base, points = 0.0, []
    for n in (1, 2, 4, 8):
        if n > len(devices):
            break
        mesh = Mesh(np.array(devices[:n]), ("d",))
        sharded, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
        x = jax.device_put(jnp.ones((n * SPEEDUP_SAMPLES, job.model.emb_dim, job.model.num_features)), sharded)
        y = jax.device_put(jnp.ones((n * SPEEDUP_SAMPLES, counts.output_width(job.model))), sharded)
        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P("d")))
        placed = jax.device_put(params, replicated)
        seconds = median_time(lambda: f(placed, x, y), 2 * repeats, best=False, min_seconds=PROBE_SECONDS)
        base = base or seconds
        points.append((n, max(1.0, n * base / seconds)))  # at worst they take turns; less is others' load
    return peak, points


def link(repeats: int, per_array: bool) -> Link | None:
    """All-reduces over every local device: a large one gives the bandwidth. The latency is one
    call's cost where a step's gradients go as one combined all-reduce (a small all-reduce
    against the same program without it); `per_array` (CPU, where each array pays its own
    rendezvous) it is the marginal cost of one more array in a program reducing many (XLA:CPU:
    6-9 us per ring step back to back, against 14-22 us for a lone call)."""
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        return None
    mesh = Mesh(np.array(devices), ("d",))
    sharded, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    size = 2**22
    big = jax.device_put(jnp.ones((n, size // 4), jnp.float32), sharded)
    reduce = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=replicated)
    small = jax.device_put(jnp.ones((n, 16), jnp.float32), sharded)
    reduce_small = median_time(lambda: reduce(small), repeats)
    if per_array:
        one_call = (small_reduces(mesh, 32, repeats) - small_reduces(mesh, 8, repeats)) / 24
    else:
        local = jax.jit(lambda a: a * 2.0, out_shardings=sharded)
        one_call = reduce_small - median_time(lambda: local(small), repeats)
    moving = max(median_time(lambda: reduce(big), repeats) - reduce_small, 1e-9)
    return Link(2 * (n - 1) / n * size / moving, max(one_call, 1e-7) / (2 * (n - 1)))


def small_reduces(mesh: Mesh, arrays: int, repeats: int) -> float:
    """Seconds of one program all-reducing `arrays` small arrays, as a step's gradients go on CPU."""
    n = mesh.devices.size
    xs = [jax.device_put(jnp.ones((n, 16 + k), jnp.float32), NamedSharding(mesh, P("d"))) for k in range(arrays)]
    reduce = jax.jit(lambda xs: [jnp.sum(x, axis=0) for x in xs], out_shardings=[NamedSharding(mesh, P())] * arrays)
    return median_time(lambda: reduce(xs), repeats)


def update_scratch(platform: str) -> float:
    """Gradient-sized scratch buffers, beyond the gradients, that XLA gives a compiled pp = 1
    training step (loss, gradients and Adam in one program, state donated), per its memory
    analysis of the probe model at one sample (activations negligible), without a DOT mixer
    (the cost model counts the folded DOT's backward scratch apart)."""
    (f_in, out, emb), _ = PROBE[platform]
    model = ModelSpec(f_in, emb, out, 2, (tuple(m for m in MIXERS if m != "DOT"),) * 2)
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


class LocalProbes:
    """Probe steps compiled in this process, timed a round at a time, as a job times its steps."""

    def __init__(self, jobs: list[Job], repeats: int):
        self.trainings = [build_training(job, make_plan(job)) for job in jobs]
        for training in self.trainings:
            train_steps(training, 1)  # the first run's allocations, not timed
        self.steps = max(1, 2 * repeats // PROBE_ROUNDS)

    def round(self) -> list[list[float]]:
        """Each step's wall times over PROBE_SECONDS / PROBE_ROUNDS."""
        return [train_steps(training, self.steps, PROBE_SECONDS / PROBE_ROUNDS)[1] for training in self.trainings]


class ChildProbes:
    """own_probe_jobs(devices) compiled in a child process that sees that many CPU devices (as a
    sweep's job on them does), timed a round at a time when asked; between rounds it waits."""

    def __init__(self, devices: int, repeats: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "codesign.engine.profile", "--steps", str(repeats)],
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


def probe_job(platform: str, devices: int, pp_dp_op: tuple[int, int, int], micro: int, per_device: int,
              model: str = "probe") -> Job:
    """A job of one of PROBE_MODELS on `devices` local devices."""
    widths, layers, tokens = PROBE_MODELS[model]
    f_in, out, emb = widths[platform]
    return Job(ModelSpec(f_in, emb, out, layers, (tokens,) * layers), ClusterSpec(1, devices, "NVLink", platform),
               TrainingSpec(per_device, 3), ParallelSpec("probe", (micro,), pp_dp_op[0], pp_dp_op=pp_dp_op),
               micro, platform)


def probe_jobs(platform: str, devices: int) -> list[Job]:
    """The real steps a profile is fitted to: one device at two batch sizes and with
    micro-batches, then, as far as the local devices go, data, operator and pipeline parallel;
    on 8 devices, pipelines of 4 matmul-heavy layers beside one program of the same model."""
    _, sizes = PROBE[platform]
    small, large = sizes[0], sizes[1]
    plans = [(1, (1, 1, 1), 1, small), (1, (1, 1, 1), 1, large), (1, (1, 1, 1), 4, large),
             (2, (1, 2, 1), 1, small), (2, (1, 2, 1), 2, small), (2, (1, 1, 2), 1, small),
             (2, (2, 1, 1), 2, small), (4, (1, 2, 2), 1, small), (4, (2, 2, 1), 2, small),
             (4, (2, 1, 2), 2, small), (8, (1, 8, 1), 1, small), (8, (2, 2, 2), 2, small),
             (1, (1, 1, 1), 1, small, "wide"), (2, (1, 2, 1), 1, small, "wide"),
             *((8, shape, 2, small, model) for model in ("attention", "dot")
               for shape in ((4, 1, 2), (2, 1, 4), (1, 2, 4)))]
    return [probe_job(platform, *plan) for plan in plans if plan[0] <= devices]


def probe_step_times(platform: str, jobs: list[Job], repeats: int) -> list[float]:
    """The probe steps' median seconds. On CPU the steps of n < all devices run in a child that
    sees n virtual devices, as a sweep's job on n devices does. Every group (this process's,
    each child's) is timed in PROBE_ROUNDS rounds, one group at a time, so that all of them see
    the same mix of the machine's drifting speed (8-device probes timed a minute after the
    others ran 1.3x slower, and the fit read that as contention)."""
    here = len(jax.devices())
    apart = sorted({j.cluster.num_devices for j in jobs} - {here}) if platform == "cpu" else []
    children = [ChildProbes(n, repeats) for n in apart]
    try:
        groups: dict[int, LocalProbes | ChildProbes] = {
            here: LocalProbes([j for j in jobs if j.cluster.num_devices not in apart], repeats)}
        for child in children:
            child.ready()
            groups[child.devices] = child
        pooled: dict[int, list[list[float]]] = {}
        for _ in range(PROBE_ROUNDS):
            for n, group in groups.items():
                times = group.round()
                pooled[n] = [a + b for a, b in zip(pooled.get(n, [[] for _ in times]), times)]
    finally:
        for child in children:
            child.close()
    medians = {n: iter(float(np.median(t)) for t in times) for n, times in pooled.items()}
    found = [next(medians[job.cluster.num_devices]) for job in jobs]
    for job, seconds in zip(jobs, found):
        log.info("  probe step on %d device(s), (pp, dp, op) = %s, %d micro-batch(es) of %d: %.3g s",
                 job.cluster.num_devices, job.parallel.pp_dp_op, job.num_micro_batches,
                 job.global_batch // job.num_micro_batches, seconds)
    return found


def own_probe_jobs(devices: int) -> list[Job]:
    return [j for j in probe_jobs("cpu", devices) if j.cluster.num_devices == devices]


def serve_probes(repeats: int) -> None:
    """The child's side of ChildProbes: compile, say how many devices it sees, then time a round
    for each line read until stdin closes."""
    probes = LocalProbes(own_probe_jobs(len(jax.devices())), repeats)
    print(json.dumps({"devices": len(jax.devices())}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"times": probes.round()}), flush=True)


def scaled(profile: DeviceProfile, factors: dict[str, float]) -> DeviceProfile:
    """The profile with the seconds of each of COMPONENTS multiplied by its factor."""
    f = {k: factors.get(k, 1.0) for k in COMPONENTS}
    rates = tuple((p, tuple((k, Rate(r.forward / f["flops"], r.backward / f["flops"], r.overhead * f["fixed"]))
                            for k, r in table)) for p, table in profile.rates)
    return dataclasses.replace(profile, rates=rates, bandwidth=profile.bandwidth / f["memory"],
                               sync_traffic=profile.sync_traffic * f["sync"] / f["memory"],
                               contention=profile.contention * f["contention"])


def calibrate(profile: DeviceProfile, platform: str, repeats: int) -> DeviceProfile:
    """Fit the probed profile to real training steps of the probe model (kernels probed one by
    one are not a compiled step: fused, scheduled together, laid out for it)."""
    jobs = probe_jobs(platform, len(jax.devices()))
    measured = probe_step_times(platform, jobs, repeats)
    factors = fitted_factors(profile, jobs, measured)
    log.info("  fitted factors: %s", ", ".join(f"{k} x {v:.2f}" for k, v in factors.items()))
    return scaled(profile, factors)


def fitted_factors(profile: DeviceProfile, jobs: list[Job], measured: list[float],
                   prior: float = FACTOR_PRIOR) -> dict[str, float]:
    """Each component's factor, by least squares of the probe steps' relative error. The linear
    part first: each step's seconds split into COMPONENTS (what doubling one factor adds), a
    non-negative fit; then a bounded refinement over them all, since "contention" scales the
    others' seconds where a pipeline's shared-cores bound binds, with each log factor drawn
    toward 0 (the micro-benchmark) by `prior`. A component no probe exercises keeps its
    micro-benchmark."""
    plans = [make_plan(job) for job in jobs]
    observed = np.array(measured)

    def seconds(factors: dict[str, float]) -> np.ndarray:
        fitted = scaled(profile, factors)
        return np.array([estimate(Workload.of(job, fitted), plan).seconds for job, plan in zip(jobs, plans)])

    base = seconds({})
    a = np.array([seconds({k: 2.0}) - base for k in COMPONENTS]).T
    used = np.array(COMPONENTS)[np.abs(a).max(axis=0) > 1e-3 * observed.min()].tolist()
    columns = [COMPONENTS.index(k) for k in used]
    weights = 1 / observed
    linear, _ = nnls(a[:, columns] * weights[:, None], (observed - base + a[:, columns].sum(axis=1)) * weights)
    bounds = np.log(FACTOR_BOUNDS)
    start = np.clip(np.log(np.maximum(linear, FACTOR_BOUNDS[0])), *bounds)
    refined = least_squares(lambda x: np.concatenate([seconds(dict(zip(used, np.exp(x)))) / observed - 1,
                                                      np.sqrt(prior) * x]),
                            start, bounds=bounds, diff_step=1e-3)
    factors = dict.fromkeys(COMPONENTS, 1.0)
    factors.update(zip(used, np.exp(refined.x).tolist()))
    return factors


def device_memory(device) -> int:
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit") or psutil.virtual_memory().total)


def measure(repeats: int = 5) -> DeviceProfile:
    device = jax.devices()[0]
    platform = "cpu" if device.platform == "cpu" else "gpu"
    log.info("profiling %d %s device(s) (%s)", len(jax.devices()), platform, device.device_kind)
    bw, dispatch, call = bandwidth(repeats), dispatch_time(repeats), dispatch_time(repeats, 2)
    peak, points = speedup(platform, repeats)
    log.info("  matmul %.3g FLOP/s, memory %.3g B/s, dispatch %.3g s; aggregate speed of n busy devices: %s",
             peak, bw, dispatch, points)
    rates = []
    for precision in ("fp32", "bf16") if platform == "gpu" else ("fp32",):
        table = []
        for kind in (*MIXERS, LAYER):
            table.append((kind, kind_rate(kind, platform, precision, call, peak, repeats)))
            log.info("  %s %s: %s", precision, kind, table[-1][1])
        rates.append((precision, tuple(table)))
    probed = DeviceProfile(kind=device.device_kind if platform == "gpu" else "cpu", platform=platform,
                           memory=device_memory(device), rates=tuple(rates), bandwidth=bw,
                           dispatch=dispatch, speedup=tuple(points) if platform == "cpu" else (),
                           link=link(repeats, per_array=platform == "cpu"),
                           update_scratch=update_scratch(platform), combines_collectives=platform == "gpu",
                           sync_traffic=1.0 if platform == "cpu" else 0.0,
                           contention=CONTENTION if platform == "cpu" else 0.0,
                           roofline=False, versions=tuple(sorted(library_versions().items())), source="measured")
    profile = calibrate(probed, platform, repeats)
    log.info("  calibrated on real steps: memory %.3g B/s, link %s, %.2f gradient copies per all-reduce",
             profile.bandwidth, profile.link, profile.sync_traffic)
    return profile


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="codesign profile: %(message)s")
    if argv[0] == "--steps":
        serve_probes(int(argv[1]))
        return 0
    with open(argv[0], "w") as f:
        json.dump(measure().to_dict(), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
