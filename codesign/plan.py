"""From a job to a concrete parallel plan: layer groups, stage devices, mesh axes, rules.

Pure Python (no JAX), so the orchestrator can reject an impossible plan as `invalid`
in microseconds and the job body can build exactly what was checked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from codesign import zhen
from codesign.errors import PlanError
from codesign.specs import Job

MESH_AXES = ("dp", "op")


@dataclass(frozen=True)
class StagePlan:
    layers: tuple[int, ...]  # ZHEN layer indices this stage runs
    groups: tuple[tuple[int, ...], ...]  # its layer groups (remat regions)
    device_ids: tuple[int, ...]  # global device indices (host-major), laid out as (dp, op)
    dp: int
    op: int


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    num_micro_batches: int
    batch_axis: str  # mesh axis the batch dimension is sharded on
    remat: bool
    reduce_scatter: bool
    schedule: str

    @property
    def rules(self) -> tuple[tuple[str, str | None], ...]:
        """Logical axis -> mesh axis: batch on its axis, MLP hidden dims split over op."""
        return (("batch", self.batch_axis), ("mlp", "op"))

    def describe(self) -> dict[str, Any]:
        return {"stages": [{"layers": list(s.layers), "groups": [list(g) for g in s.groups],
                            "device_ids": list(s.device_ids), "mesh": {"dp": s.dp, "op": s.op}}
                           for s in self.stages],
                "num_micro_batches": self.num_micro_batches, "batch_axis": self.batch_axis,
                "rules": [list(r) for r in self.rules], "remat": self.remat,
                "reduce_scatter": self.reduce_scatter, "schedule": self.schedule}


def make_plan(job: Job) -> Plan:
    """The concrete plan for a manual parallel spec; PlanError says why it cannot run."""
    parallel = job.parallel
    if parallel.is_auto:
        raise PlanError("Auto search is not supported yet")
    pp, dp, op = parallel.pp_dp_op
    if pp > 1:
        raise PlanError("pipeline parallelism (pp > 1) is not supported yet")
    groups = layer_groups(job)
    options = parallel.sharding_options
    batch_axis = MESH_AXES[options.get("force_batch_dim_to_mesh_dim", 0)]
    _check_batch(job, {"dp": dp, "op": op}[batch_axis], batch_axis)
    _check_mesh_shape(job)
    stage = StagePlan(layers=tuple(i for g in groups for i in g), groups=groups,
                      device_ids=tuple(range(job.cluster.num_devices)), dp=dp, op=op)
    return Plan(stages=(stage,), num_micro_batches=job.num_micro_batches, batch_axis=batch_axis,
                remat=parallel.remat_layer,
                reduce_scatter=bool(options.get("prefer_reduce_scatter", False)),
                schedule=parallel.pipeline_schedule)


def layer_groups(job: Job) -> tuple[tuple[int, ...], ...]:
    groups, layers = job.parallel.num_auto_layers, job.model.num_zhen_layers
    if groups > layers:
        raise PlanError(f"num_auto_layers = {groups} layer groups, but the model has only {layers} layers")
    costs = [zhen.layer_flops(job.model, i) for i in range(layers)]
    return balanced_groups(costs, groups)


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


def _check_batch(job: Job, batch_shards: int, batch_axis: str) -> None:
    batch, micro = job.global_batch, job.num_micro_batches
    if batch % micro:
        raise PlanError(f"global batch {batch} is not divisible by num_micro_batches = {micro}")
    if (batch // micro) % batch_shards:
        raise PlanError(f"micro-batch of {batch // micro} samples cannot be split over "
                        f"{batch_shards} devices of mesh axis {batch_axis}")


def _check_mesh_shape(job: Job) -> None:
    shape = job.parallel.physical_mesh_shape
    cluster = job.cluster
    if shape and tuple(shape) != (cluster.num_hosts, cluster.num_devices_per_host):
        raise PlanError(f"physical_mesh_shape {list(shape)} does not tile the cluster "
                        f"{cluster.num_hosts}x{cluster.num_devices_per_host} with one stage")
