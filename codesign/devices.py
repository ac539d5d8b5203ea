"""What this machine can provide: real GPUs, or any number of virtual CPU devices."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

from codesign.specs import ClusterSpec

_PROBE = "import jax; print(len(jax.devices('gpu')))"


@functools.cache
def local_gpu_count() -> int:
    """GPUs that JAX can use here, probed in a child so the orchestrator never holds them."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        return 0
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip()) if out.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError):
        return 0


def resolve_platform(cluster: ClusterSpec, gpu_count: int) -> tuple[str | None, str]:
    """("gpu" | "cpu", "") when this machine can run the cluster locally, else (None, why not)."""
    if cluster.platform == "cpu":
        return "cpu", ""
    fits = cluster.num_hosts == 1 and cluster.num_devices_per_host <= gpu_count
    if fits:
        return "gpu", ""
    if cluster.platform == "auto":
        return "cpu", ""
    if cluster.num_hosts > 1:
        return None, f"needs {cluster.num_hosts} GPU hosts; this machine is one host"
    return None, f"needs {cluster.num_devices_per_host} GPUs; this machine has {gpu_count}"
