"""What the cost model prices a plan against: the job's per-layer work on a cluster's devices
and links (a Workload), and where a stage runs (a Submesh). Pure Python, as cost.model."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from codesign.config.loader import LinkSpec
from codesign.config.types import ClusterSpec, Job, Model
from codesign.hardware.links import Link, cluster_links
from codesign.hardware.profiles import DeviceProfile
from codesign.cost.formulas import ACTIVATION_BYTES, StageCost
from codesign.hardware.device import Devices
from codesign.cost.plan import StagePlan
from codesign import families
from codesign.families.work import Gemm, Work

@dataclass(frozen=True)
class Workload:
    """What every plan of one (model, cluster, training, micro-batch count) shares."""

    model: Model
    cluster: ClusterSpec
    precision: str
    global_batch: int
    micro_batches: int
    profile: DeviceProfile
    intra: Link
    inter: Link
    layers: tuple[Work, ...]  # per layer, all of it
    own: tuple[Work, ...]  # per layer, outside its mixers
    mixers: tuple[tuple[tuple[str, Work], ...], ...]  # per layer, (kind, work) of each mixer
    gemms: tuple[tuple[tuple[Gemm, ...], ...], ...] = ()  # per layer, each mixer's matmuls
    own_gemms: tuple[tuple[Gemm, ...], ...] = ()  # per layer, its own matmul's
    # estimate's stages by what they read: a search prices each stage in many plans
    stage_costs: dict[tuple, StageCost] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, job: Job, profile: DeviceProfile, links: Iterable[LinkSpec] = ()) -> Workload:
        m, fold, counts = job.model, job.training.fold_dot, families.counts(job.model)
        intra, inter = cluster_links(profile, job.cluster, links)
        layers = range(m.num_layers)
        mixers = tuple(counts.layer_mixers(m, i, fold) for i in layers)
        return cls(m, job.cluster, job.training.precision, job.global_batch, job.num_micro_batches,
                   profile, intra, inter, tuple(counts.layer_work(m, i, fold) for i in layers),
                   tuple(counts.layer_own_work(m, i) for i in layers), mixers,
                   tuple(counts.layer_gemms(m, i, fold) for i in layers),
                   tuple(counts.layer_own_gemms(m, i) for i in layers))

    @functools.cached_property
    def hw(self) -> Devices:
        """The hardware's answers for this cluster's devices and links."""
        return Devices.of(self.profile, self.cluster, self.intra, self.inter)

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.micro_batches

    @property
    def activation_bytes(self) -> int:
        return ACTIVATION_BYTES[self.precision]

    def group(self, devices: Sequence[int]) -> tuple[int, int]:
        """(hosts, devices per host) a collective over these devices spans."""
        per_host = self.cluster.num_devices_per_host
        hosts = len({d // per_host for d in devices})
        return hosts, max(1, len(devices) // hosts)

    def transfer(self, nbytes: float, src: Sequence[int], dst: Sequence[int]) -> float:
        """Each of src's devices sending nbytes to dst's: inside a host where they share one, else
        across hosts, as many devices of a host sending at once as src has there."""
        per_host = self.cluster.num_devices_per_host
        across = not {d // per_host for d in src} & {d // per_host for d in dst}
        return self.hw.point_to_point(nbytes, across, min(len(src), per_host))

    def collective(self, kind: str, nbytes: float, devices: Sequence[int], calls: int = 1) -> float:
        return self.hw.collective(kind, nbytes, *self.group(devices), calls)

    def collective_calls(self, layers: Sequence[int]) -> int:
        """Collectives over these layers' parameters (or gradients): one, where XLA combines them
        (GPU); one per array on CPU, where each array's reduction pays the devices' rendezvous."""
        return 1 if self.profile.combines_collectives else sum(self.layers[i].tensors for i in layers)


@dataclass(frozen=True)
class Submesh:
    """Where a stage runs: its (dp, op) grid of device ids, and the batch's mesh axis."""

    device_ids: tuple[int, ...]
    dp: int
    op: int
    batch_axis: str = "dp"

    @classmethod
    def of(cls, stage: StagePlan, batch_axis: str) -> Submesh:
        return cls(stage.device_ids, stage.dp, stage.op, batch_axis)

    @property
    def batch_shards(self) -> int:
        return self.dp if self.batch_axis == "dp" else self.op

    @property
    def dp_group(self) -> tuple[int, ...]:
        return self.device_ids[::self.op]

    @property
    def op_group(self) -> tuple[int, ...]:
        return self.device_ids[:self.op]
