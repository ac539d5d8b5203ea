"""How long each collective takes, as NCCL runs it on GPUs and as rings run on shared cores.

Sizes are as nccl-tests counts them: each device's buffer for all-reduce, the gathered output
for all-gather, the input for reduce-scatter, each device's send buffer for all-to-all. Bus
bandwidth is nccl-tests' too: the bytes each device moves per second, bytes x factor / time.

Inside one host, a GPU with a measured NCCL table (hardware.tables) is priced from it: log-log
between its sizes, its last bus bandwidth past the largest, its floor below the smallest; a group
size it did not time from the nearest it did, at the same bus bandwidth. Without a table, from
its NVLink: a latency growing as log2 of the group, and the bytes at the link's bandwidth.

Across hosts, each GPU's share of the bytes (1/per_host of them, reduced inside its host) rides
its NIC's ring over the hosts: bus bandwidth is bounded by the host's NICs, times hosts / (hosts
- 1) (two hosts exchange each share once), and stays flat as hosts are added; the host's NVLink
stages run pipelined with the network's (the slower bounds, they do not add). Latency grows
with log2 of the hosts.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from codesign.hardware.links import Link
from codesign.hardware.tables import COLLECTIVES, NcclCurves, table

KINDS = tuple(COLLECTIVES)  # all-reduce, all-gather, reduce-scatter, all-to-all
# What an XLA program's collective costs beyond NCCL's own time (the tables time NCCL's kernels,
# one process per GPU): its launch and the host's part in it. Fitted to XLA's own H100 table
# (all-reduce of 8 KiB on 8 GPUs, tests/published_hardware.py), checked on the others there.
LAUNCH = 16e-6


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw: what each device moves of the size, per byte of it."""
    return 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n


def from_curves(curves: NcclCurves, kind: str, nbytes: Any, n: int) -> Any:
    """One host's collective of nbytes on n GPUs, from the table."""
    sizes = curves.group_sizes
    timed = min((s for s in sizes if s >= n), default=sizes[-1])
    size, seconds = curves.curves[kind, timed]
    x = np.log(np.maximum(np.asarray(nbytes, float), size[0]))
    inside = np.exp(np.interp(x, np.log(size), np.log(seconds)))
    busbw = bus_factor(kind, timed) * size[-1] / seconds[-1]
    beyond = bus_factor(kind, timed) * np.asarray(nbytes, float) / busbw
    seconds = np.where(np.asarray(nbytes) > size[-1], beyond, inside)
    return _scalar(seconds * bus_factor(kind, n) / bus_factor(kind, timed) if timed != n else seconds)


@functools.lru_cache(maxsize=2**16)
def measured(device: str, kind: str, nbytes: float, n: int) -> float:
    """from_curves of a device kind's table, for one size."""
    return from_curves(table(device).nccl, kind, nbytes, n)


def over_link(kind: str, nbytes: Any, n: int, link: Link) -> Any:
    """One host's collective of nbytes on n GPUs over a link of theirs (no table)."""
    latency_steps, bytes_factor = link_terms(kind, n)
    return link.latency * latency_steps + bytes_factor * np.asarray(nbytes, float) / link.bandwidth


def link_terms(kind: str, n: int) -> tuple[float, float]:
    """(latencies, bytes per byte of the size) of over_link: what `codesign profile` fits a link to."""
    return 1 + math.log2(n), bus_factor(kind, n)


def across_hosts(kind: str, nbytes: Any, hosts: int, per_host: int, inside: Any, network: Link) -> Any:
    """A collective over hosts x per_host GPUs, given what it takes inside one host (`inside`, on
    per_host GPUs, for the same nbytes): NCCL's rings bounded by the host's NVLink stage or its
    NICs, whichever is slower, plus the network's latency per doubling of the hosts."""
    n = hosts * per_host
    nbytes = np.asarray(nbytes, float)
    if kind == "all-to-all":  # each device sends (n - per_host) / n of its buffer off its host
        network_time = per_host * nbytes * (n - per_host) / n / network.bandwidth
    else:  # each GPU's ring over the hosts (its NIC's rail) carries its 1/per_host share of the bytes
        network_time = bus_factor(kind, n) * nbytes / (network.bandwidth * hosts / (hosts - 1))
    host_time = np.asarray(inside) * (bus_factor(kind, n) / bus_factor(kind, per_host) if per_host > 1 else 1.0)
    return _scalar(np.maximum(host_time, network_time) + network.latency * math.log2(2 * hosts))


def ring(kind: str, nbytes: Any, n: int, link: Link, calls: Any = 1) -> Any:
    """A ring over n devices in `calls` collectives: 2(n-1) steps for an all-reduce, n-1 for the
    others, and each device sends bus_factor of the bytes (shared cores: XLA:CPU's collectives)."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return calls * steps * link.latency + bus_factor(kind, n) * nbytes / link.bandwidth


def _scalar(x: Any) -> Any:
    x = np.asarray(x)
    return float(x) if x.ndim == 0 else x
