"""The hardware interface: what the cost model asks of a cluster's devices, answered in seconds.

`Devices` answers for devices of their own (GPUs): a mixer call at a profile's measured rates or
as the GEMMs it runs (hardware.gemm), a memory pass, each collective (hardware.collectives), a
transfer between stages, and the host's launches. Devices that share one machine's cores
(virtual CPU devices) are another implementation of the same questions (hardware.shared_cores).
The cost model composes plans from these answers; it reads no coefficient of the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import functools
from typing import Any, Sequence

import numpy as np

from codesign.config.types import ClusterSpec
from codesign.hardware import collectives
from codesign.hardware.datasheets import data_sheet, peak
from codesign.hardware.gemm import gemm_seconds, gemm_times
from codesign.hardware.links import NVLINK, Link, nics
from codesign.hardware.profiles import LAYER, DeviceProfile, Points, interpolated
from codesign.hardware.tables import table


@dataclass(frozen=True)
class Devices:
    """A cluster's devices of their own (GPUs) and the links between them."""

    profile: DeviceProfile
    intra: Link
    inter: Link
    nics: int = 0  # per host, of the transport between hosts
    # a search prices the same collectives many times: collective's scalar answers, by their arguments
    _collectives: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    shares_cores = False

    @classmethod
    def of(cls, profile: DeviceProfile, cluster: ClusterSpec, intra: Link, inter: Link) -> Devices:
        from codesign.hardware.shared_cores import SharedCores  # it extends this class

        kind = SharedCores if profile.shares_cores else cls
        return kind(profile, intra, inter, nics(cluster))

    # -- kernels -------------------------------------------------------------------------------

    def call(self, flops: float, rate: float, overhead: float, share: float = 1.0, points: Points = (),
             fixed_share: float | None = None) -> float:
        """One call at a profile's rates: its fixed cost plus its FLOPs at the effective rate (or
        interpolated between measured points), slowed by the share of the device's speed it
        gets; the fixed cost at `fixed_share` where given."""
        if points:
            return interpolated(points, flops, rate) / share
        return overhead / (fixed_share or share) + flops / rate / share

    def mixer(self, kind: str, precision: str, work: Any, gemms: Sequence[Any], samples: float, split: int,
              share: float, fixed_at: float, backward_calls: int = 2) -> tuple[float, float, float]:
        """(forward, backward, the fixed cost of one call) of a call of one mixer kind (or the
        layer's own work) on `samples` samples, op splitting its sharded work `split` ways: at the
        profile's rates, or as the GEMMs it runs (`gemms`, families.work.Gemm) plus its launch."""
        rate = self.profile.rate(precision, kind)
        fixed = rate.overhead / fixed_at
        if self.prices_gemms:
            forward, backward = self.gemms(precision, work, gemms, samples, split)
            return forward + fixed, backward + backward_calls * fixed, fixed
        flops = samples * (work.flops - work.sharded_flops + work.sharded_flops / split)
        skipped = flops * work.skipped_backward / work.flops if work.flops else 0.0
        return (self.call(flops, rate.forward, rate.overhead, share, rate.forward_points, fixed_at),
                self.call(2 * flops - skipped, rate.backward, backward_calls * rate.overhead, share,
                          rate.backward_points, fixed_at), fixed)

    def gemms(self, precision: str, work: Any, gemms: Sequence[Any], samples: float, split: int) -> tuple[float, float]:
        """(forward, backward) seconds of one call's matmuls on one device (matmul_seconds), and the
        FLOPs outside matmuls (a convolution's taps) at the device's elementwise rate."""
        forward, backward, flops, facing = matmul_seconds(self.profile.kind, precision, tuple(gemms), samples, split,
                                                          bool(work.skipped_backward))
        other = samples * (work.flops - flops)
        if other > 0:
            skipped = work.skipped_backward - facing if work.skipped_backward else 0
            rate = self.profile.rate(precision, LAYER)
            forward += other / rate.forward
            backward += (2 * other - samples * max(skipped, 0)) / rate.backward
        return forward, backward

    def activations(self, nbytes: Any, share: float = 1.0) -> Any:
        """The memory traffic of a call's activations, where its rates do not already include it."""
        return self.memory(nbytes, share) if self.profile.roofline else 0.0

    @functools.cached_property
    def prices_gemms(self) -> bool:
        """Whether mixer calls are priced as the GEMMs they run (a data-sheet GPU), not at rates."""
        return self.profile.gemms and data_sheet(self.profile.kind) is not None

    def fastest_rate(self, precision: str) -> float | None:
        """FLOP/s no matmul beats (for lower bounds): the data sheet's peak where GEMMs price it."""
        sheet = data_sheet(self.profile.kind)
        return peak(sheet, precision) if self.prices_gemms and sheet else None

    def memory(self, nbytes: Any, share: float = 1.0) -> Any:
        """A pass of nbytes through device memory, at the share of its bandwidth the device gets."""
        return nbytes / (self.profile.bandwidth * share)

    # -- what devices of their own do not share --------------------------------------------------

    def share(self, busy: int) -> float:
        return self.profile.share(busy)

    def fixed_share(self, busy: int, op: int) -> float:
        return self.profile.share(busy)

    def memory_share(self, busy: int) -> float:
        return 1.0

    def call_cost(self, devices: int) -> float:
        """The host's seconds to launch one program: asynchronous, one launch per program."""
        return self.profile.dispatch

    def lockstep(self, op: int) -> float:
        return 1.0

    def remat_fixed(self, fixed: Any) -> Any:
        """A recomputing backward launches the forward's kernels again: it saves none of them."""
        return 0.0

    def program_overheads(self, overheads: Any) -> Any:
        """A GPU pays its fixed costs per kernel launch, every micro-batch: none paid once."""
        return 0.0

    def copies(self, nbytes: Any, busy: int) -> Any:
        """The copies XLA makes around its collectives (profile.shared.sync_traffic, 0 on a GPU)."""
        return self.memory(nbytes, self.memory_share(busy))

    def pipeline_floor(self, plan: Any, stages: Sequence[Any], busy: int, host: float = 0.0) -> float:
        return 0.0

    def host_energy(self, stages: Sequence[Any], seconds: Any) -> Any:
        return None

    # -- links ---------------------------------------------------------------------------------

    def collective(self, kind: str, nbytes: Any, hosts: int, per_host: int, calls: Any = 1) -> Any:
        """A collective over hosts x per_host devices, in `calls` collectives of nbytes in all."""
        if hosts * per_host <= 1:
            return 0.0
        if isinstance(nbytes, np.ndarray) or isinstance(calls, np.ndarray):
            return self._collective(kind, nbytes, hosts, per_host, calls)
        key = (kind, nbytes, hosts, per_host, calls)
        if key not in self._collectives:
            self._collectives[key] = self._collective(kind, nbytes, hosts, per_host, calls)
        return self._collectives[key]

    def _collective(self, kind: str, nbytes: Any, hosts: int, per_host: int, calls: Any) -> Any:
        each = nbytes / np.maximum(calls, 1)  # calls may be 0 (arrays of mixers, some with none sharded)
        inside = self.within_host(kind, each, per_host) if per_host > 1 else 0.0
        if hosts > 1:
            inside = collectives.across_hosts(kind, each, hosts, per_host, inside, self.inter)
        return calls * (collectives.LAUNCH + inside)

    @functools.cached_property
    def measured_nccl(self):
        """The device kind's measured NCCL table, unless a link of its own was measured or declared
        ([links.NVLink]): the one place that decides which prices a host's collectives."""
        tables = table(self.profile.kind)
        return tables if tables is not None and tables.nccl is not None and self.intra == NVLINK else None

    def within_host(self, kind: str, nbytes: Any, n: int) -> Any:
        """One host's collective: from its measured NCCL table where it has one, else over NVLink."""
        tables = self.measured_nccl
        if tables is None:
            return collectives.over_link(kind, nbytes, n, self.intra)
        if np.ndim(nbytes) == 0:  # a plan prices the same collectives many times
            return collectives.measured(self.profile.kind, kind, float(nbytes), n)
        return collectives.from_curves(tables.nccl, kind, nbytes, n)

    def within_host_source(self) -> str:
        tables = self.measured_nccl
        return f"{tables.source} nccl" if tables is not None else f"link {self.intra}"

    def collective_source(self, hosts: int) -> str:
        """Where a collective's figure over this many hosts comes from."""
        inside = self.within_host_source()
        return inside if hosts <= 1 else f"{inside}; between hosts: link {self.inter}"

    def gemm_source(self) -> str:
        """Where a mixer call's figure comes from: its GEMMs' table or data sheet, or the profile's rates."""
        if self.prices_gemms:
            return gemm_seconds(self.profile.kind, "bf16", 1024, 1024, 1024)[1]
        return f"{self.profile.source} profile rates"

    def point_to_point(self, nbytes: Any, across_hosts: bool, senders: int = 1) -> Any:
        """One device's transfer to another stage's: over NVLink inside a host; across hosts over
        one NIC of its host, `senders` devices of the host sending at once."""
        if not across_hosts:
            return self.intra.latency + nbytes / self.intra.bandwidth
        share = max(self.nics, senders) if self.nics else senders
        return self.inter.latency + nbytes * share / self.inter.bandwidth


@functools.lru_cache(maxsize=2**16)
def matmul_seconds(kind: str, precision: str, gemms: tuple, samples: float, split: int,
                   first: bool) -> tuple[float, float, int, int]:
    """(forward, backward, FLOPs per sample, of them the input-facing ones') of one call's GEMMs
    (families.work.Gemm) on `samples` samples: op splitting m, n or k of the sharded ones, the
    backward's input and weight gradients, the input-facing ones' input gradient skipped in the
    `first` layer. A search prices the same calls many times."""
    shapes, roles = [], []
    for g in gemms:
        m = samples * g.rows / (split if g.split == "m" else 1)
        n, k = (g.n / split, g.k) if g.split == "n" else (g.n, g.k / split) if g.split == "k" else (g.n, g.k)
        shapes += [(m, n, k), (k, n, m)]  # forward, the weights' gradient
        roles += [0, 1]
        if not (first and g.input_facing):
            shapes.append((m, k, n))  # the input's gradient
            roles.append(1)
    seconds = gemm_times(kind, precision, tuple(shapes)) if shapes else ()
    forward = sum(s for s, role in zip(seconds, roles) if role == 0)
    backward = sum(s for s, role in zip(seconds, roles) if role == 1)
    return forward, backward, sum(g.flops for g in gemms), sum(g.flops for g in gemms if g.input_facing)
