"""A CPU's profile: micro-benchmarks per call, then fitted (cost/calibration.py) to real
training steps of the probe jobs. Micro-benchmarks keep their fastest time, whole steps their median."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax

from codesign.config.types import MIXERS
from codesign.engine.probe.cpu_benchmarks import (
    Bench,
    bandwidth,
    dispatch_time,
    kind_rate,
    link,
    mixer_times,
    prepared,
    speedup,
)
from codesign.engine.probe.memory import device_memory, update_scratch
from codesign.engine.probe.parts import Parts
from codesign.engine.probe.probe_steps import ChildProbes, LocalProbes, probe_step_times
from codesign.cost.calibration import CONTENTION, PROBE_WIDTHS, fitted_factors, probe_jobs, scaled
from codesign.hardware.links import Link
from codesign.hardware.profiles import LAYER, DeviceProfile, Provenance, Rate, SharedCoreFit, library_versions

log = logging.getLogger("codesign.profile")
PREPARE_THREADS = 2  # this process's programs compiled two at a time (XLA compiles outside the GIL): it
# compiles the most (the micro-benchmarks, the 8-device probes), and on one core it was the critical path


def cpu_profile(parts: Parts, repeats: int = 5) -> DeviceProfile:
    """Virtual CPU devices: micro-benchmarks per call, then fitted to real training steps of the
    probe models (kernels probed one by one are not a compiled step: fused, scheduled together,
    laid out for it). Every program is compiled first, the children's probe steps beside this
    process's micro-benchmarks and probe steps, and nothing is timed before all are: the
    compiles fill both cores, and no timing sees a compile (timed while the children compiled,
    a profile priced a cost sweep far worse)."""
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
             profile.bandwidth, profile.link, profile.shared.sync_traffic)
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
                         link=Link(**found) if found else None, update_scratch=parts.data["scratch"],
                         combines_collectives=False, roofline=False,
                         shared=SharedCoreFit(speedup=tuple(map(tuple, points)), sync_traffic=1.0, contention=CONTENTION,
                                              cores=host_cores()),
                         provenance=Provenance("measured", tuple(sorted(library_versions().items()))))


def host_cores() -> int:
    """The cores this process may run on, which its virtual devices share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
