"""What this machine or the connected Ray cluster provides: GPUs (probed in a child, so the
orchestrator never holds them), and the identity of this machine's devices that a measured
profile is kept under."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys

import psutil

from codesign.config.hosts import Hosts

log = logging.getLogger(__name__)
_PROBE = "import jax; d = jax.devices('gpu'); print(len(d)); print(d[0].device_kind if d else '')"
GPU_FIX = "pip install -e '.[gpu]' (the CUDA build of JAX)"
RAY_ACCELERATOR = "accelerator_type:"  # the resource Ray gives a node for its GPUs' type


@functools.cache
def probe_gpus() -> tuple[int, str]:
    """(count, device kind) of the GPUs JAX can use here.

    NVIDIA GPUs that JAX cannot see (a CPU-only jaxlib, a driver mismatch) count as none, and
    the warning says why and how to fix it, rather than GPU jobs quietly running elsewhere.
    """
    present = nvidia_gpus_present()
    if not present:
        return 0, ""
    count, kind, why = _probe_jax_gpus()
    if not count:
        log.warning("this machine has NVIDIA GPUs (%s) but JAX sees none (%s): GPU clusters are "
                    "unavailable and platform = \"auto\" runs on CPU. To use the GPUs: %s",
                    present, why, GPU_FIX)
    return count, kind


def local_gpu_count() -> int:
    return probe_gpus()[0]


def local_gpu_kind() -> str:
    """JAX's name for this machine's GPUs (e.g. "NVIDIA H100 80GB HBM3"); "gpu" when there are none."""
    return probe_gpus()[1] or "gpu"


def local_hosts(probe: bool) -> Hosts:
    """This machine; its GPUs are probed only when a cluster could use them (a child JAX process)."""
    count, kind = probe_gpus() if probe else (0, "")
    return Hosts.local(count, kind)


def nvidia_gpus_present() -> str:
    """How we know this machine has NVIDIA GPUs ("" when it has none)."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        listed = sum(line.startswith("GPU ") for line in out.splitlines())
        if listed:
            return f"nvidia-smi lists {listed}"
    return "/dev/nvidia0 exists" if os.path.exists("/dev/nvidia0") else ""


def _probe_jax_gpus() -> tuple[int, str, str]:
    """(GPUs JAX sees, their device kind, why it sees none)."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return 0, "", "its probe timed out after 120 s"
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return 0, "", lines[-1] if lines else f"its probe exited with {out.returncode}"
    lines = out.stdout.strip().splitlines()
    try:
        return int(lines[0]), lines[1] if len(lines) > 1 else "", "it lists no GPU device"
    except (ValueError, IndexError):
        return 0, "", f"its probe printed {out.stdout.strip()[:200]!r}"


def ray_hosts(address: str) -> Hosts:
    """The alive nodes of the connected Ray cluster that can hold a job's share (a CPU), and
    their GPUs' type as Ray detected it (priced by that kind's built-in profile)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]
    kinds = sorted({k[len(RAY_ACCELERATOR):] for r in nodes for k in r if k.startswith(RAY_ACCELERATOR)})
    return Hosts(tuple(int(r.get("GPU", 0)) for r in nodes), f"the Ray cluster at {address}", True,
                 kinds[0] if kinds else "")


def cpu_model() -> str:
    """The CPU's model name and logical core count, which a CPU profile depends on."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or 'unknown CPU'} x {psutil.cpu_count(logical=True)}"
