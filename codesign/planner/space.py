"""The plan space of one (model, cluster, micro-batch count), every plan priced by the cost model.

A candidate is a manual parallel spec the toolkit could have been given: pp dividing the layer
groups (one group per ZHEN layer), dp * op * pp = devices, remat, ZeRO-2 (dp > 1), both
schedules (pp > 1), the batch on dp or op (op > 1), and contiguous or host-tiled stage
placements. make_plan turns each into the Plan the engine would run, so what is priced is what
would run; a candidate make_plan rejects is left out.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator

from codesign.errors import PlanError
from codesign.planner.cost import Estimate, Workload, estimate
from codesign.planner.plan import Plan, make_plan
from codesign.config.types import SCHEDULES, ClusterSpec, Job, ParallelSpec


@dataclass(frozen=True)
class Priced:
    spec: ParallelSpec
    plan: Plan
    estimate: Estimate


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_specs(job: Job) -> Iterator[ParallelSpec]:
    """Every manual spec of the space for the job's model and cluster."""
    cluster, groups = job.cluster, job.model.num_zhen_layers
    n = cluster.num_devices
    for pp in divisors(groups):
        if n % pp:
            continue
        for dp in divisors(n // pp):
            op = n // pp // dp
            for remat, zero, schedule, axis, tile in itertools.product(
                    (False, True), (False, True) if dp > 1 else (False,), SCHEDULES if pp > 1 else ("1F1B",),
                    (0, 1) if op > 1 else (0,), [None, *host_tiles(cluster, dp * op)]):
                options = {"force_batch_dim_to_mesh_dim": axis} | ({"prefer_reduce_scatter": True} if zero else {})
                yield ParallelSpec(description=describe(pp, dp, op, remat, zero, schedule, axis, tile),
                                   num_micro_batches=(job.num_micro_batches,), num_auto_layers=groups,
                                   remat_layer=remat, pp_dp_op=(pp, dp, op), physical_mesh_shape=tile,
                                   auto_sharding_option=tuple(sorted(options.items())), pipeline_schedule=schedule)


def host_tiles(cluster: ClusterSpec, size: int) -> list[tuple[int, int]]:
    """Stage tiles [hosts, devices] that differ from contiguous blocks: spanning several hosts
    with part of each host's devices (an interleaved placement)."""
    hosts, per_host = cluster.num_hosts, cluster.num_devices_per_host
    return [(h, size // h) for h in divisors(hosts)
            if h > 1 and size % h == 0 and per_host % (size // h) == 0 and size // h < per_host]


def describe(pp: int, dp: int, op: int, remat: bool, zero: bool, schedule: str, axis: int,
             tile: tuple[int, int] | None) -> str:
    """A short name: "pp2 dp4 op1 remat zero2 GPipe batch@op tile[2,2]" (defaults left out)."""
    parts = [f"pp{pp} dp{dp} op{op}"]
    parts += ["remat"] * remat + ["zero2"] * zero + ([schedule] if pp > 1 and schedule != "1F1B" else [])
    parts += ["batch@op"] * (axis == 1) + ([f"tile[{tile[0]},{tile[1]}]"] if tile else [])
    return " ".join(parts)


def price(job: Job, workload: Workload, spec: ParallelSpec) -> Priced | None:
    """The spec's plan and estimate, or None when the engine could not run it."""
    concrete = dataclasses.replace(job, parallel=spec)
    try:
        plan = make_plan(concrete)
    except PlanError:
        return None
    return Priced(spec, plan, estimate(workload, plan))


def plan_space(job: Job, workload: Workload) -> list[Priced]:
    """Every runnable plan of the space, fastest first, those that fit before those that do not."""
    priced = [p for p in (price(job, workload, s) for s in candidate_specs(job)) if p is not None]
    return sorted(priced, key=rank_key)


def rank_key(p: Priced) -> tuple[bool, float]:
    return (not p.estimate.fits, p.estimate.seconds)


def same_plan(a: Plan, b: Plan) -> bool:
    """Equal as run: same stages on the same devices, batch axis, remat, ZeRO-2; the layer
    groups only matter under remat, the schedule only with several stages, the placement's
    name not at all."""
    def runs(p: Plan) -> tuple:
        stages = tuple((s.layers, s.device_ids, s.dp, s.op, s.groups if p.remat else None) for s in p.stages)
        return (stages, p.num_micro_batches, p.batch_axis, p.remat, p.reduce_scatter,
                p.schedule if len(p.stages) > 1 else None)

    return runs(a) == runs(b)
