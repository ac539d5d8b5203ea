"""What the hosts can provide: real GPUs, or any number of virtual CPU devices.

The hosts are this machine, or the alive nodes of a Ray cluster when jobs run there.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping

from codesign.spec.types import ClusterSpec

log = logging.getLogger(__name__)
_PROBE = "import jax; d = jax.devices('gpu'); print(len(d)); print(d[0].device_kind if d else '')"
GPU_FIX = "pip install -e '.[gpu]' (the CUDA build of JAX)"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def device_env(env: Mapping[str, str], platform: str, cpu_devices: int = 1) -> dict[str, str]:
    """A child JAX process's environment: its platform and, on CPU, how many virtual devices it
    sees (read once, when JAX starts in the child)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if platform == "cpu":
        flags.append(f"{DEVICE_COUNT_FLAG}={cpu_devices}")
    return {**env, "JAX_PLATFORMS": "cpu" if platform == "cpu" else "cuda", "XLA_FLAGS": " ".join(flags)}


@functools.cache
def _probe_gpus() -> tuple[int, str]:
    """(count, device kind) of the GPUs JAX can use here, probed in a child so the orchestrator
    never holds them.

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
    return _probe_gpus()[0]


def local_gpu_kind() -> str:
    """JAX's name for this machine's GPUs (e.g. "NVIDIA H100 80GB HBM3"); "gpu" when there are none."""
    return _probe_gpus()[1] or "gpu"


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


@dataclass(frozen=True)
class Hosts:
    """What jobs can run on: the GPUs of each host, and how to name it in a reason."""

    gpus: tuple[int, ...]  # one entry per host
    where: str = "this machine"
    one_process_per_host: bool = False  # Ray: a multi-host job needs that many hosts

    @classmethod
    def local(cls, gpu_count: int) -> Hosts:
        return cls((gpu_count,))

    def gpu_hosts(self, per_host: int) -> int:
        return sum(g >= per_host for g in self.gpus)


def ray_hosts(address: str) -> Hosts:
    """The alive nodes of the connected Ray cluster that can hold a job's share (a CPU)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]
    return Hosts(tuple(int(r.get("GPU", 0)) for r in nodes), f"the Ray cluster at {address}", True)


def resolve_platform(cluster: ClusterSpec, hosts: Hosts) -> tuple[str | None, str]:
    """("gpu" | "cpu" | "sim", "") when the hosts can run the cluster, else (None, why not).
    A simulated cluster is only priced, so every host "has" it."""
    if cluster.is_simulated:
        return "sim", ""
    if cluster.platform != "cpu" and hosts.gpu_hosts(cluster.num_devices_per_host) >= cluster.num_hosts:
        return "gpu", ""
    if cluster.platform != "gpu":
        if hosts.one_process_per_host and len(hosts.gpus) < cluster.num_hosts:
            return None, f"needs {cluster.num_hosts} hosts; {hosts.where} has {len(hosts.gpus)}"
        return "cpu", ""
    if hosts.one_process_per_host:
        return None, (f"needs {cluster.num_hosts} host(s) with {cluster.num_devices_per_host} GPUs; "
                      f"{hosts.where} has {hosts.gpu_hosts(cluster.num_devices_per_host)}")
    if cluster.num_hosts > 1:
        return None, f"needs {cluster.num_hosts} GPU hosts; {hosts.where} is one host"
    return None, f"needs {cluster.num_devices_per_host} GPUs; {hosts.where} has {hosts.gpus[0]}"
