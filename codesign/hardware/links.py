"""Links: NVLink inside a host, the transports between hosts, and a config's [links.NAME].

A link's `bandwidth` is bytes/s per direction: each device's for NVLink (and for the local link
a CPU profile measured), each host's over all its NICs for a transport between hosts; `latency`
is seconds per message step (a ring's step on shared cores, a hop of NCCL's between hosts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from codesign.config.loader import LinkSpec
from codesign.config.types import TRANSPORTS, ClusterSpec

if TYPE_CHECKING:  # profiles imports this module; only its type here
    from codesign.hardware.profiles import DeviceProfile


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float

    def __str__(self) -> str:  # for the profile's progress lines
        return f"{self.bandwidth:.3g} B/s, {self.latency * 1e6:.1f} us per step"


@dataclass(frozen=True)
class Transport:
    """A transport between hosts as a config names it: its link, its NICs per host, what it models."""

    link: Link
    nics: int
    models: str


Gbps = 1e9 / 8  # bytes/s of one Gb/s line rate
# What NCCL reaches of a NIC's line rate across hosts (InfiniBand NDR/HDR, EFA v2): assumed, not
# fitted; tests/published_hardware.py checks it on published runs of 2 to 12 hosts (rows B01-B14).
NIC_EFFICIENCY = 0.95
# NVLink 4 is 450 GB/s per direction per H100/H200 SXM, of which a ring reaches ~80%: where a GPU
# has no measured NCCL table. EFAx4 and TCPx4 keep the earlier toolkit's figures.
NVLINK = Link(360e9, 5e-6)
LINKS: dict[str, Transport] = {
    "NVLink": Transport(NVLINK, 0, "NVLink inside one host (no transport between hosts)"),
    "NDRx8": Transport(Link(NIC_EFFICIENCY * 8 * 400 * Gbps, 5e-6), 8,
                       "8 x 400 Gb/s InfiniBand NDR per host, one NIC per GPU (HGX H100/H200)"),
    "HDRx8": Transport(Link(NIC_EFFICIENCY * 8 * 200 * Gbps, 5e-6), 8,
                       "8 x 200 Gb/s InfiniBand HDR per host, one NIC per GPU (DGX A100)"),
    "EFAx32": Transport(Link(NIC_EFFICIENCY * 32 * 100 * Gbps, 15e-6), 32,
                        "32 x 100 Gb/s EFA v2 per host, four NICs per GPU (AWS p5)"),
    "EFAx4": Transport(Link(40e9, 30e-6), 4, "4 x 100 Gb/s EFA per host (the earlier toolkit's)"),
    "TCPx4": Transport(Link(10e9, 100e-6), 4, "4 x 25 Gb/s TCP per host (the earlier toolkit's)"),
}
assert tuple(LINKS) == TRANSPORTS, "config.types.TRANSPORTS names the transports; their figures are here"


def cluster_links(profile: DeviceProfile, cluster: ClusterSpec,
                  overrides: Iterable[LinkSpec] = ()) -> tuple[Link, Link]:
    """(inside a host, between hosts). Virtual CPU devices talk through local memory whatever the
    declared transport; GPUs use NVLink inside a host (the link a measured profile timed between
    its host's GPUs, where it has one) and the cluster's transport across hosts; `[links]` wins."""
    if profile.link is not None and profile.shares_cores:
        return profile.link, profile.link
    links = {name: t.link for name, t in LINKS.items()}
    if profile.link is not None:
        links["NVLink"] = profile.link
    for spec in overrides:
        base = links[spec.name]
        links[spec.name] = Link(spec.bandwidth or base.bandwidth,
                                base.latency if spec.latency is None else spec.latency)
    return links["NVLink"], links[cluster.transport]


def nics(cluster: ClusterSpec) -> int:
    """NICs per host of the cluster's transport (0: one host, no transport between hosts)."""
    return LINKS[cluster.transport].nics
