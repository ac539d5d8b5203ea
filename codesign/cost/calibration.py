"""The profile's calibration: factors that fit a probed profile to real training steps.

Kernels probed one by one are not a compiled step (fused, scheduled together, laid out for it),
so `codesign profile` (engine/probe/) times real steps of small probe models and scales five
components of the probed profile to fit them. The jobs and the fit are pure (numpy, scipy and
the cost model), so they are tested without JAX; the timing stays in the engine.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.optimize import least_squares, nnls

from codesign.cost.model import Workload, estimate
from codesign.cost.plan import make_plan
from codesign.hardware.profiles import DeviceProfile, Rate
from codesign.config.types import MIXERS, ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec

# Widths of the probe models' layers (F_in, O, D) and the probe steps' samples per device, on CPU
# (a GPU profile times its mixers inside compiled loops, device time alone: nothing to calibrate).
PROBE_WIDTHS = (32, 4, 16)
PROBE_BATCHES = (8, 48)
WIDE_PROBE = (48, 8, 8)
# The probe steps' models: (widths, layers, each layer's mixers). "probe": every
# mixer; "wide": gradients large enough to time their all-reduce's copies; "dot": matmul-heavy
# layers, whose pipelines contend for shared cores as the models of CPU sweeps do (fitted to the
# first two alone, contention came out at 0.006 and 8-device pipelines of matmul-heavy models
# were priced at 0.5-0.6 of their measured time).
PROBE_MODELS = {"probe": (PROBE_WIDTHS, 2, tuple(MIXERS)), "wide": (WIDE_PROBE, 2, tuple(MIXERS)),
                "dot": (PROBE_WIDTHS, 4, ("DOT", "ATTENTION", "LINEAR"))}
# What the calibration fits a factor to: fixed costs per mixer call, FLOP-proportional time,
# memory traffic, XLA:CPU's copies around a gradient all-reduce, and the contention of a
# pipeline's stages on shared cores (how far from perfectly packed). The dispatch cost and the
# collectives' latency keep their micro-benchmarks: fitted, they traded against the fixed costs.
COMPONENTS = ("fixed", "flops", "memory", "sync", "contention")
FACTOR_BOUNDS = (0.05, 20.0)
# Seven noisy probe steps do not pin five factors alone: the fit draws each toward its
# micro-benchmark (a factor of e costs as much as a 17% miss on one probe); the strength was
# chosen on the cost sweeps of bench/cost_cpu.toml (bench/RESULTS.md).
FACTOR_PRIOR = 0.03
CONTENTION = 0.05  # where the fit of the pipelines' contention on CPU starts: what cost sweeps fit


def probe_job(devices: int, pp_dp_op: tuple[int, int, int], micro: int, per_device: int,
              model: str = "probe") -> Job:
    """A job of one of PROBE_MODELS on `devices` local CPU devices."""
    (f_in, out, emb), layers, tokens = PROBE_MODELS[model]
    return Job(ModelSpec(f_in, emb, out, layers, (tokens,) * layers), ClusterSpec(1, devices, "NVLink", "cpu"),
               TrainingSpec(per_device, 3), ParallelSpec("probe", (micro,), pp_dp_op[0], pp_dp_op=pp_dp_op),
               micro, "cpu")


def probe_jobs(devices: int) -> list[Job]:
    """The real steps a profile is fitted to: one device at two batch sizes, with micro-batches,
    and a wide model's step; data parallel on 2 devices (the wide model) and on 8; on 8, a 2-stage
    pipeline of 4 matmul-heavy layers, each stage operator parallel on 4. Each probe pins a factor
    (fixed costs and FLOPs: one device; memory: micro-batches; all-reduce copies: dp; contention:
    the pipeline). Each is a compile, the bulk of a CPU profile's time: no more of them than
    that (more probes priced the cost sweeps no better)."""
    small, large = PROBE_BATCHES
    plans = [(1, (1, 1, 1), 1, small), (1, (1, 1, 1), 1, large), (1, (1, 1, 1), 4, large),
             (1, (1, 1, 1), 1, small, "wide"), (2, (1, 2, 1), 1, small, "wide"), (8, (1, 8, 1), 1, small),
             (8, (2, 1, 4), 2, small, "dot")]
    return [probe_job(*plan) for plan in plans if plan[0] <= devices]


def scaled(profile: DeviceProfile, factors: dict[str, float]) -> DeviceProfile:
    """The profile with the seconds of each of COMPONENTS multiplied by its factor."""
    f = {k: factors.get(k, 1.0) for k in COMPONENTS}
    rates = tuple((p, tuple((k, _scaled_rate(r, f["flops"], f["fixed"])) for k, r in table))
                  for p, table in profile.rates)
    return dataclasses.replace(profile, rates=rates, bandwidth=profile.bandwidth / f["memory"],
                               shared=dataclasses.replace(
                                   profile.shared, sync_traffic=profile.shared.sync_traffic * f["sync"] / f["memory"],
                                   contention=profile.shared.contention * f["contention"]))


def _scaled_rate(rate: Rate, flops: float, fixed: float) -> Rate:
    """A rate's FLOP time times `flops`, its fixed cost times `fixed`; measured points (fixed
    costs and FLOPs together) take the FLOP factor."""
    def points(found: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        return tuple((work, seconds * flops) for work, seconds in found)

    return Rate(rate.forward / flops, rate.backward / flops, rate.overhead * fixed,
                points(rate.forward_points), points(rate.backward_points))


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
