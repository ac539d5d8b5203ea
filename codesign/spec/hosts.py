"""What the hosts can provide: real GPUs, or any number of virtual CPU devices.

The hosts are this machine, or the alive nodes of a Ray cluster when jobs run there.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from codesign.spec.types import ClusterSpec

_PROBE = "import jax; d = jax.devices('gpu'); print(len(d)); print(d[0].device_kind)"


@functools.cache
def _probe_gpus() -> tuple[int, str]:
    """(count, device kind) of the GPUs JAX can use here, probed in a child so the orchestrator
    never holds them."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        return 0, ""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        count, kind = out.stdout.strip().splitlines()
        return (int(count), kind) if out.returncode == 0 else (0, "")
    except (subprocess.TimeoutExpired, ValueError):
        return 0, ""


def local_gpu_count() -> int:
    return _probe_gpus()[0]


def local_gpu_kind() -> str:
    """JAX's name for this machine's GPUs (e.g. "NVIDIA H100 80GB HBM3"); "gpu" when there are none."""
    return _probe_gpus()[1] or "gpu"


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
