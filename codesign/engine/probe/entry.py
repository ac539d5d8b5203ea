"""`python -m codesign.engine.probe OUT.json`: profile the devices at hand; `--steps R`: serve a
parent's probe steps (probe_steps.ChildProbes)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import jax

from codesign.engine.job import configure_jax
from codesign.engine.probe.cpu_profile import cpu_profile
from codesign.engine.probe.gpu_sections import loop_profile
from codesign.engine.probe.loops import loop_sizes
from codesign.engine.probe.parts import Parts
from codesign.engine.probe.probe_steps import serve_probes
from codesign.hardware.profiles import DeviceProfile

log = logging.getLogger("codesign.profile")
LOOPS_ENV = "CODESIGN_PROFILE_LOOPS"  # "small": the GPU's loop-timed path on CPU, at small sizes (tests)


def measure(out: Path) -> DeviceProfile:
    """The local devices' profile; sections so far in OUT.json.parts (removed once OUT.json is whole)."""
    device = jax.devices()[0]
    log.info("profiling %d %s device(s) (%s)", len(jax.devices()), device.platform, device.device_kind)
    parts = Parts(out.with_name(out.name + ".parts"))
    if device.platform == "cpu" and os.environ.get(LOOPS_ENV) != "small":
        return cpu_profile(parts)
    return loop_profile(parts, loop_sizes(device.platform))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m codesign.engine.probe",
                                     description="Profile the devices at hand into OUT.json "
                                                 "(`codesign profile` runs it).")
    parser.add_argument("out", nargs="?", type=Path, help="the profile's JSON file (sections kept in OUT.json.parts)")
    parser.add_argument("--steps", type=int, metavar="R", help="serve a parent's probe steps, timed R repeats a "
                        "round, one round per line read on stdin")
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.out is None and args.steps is None:
        parser.error("give OUT.json or --steps R")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="codesign profile: %(message)s")
    configure_jax(os.environ.get("CODESIGN_CACHE_DIR"))  # the probe children's steps too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the micro-benchmarks' small
    # programs too: a profile run again compiles from the cache
    if args.steps is not None:
        serve_probes(args.steps)
        return 0
    out = args.out
    start = time.perf_counter()
    profile = measure(out)
    out.write_text(json.dumps(profile.to_dict()))
    out.with_name(out.name + ".parts").unlink(missing_ok=True)
    log.info("profiled in %.1f s", time.perf_counter() - start)
    return 0
