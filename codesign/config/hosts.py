"""What the hosts can provide (real GPUs, or any number of virtual CPU devices), and which
platform runs a cluster there. Pure: probing this machine or a Ray cluster is run/discovery.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from codesign.config.types import ClusterSpec


@dataclass(frozen=True)
class Hosts:
    """What jobs can run on: the GPUs of each host, and how to name it in a reason."""

    gpus: tuple[int, ...]  # one entry per host
    where: str = "this machine"
    one_process_per_host: bool = False  # Ray: a multi-host job needs that many hosts
    gpu_kind: str = ""  # JAX's (or Ray's) name for the hosts' GPUs, "" when unknown or none

    @classmethod
    def local(cls, gpu_count: int, gpu_kind: str = "") -> Hosts:
        return cls((gpu_count,), gpu_kind=gpu_kind)

    def gpu_hosts(self, per_host: int) -> int:
        return sum(g >= per_host for g in self.gpus)


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


def platform_for(cluster: ClusterSpec, hosts: Hosts | None) -> str:
    """The platform a sweep on these hosts runs the cluster on; a cluster they cannot provide
    (or with no hosts given) is priced on the platform it declares."""
    platform = resolve_platform(cluster, hosts)[0] if hosts else None
    return platform or ("sim" if cluster.is_simulated else cluster.platform)
