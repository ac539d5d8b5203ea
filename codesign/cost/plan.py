"""From a job to a concrete parallel plan: layer groups, stage devices, mesh axes, rules.

Pure Python (no JAX), so the orchestrator can reject an impossible plan as `invalid`
in microseconds and the job body can build exactly what was checked.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from codesign.errors import PlanError
from codesign.config.types import SCHEDULES, Job, Model
from codesign import families

MESH_AXES = ("dp", "op")


@dataclass(frozen=True)
class StagePlan:
    groups: tuple[tuple[int, ...], ...]  # its layer groups (remat regions), each of ZHEN layer indices
    device_ids: tuple[int, ...]  # global device indices (host-major), laid out as (dp, op)
    dp: int
    op: int

    @property
    def layers(self) -> tuple[int, ...]:
        """ZHEN layer indices this stage runs."""
        return tuple(i for g in self.groups for i in g)

    def describe(self) -> dict[str, Any]:
        grid = np.array(self.device_ids).reshape(self.dp, self.op).tolist()
        return {"layers": list(self.layers), "layer_range": [self.layers[0], self.layers[-1]],
                "groups": [list(g) for g in self.groups], "device_ids": list(self.device_ids),
                "mesh": {"dp": self.dp, "op": self.op}, "device_grid": grid}


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    num_micro_batches: int
    batch_axis: str  # mesh axis the batch dimension is sharded on
    remat: bool
    reduce_scatter: bool
    schedule: str
    placement: str  # how stage devices were chosen: "physical_mesh_shape", "host_ids/device_ids", "contiguous", "chosen"

    @property
    def rules(self) -> tuple[tuple[str, str | None], ...]:
        """Logical axis -> mesh axis: batch on its axis, MLP hidden dims split over op."""
        return (("batch", self.batch_axis), ("mlp", "op"))

    def syncs_once(self, pp: int) -> bool:
        """Whether the stages of a pp-stage plan reduce their gradients once per step, after their
        micro-batches: the batch on dp and not ZeRO-2 (whose reduce-scatter per micro-batch keeps
        only a shard of the gradients), and either a single stage (engine.step.accumulate keeps
        each batch shard's gradients apart until then) or pipeline stages of several
        micro-batches (engine.pipeline.deferred_axis: with one micro-batch the backward's
        all-reduce is the faster of the two)."""
        return self.batch_axis == "dp" and not self.reduce_scatter and (pp == 1 or self.num_micro_batches > 1)

    def describe(self, shardings: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
        """all_configs["plan"]: concrete devices, layers and (once built) shardings of every stage."""
        stages = [s.describe() for s in self.stages]
        for stage, sharding in zip(stages, shardings):
            stage["shardings"] = sharding
        return {"stages": stages, "num_micro_batches": self.num_micro_batches,
                "batch_axis": self.batch_axis, "rules": [list(r) for r in self.rules],
                "remat": self.remat, "reduce_scatter": self.reduce_scatter,
                "schedule": self.schedule if len(self.stages) > 1 else None,
                "placement": self.placement}

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (from_dict inverts it): what a chosen plan is recorded and
        sent to the job body as."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        try:
            stages = tuple(StagePlan(groups=tuple(tuple(g) for g in s["groups"]),
                                     device_ids=tuple(s["device_ids"]), dp=s["dp"], op=s["op"])
                           for s in data["stages"])
            return cls(**{**data, "stages": stages})
        except (KeyError, TypeError) as err:
            raise PlanError(f"malformed plan {data!r}: {err!r}") from None


def plan_name(plan: Plan) -> str:
    """The plan's short name, e.g. "pp2 dp[4,2] op1 layers[1,3] remat zero2 GPipe batch@op": a value
    per stage where stages differ, defaults left out. Layer counts, not group counts, so that a
    plan has one name whatever groups its space cut the layers into; the groups only under remat
    (its regions), where they are not one per layer. Where stages are not consecutive devices in
    order, how they lie: "tile[2,4]" (each on 2 runs of 4 devices, as host tiles are), else "placed"."""
    stages = plan.stages
    layers = [len(s.layers) for s in stages]
    groups = [len(s.groups) for s in stages]
    parts = [f"pp{len(stages)} dp{_per_stage([s.dp for s in stages])} op{_per_stage([s.op for s in stages])}"]
    parts += [f"layers{_per_stage(layers)}"] * (len(set(layers)) > 1)
    parts += [f"groups{_per_stage(groups)}"] * (plan.remat and groups != layers) + ["remat"] * plan.remat
    parts += ["zero2"] * plan.reduce_scatter + [plan.schedule] * (len(stages) > 1)
    return " ".join(parts + ["batch@op"] * (plan.batch_axis == "op") + _layout(stages))


def stage_kind(pp: int, dp: int, op: int, micro: int) -> str:
    """A stage's plan kind, what a calibration keeps a time factor under (cost.learning): "dp",
    "op", "dp x op", "pp x dp"..., "single"; one program accumulating micro-batches is its own kind
    ("dp, accumulating"): its steps run another program than one micro-batch's."""
    kind = " x ".join(axis for axis, n in (("pp", pp), ("dp", dp), ("op", op)) if n > 1) or "single"
    return f"{kind}, accumulating" if pp == 1 and micro > 1 else kind


def _per_stage(values: list[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else "[" + ",".join(map(str, values)) + "]"


def _layout(stages: Sequence[StagePlan]) -> list[str]:
    ids = [d for s in stages for d in s.device_ids]
    if ids == list(range(len(ids))):  # contiguous blocks in stage order
        return []
    runs = {_runs(s.device_ids) for s in stages}
    return [f"tile[{runs.pop()}]" if len(runs) == 1 and None not in runs else "placed"]


def _runs(device_ids: Sequence[int]) -> str | None:
    """"h,d" where the devices are h runs of d consecutive ids, else None."""
    starts = [i for i, d in enumerate(device_ids) if i == 0 or d != device_ids[i - 1] + 1]
    lengths = {b - a for a, b in zip(starts, [*starts[1:], len(device_ids)])}
    return f"{len(starts)},{lengths.pop()}" if len(lengths) == 1 else None


def make_plan(job: Job) -> Plan:
    """The concrete plan for a manual parallel spec; PlanError says why it cannot run."""
    parallel = job.parallel
    if parallel.is_auto:
        raise PlanError("an Auto search spec describes no plan: the toolkit chooses one (planner.auto.choose_plan)")
    pp, dp, op = parallel.pp_dp_op
    groups = layer_groups(job)
    stage_groups = split_stages(groups, pp)
    options = parallel.sharding_options
    batch_axis = MESH_AXES[options.get("force_batch_dim_to_mesh_dim", 0)]
    _check_batch(job, [{"dp": dp, "op": op}[batch_axis]] * pp, batch_axis)
    placement, devices = stage_devices(job)
    stages = tuple(StagePlan(groups=gs, device_ids=ids, dp=dp, op=op) for gs, ids in zip(stage_groups, devices))
    return Plan(stages=stages, num_micro_batches=job.num_micro_batches, batch_axis=batch_axis,
                remat=parallel.remat_layer,
                reduce_scatter=parallel.zero2,
                schedule=parallel.pipeline_schedule, placement=placement)


def plan_from_stages(job: Job, stage_groups: Sequence[Sequence[int]], stage_devices: Sequence[Sequence[int]],
                     meshes: Sequence[tuple[int, int]], num_groups: int | None = None, batch_axis: str = "dp",
                     remat: bool = False, reduce_scatter: bool = False, schedule: str = "1F1B",
                     placement: str = "chosen") -> Plan:
    """A plan of any contiguous assignment of the job's layer groups to stages, each stage on its
    own devices viewed as its own (dp, op) mesh; stages may differ in group count and submesh.

    stage_groups: per stage, the indices of its layer groups (of num_groups balanced groups,
    the job's num_auto_layers by default), e.g. [[0, 1], [2], [3, 4, 5]]; stage_devices: per
    stage, global device ids in (dp, op) order; meshes: per stage, (dp, op)."""
    groups = layer_groups(job, num_groups)
    _check_partition(stage_groups, len(groups), "layer groups")
    if not len(stage_groups) == len(stage_devices) == len(meshes):
        raise PlanError(f"{len(stage_groups)} stages of layer groups, {len(stage_devices)} device "
                        f"lists and {len(meshes)} (dp, op) meshes; give one of each per stage")
    stages = tuple(StagePlan(groups=tuple(groups[g] for g in gs), device_ids=tuple(ids), dp=dp, op=op)
                   for gs, ids, (dp, op) in zip(stage_groups, stage_devices, meshes))
    plan = Plan(stages=stages, num_micro_batches=job.num_micro_batches, batch_axis=batch_axis, remat=remat,
                reduce_scatter=reduce_scatter, schedule=schedule, placement=placement)
    check_plan(job, plan)
    return plan


def check_plan(job: Job, plan: Plan) -> None:
    """PlanError unless the plan can run the job: every layer once, in order, in non-empty groups
    and stages; each stage on dp * op devices of the cluster, no device in two stages; every
    stage's share of a micro-batch whole. (A manual plan also covers the whole cluster.)"""
    for i, stage in enumerate(plan.stages):
        if not stage.groups:
            raise PlanError(f"stage {i} has no layer groups")
    _check_partition([g for s in plan.stages for g in s.groups], job.model.num_layers, "layers",
                     part="layer group")
    if plan.num_micro_batches != job.num_micro_batches:
        raise PlanError(f"the plan is for {plan.num_micro_batches} micro-batches, the job has "
                        f"{job.num_micro_batches}")
    if plan.batch_axis not in MESH_AXES or plan.schedule not in SCHEDULES:
        raise PlanError(f"batch axis {plan.batch_axis!r} / schedule {plan.schedule!r}: expected one of "
                        f"{list(MESH_AXES)} / {list(SCHEDULES)}")
    if any(s.dp < 1 or s.op < 1 for s in plan.stages):
        raise PlanError(f"(dp, op) of every stage must be positive, got {[(s.dp, s.op) for s in plan.stages]}")
    _check_devices([s.device_ids for s in plan.stages], [s.dp * s.op for s in plan.stages],
                   job.cluster.num_devices)
    _check_batch(job, [getattr(s, plan.batch_axis) for s in plan.stages], plan.batch_axis)


def _check_partition(parts: Sequence[Sequence[int]], n: int, what: str, part: str = "stage") -> None:
    """parts, concatenated, are 0..n-1 in order, and none is empty."""
    for i, items in enumerate(parts):
        if not len(items):
            raise PlanError(f"{part} {i} takes no {what}")
    if [i for items in parts for i in items] != list(range(n)):
        raise PlanError(f"each {part} must take a contiguous run of the {n} {what} 0..{n - 1}, in order "
                        f"and each once; got {[list(p) for p in parts]}")


def layer_groups(job: Job, num_groups: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The model's layers cut into num_groups (default: the job's num_auto_layers) contiguous
    groups balanced by FLOPs."""
    groups, layers = num_groups or job.parallel.num_auto_layers, job.model.num_layers
    if groups > layers:
        raise PlanError(f"num_auto_layers = {groups} layer groups, but the model has only {layers} layers")
    return _flop_balanced(job.model, groups)


@functools.cache  # a search builds many plans of one model
def _flop_balanced(model: Model, groups: int) -> tuple[tuple[int, ...], ...]:
    counts = families.counts(model)
    return balanced_groups([counts.layer_flops(model, i) for i in range(model.num_layers)], groups)


def split_stages(groups: tuple[tuple[int, ...], ...], pp: int) -> list[tuple[tuple[int, ...], ...]]:
    """Stage i takes array_split(range(groups), pp)[i]: whole groups, the same count per stage."""
    if pp > len(groups):
        raise PlanError(f"pp = {pp} pipeline stages but only {len(groups)} layer groups "
                        f"(num_auto_layers); raise num_auto_layers to a multiple of pp")
    if len(groups) % pp:
        raise PlanError(f"num_auto_layers = {len(groups)} is not divisible by pp = {pp}")
    return [tuple(groups[i] for i in part) for part in np.array_split(np.arange(len(groups)), pp)]


def balanced_groups(costs: list[int], k: int) -> tuple[tuple[int, ...], ...]:
    """Cut costs into k contiguous non-empty groups minimising the largest group's cost."""
    n = len(costs)
    prefix = np.concatenate([[0], np.cumsum(costs)])

    @functools.cache
    def best(start: int, parts: int) -> tuple[int, tuple[int, ...]]:
        if parts == 1:
            return int(prefix[n] - prefix[start]), (n,)
        options = []
        for end in range(start + 1, n - parts + 2):
            rest, cuts = best(end, parts - 1)
            options.append((max(int(prefix[end] - prefix[start]), rest), (end, *cuts)))
        return min(options)

    _, cuts = best(0, k)
    bounds = (0, *cuts)
    return tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]))


def _check_batch(job: Job, batch_shards: list[int], batch_axis: str) -> None:
    """batch_shards: per stage, the size of its mesh axis the batch is sharded on."""
    batch, micro = job.global_batch, job.num_micro_batches
    if batch % micro:
        raise PlanError(f"global batch {batch} is not divisible by num_micro_batches = {micro}")
    for i, shards in enumerate(batch_shards):
        if (batch // micro) % shards:
            raise PlanError(f"micro-batch of {batch // micro} samples cannot be split over "
                            f"{shards} devices of mesh axis {batch_axis}"
                            + (f" of stage {i}" if len(batch_shards) > 1 else ""))


def stage_devices(job: Job) -> tuple[str, list[tuple[int, ...]]]:
    """Each stage's global device ids in (dp, op) order, and which rule chose them."""
    parallel, cluster = job.parallel, job.cluster
    pp, dp, op = parallel.pp_dp_op
    if parallel.host_ids is not None:
        placement, devices = "host_ids/device_ids", _listed_devices(job)
    elif parallel.physical_mesh_shape is not None:
        placement, devices = "physical_mesh_shape", _tiled_devices(job)
    else:
        size = dp * op
        placement, devices = "contiguous", [tuple(range(i * size, (i + 1) * size)) for i in range(pp)]
    _check_cover(devices, pp, dp * op, cluster.num_devices)
    return placement, devices


def _tiled_devices(job: Job) -> list[tuple[int, ...]]:
    """Stage i takes the i-th (hosts x devices) tile of the host-major cluster grid."""
    (h, d), cluster = job.parallel.physical_mesh_shape, job.cluster
    hosts, per_host = cluster.num_hosts, cluster.num_devices_per_host
    _, dp, op = job.parallel.pp_dp_op
    if h * d != dp * op:
        raise PlanError(f"physical_mesh_shape [{h}, {d}] holds {h * d} devices, but dp * op = {dp * op}")
    if hosts % h or per_host % d:
        raise PlanError(f"physical_mesh_shape [{h}, {d}] does not tile the cluster {hosts}x{per_host}")
    return tile_devices(hosts, per_host, h, d)


def tile_devices(hosts: int, per_host: int, h: int, d: int) -> list[tuple[int, ...]]:
    """The (h hosts x d devices) tiles of a host-major cluster grid, each's ids host-major."""
    grid = np.arange(hosts * per_host).reshape(hosts, per_host)
    return [tuple(int(i) for i in grid[r:r + h, c:c + d].ravel())
            for r in range(0, hosts, h) for c in range(0, per_host, d)]


def _listed_devices(job: Job) -> list[tuple[int, ...]]:
    """Stage i: for each host in host_ids[i], the devices device_ids[i][host] (global = host-major)."""
    parallel, cluster = job.parallel, job.cluster
    stages = []
    for i, (hosts, devices) in enumerate(zip(parallel.host_ids, parallel.device_ids)):
        ids = []
        for host, local in zip(hosts, devices):
            if host >= cluster.num_hosts or any(d >= cluster.num_devices_per_host for d in local):
                raise PlanError(f"stage {i}: host {host} devices {list(local)} are outside the cluster "
                                f"{cluster.num_hosts}x{cluster.num_devices_per_host}")
            ids += [host * cluster.num_devices_per_host + d for d in local]
        stages.append(tuple(ids))
    return stages


def _check_cover(devices: list[tuple[int, ...]], pp: int, size: int, total: int) -> None:
    """Stages get dp * op devices each, no device twice, and together the whole cluster."""
    if len(devices) != pp:
        raise PlanError(f"the placement gives {len(devices)} stage submeshes, but pp = {pp}")
    _check_devices(devices, [size] * pp, total)
    missing = sorted(set(range(total)) - {d for ids in devices for d in ids})
    if missing:
        raise PlanError(f"device(s) {missing} of the cluster belong to no stage")


def _check_devices(devices: Sequence[Sequence[int]], sizes: list[int], total: int) -> None:
    """Stage i gets sizes[i] (its dp * op) devices of the cluster's total, no device twice."""
    for i, (ids, size) in enumerate(zip(devices, sizes)):
        if len(ids) != size:
            raise PlanError(f"stage {i} gets {len(ids)} devices, but dp * op = {size}")
    flat = [d for ids in devices for d in ids]
    outside = sorted({d for d in flat if not 0 <= d < total})
    if outside:
        raise PlanError(f"device(s) {outside} are outside the cluster of {total} devices")
    twice = sorted(d for d, times in collections.Counter(flat).items() if times > 1)
    if twice:
        raise PlanError(f"device(s) {twice} are placed in more than one stage")
