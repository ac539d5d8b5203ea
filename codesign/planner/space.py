"""The plan space of one job (model, cluster, micro-batch count, layer groups): what Auto search
chooses from, `codesign plan` lists and the co-design ranking prices.

A plan of the space: the pipeline degree; stage boundaries over the job's `num_auto_layers`
layer groups, uneven allowed; each stage on a contiguous block of devices (within one host, or
whole hosts; blocks of different sizes allowed) or on host tiles; each stage's (dp, op); and,
plan-wide, the batch axis, remat, ZeRO-2 and the schedule (a Setting).

A manual parallel spec says one (pp, dp, op) for all stages and splits the groups evenly, so it
expresses the plans whose stages take as many groups, as many devices and the same (dp, op) as
each other: MANUAL, a filter over the space that the enumeration applies to a plan's parts as it
builds them, so listing those plans never builds the rest.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from codesign.config.types import SCHEDULES, ClusterSpec, Job
from codesign.cost.model import Estimate
from codesign.cost.plan import MESH_AXES, Plan, layer_groups, plan_from_stages, tile_devices
from codesign import families


@dataclass(frozen=True)
class Candidate:
    """One priced plan."""

    plan: Plan
    estimate: Estimate


def rank_key(c: Candidate) -> tuple[bool, float]:
    """Plans that fit first, then by predicted seconds per iteration."""
    return (not c.estimate.fits, c.estimate.seconds)


def by_rank(priced: Iterable[Candidate]) -> list[Candidate]:
    """The plans in rank order; ties keep the order they were priced in."""
    return sorted(priced, key=rank_key)


@dataclass(frozen=True)
class Setting:
    """The plan-wide choices."""

    batch_axis: str
    remat: bool
    reduce_scatter: bool
    schedule: str


def settings(pp: int) -> Iterator[Setting]:
    for axis, remat, zero, schedule in itertools.product(
            MESH_AXES, (False, True), (False, True), SCHEDULES if pp > 1 else SCHEDULES[:1]):
        yield Setting(axis, remat, zero, schedule)


def _alike(values: Iterable[object]) -> bool:
    return len(set(values)) <= 1


@dataclass(frozen=True)
class Only:
    """Which plans of the space to take, as predicates on a plan's parts: its split of the layer
    groups (per stage, its groups), its stages' devices and their (dp, op) meshes."""

    split: Callable[[Sequence[Sequence[int]]], bool]
    devices: Callable[[Sequence[Sequence[int]]], bool]
    meshes: Callable[[Sequence[tuple[int, int]]], bool]

    def admits(self, plan: Plan) -> bool:
        return (self.split([s.groups for s in plan.stages]) and self.devices([s.device_ids for s in plan.stages])
                and self.meshes([(s.dp, s.op) for s in plan.stages]))


EVERY = Only(split=lambda split: True, devices=lambda devices: True, meshes=lambda meshes: True)
MANUAL = Only(split=lambda split: _alike(map(len, split)), devices=lambda devices: _alike(map(len, devices)),
              meshes=_alike)


def expressible(plan: Plan) -> bool:
    """Whether a manual parallel spec can say the plan (pp, dp, op, num_auto_layers, remat,
    auto_sharding_option, pipeline_schedule, physical_mesh_shape or host_ids/device_ids)."""
    return MANUAL.admits(plan)


# -- the parts ---------------------------------------------------------------------------------

def degrees(job: Job) -> range:
    return range(1, min(len(layer_groups(job)), job.cluster.num_devices) + 1)


def block_sizes(job: Job) -> list[int]:
    """Device counts a contiguous stage may take: on one host any; across hosts (as Alpa's
    submeshes) a power of two or a divisor of a host's devices, or whole hosts."""
    per_host, hosts = job.cluster.num_devices_per_host, job.cluster.num_hosts
    inside = [s for s in range(1, per_host + 1) if hosts == 1 or per_host % s == 0 or s & (s - 1) == 0]
    return sorted(set(inside) | {h * per_host for h in range(1, hosts + 1)})


def block_fits(job: Job, offset: int, size: int) -> bool:
    """A block of devices [offset, offset + size) stays inside one host, or takes whole hosts."""
    per_host, n = job.cluster.num_devices_per_host, job.cluster.num_devices
    if offset + size > n:
        return False
    if size <= per_host and offset % per_host + size <= per_host:
        return True
    return size % per_host == 0 and offset % per_host == 0


def meshes(job: Job, size: int, batch_axis: str) -> list[tuple[int, int]]:
    """(dp, op) of a stage whose batch-axis size divides the micro-batch; op inside a host (its
    collectives run per mixer call) and dividing the widths it shards (the family's op_widths); the batch on op only
    where op > 1 (else it would be replicated over dp)."""
    micro_batch = job.global_batch // job.num_micro_batches
    widths = families.counts(job.model).op_widths(job.model)
    found = []
    for dp in range(1, size + 1):
        op = size // dp
        shards = dp if batch_axis == "dp" else op
        if (size % dp == 0 and micro_batch % shards == 0 and (batch_axis == "dp" or op > 1)
                and op <= job.cluster.num_devices_per_host and widths % op == 0):
            found.append((dp, op))
    return found


def placements(job: Job, pp: int) -> Iterator[list[tuple[int, ...]]]:
    """Each stage's devices: contiguous blocks in stage order, or the cluster's host tiles (part
    of each of several hosts, an interleaved placement) when there are pp of them."""
    n, sizes = job.cluster.num_devices, block_sizes(job)
    for blocks in _compositions(n, pp, sizes):
        offsets = list(itertools.accumulate(blocks, initial=0))
        if all(block_fits(job, o, s) for o, s in zip(offsets, blocks)):
            yield [tuple(range(o, o + s)) for o, s in zip(offsets, blocks)]
    yield from tiled(job, pp)


def tiled(job: Job, pp: int) -> Iterator[list[tuple[int, ...]]]:
    n, cluster = job.cluster.num_devices, job.cluster
    if n % pp == 0:
        for h, d in host_tiles(cluster, n // pp):
            yield tile_devices(cluster.num_hosts, cluster.num_devices_per_host, h, d)


def host_tiles(cluster: ClusterSpec, size: int) -> list[tuple[int, int]]:
    """Stage tiles [hosts, devices] that differ from contiguous blocks: spanning several hosts
    with part of each host's devices (an interleaved placement)."""
    hosts, per_host = cluster.num_hosts, cluster.num_devices_per_host
    return [(h, size // h) for h in _divisors(hosts)
            if h > 1 and size % h == 0 and per_host % (size // h) == 0 and size // h < per_host]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _compositions(total: int, parts: int, allowed: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        if total in allowed:
            yield (total,)
        return
    for first in allowed:
        if first < total:
            for rest in _compositions(total - first, parts - 1, allowed):
                yield (first, *rest)


def splits(groups: int, parts: int) -> Iterator[tuple[range, ...]]:
    """Every way to cut groups 0..groups-1 into `parts` contiguous non-empty runs."""
    for cuts in itertools.combinations(range(1, groups), parts - 1):
        bounds = (0, *cuts, groups)
        yield tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))


# -- the space ---------------------------------------------------------------------------------

def space_size(job: Job, limit: int) -> int:
    """How many plans all_plans yields (counted without building them), up to just past limit."""
    total, groups = 0, len(layer_groups(job))
    for pp in degrees(job):
        for devices in placements(job, pp):
            per_setting = sum(_mesh_count([meshes(job, len(ids), s.batch_axis) for ids in devices], s)
                              for s in settings(pp))
            total += math.comb(groups - 1, pp - 1) * per_setting
            if total > limit:
                return total
    return total


def all_plans(job: Job, only: Only = EVERY) -> Iterator[Plan]:
    """Every plan of the space that `only` admits."""
    groups = len(layer_groups(job))
    for pp in degrees(job):
        for devices, split, setting in itertools.product(
                [d for d in placements(job, pp) if only.devices(d)],
                [s for s in splits(groups, pp) if only.split(s)], list(settings(pp))):
            for mesh in itertools.product(*(meshes(job, len(ids), setting.batch_axis) for ids in devices)):
                if only.meshes(mesh) and shards_state(setting.reduce_scatter, mesh):
                    yield assemble(job, split, devices, mesh, setting)


def shards_state(reduce_scatter: bool, mesh: Sequence[tuple[int, int]]) -> bool:
    """ZeRO-2 only where some stage has a dp axis to shard its state over: elsewhere the plan
    is the one without it, priced and run the same."""
    return not reduce_scatter or any(dp > 1 for dp, _ in mesh)


def in_space(plan: Plan) -> bool:
    """Whether a plan built from parts (the search's proposals) is one the space holds."""
    return shards_state(plan.reduce_scatter, [(s.dp, s.op) for s in plan.stages])


def _mesh_count(options: Sequence[Sequence[tuple[int, int]]], setting: Setting) -> int:
    """How many of the stages' mesh combinations shards_state keeps."""
    total = math.prod(len(o) for o in options)
    if setting.reduce_scatter:
        total -= math.prod(sum(dp == 1 for dp, _ in o) for o in options)
    return total


def assemble(job: Job, split: Sequence[range], devices: Sequence[Sequence[int]], mesh: Sequence[tuple[int, int]],
             setting: Setting) -> Plan:
    """The plan of these parts (checked: PlanError if it cannot run the job)."""
    return plan_from_stages(job, [list(r) for r in split], [list(ids) for ids in devices], list(mesh),
                            batch_axis=setting.batch_axis, remat=setting.remat,
                            reduce_scatter=setting.reduce_scatter, schedule=setting.schedule)


def same_plan(a: Plan, b: Plan) -> bool:
    """Equal as run: same stages on the same devices, batch axis, remat, ZeRO-2; the layer
    groups only matter under remat, the schedule only with several stages, the placement's
    name not at all."""
    def runs(p: Plan) -> tuple:
        stages = tuple((s.layers, s.device_ids, s.dp, s.op, s.groups if p.remat else None) for s in p.stages)
        return (stages, p.num_micro_batches, p.batch_axis, p.remat, p.reduce_scatter,
                p.schedule if len(p.stages) > 1 else None)

    return runs(a) == runs(b)
