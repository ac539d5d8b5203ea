"""Auto search: choose a job's parallel plan by pricing plans with the cost model, not compiling them.

The space (one cluster, the job's micro-batch count): pipeline degree; stage boundaries over the
job's `num_auto_layers` layer groups, uneven allowed; each stage on a contiguous block of devices
(within one host, or whole hosts), blocks of different sizes allowed; each stage's (dp, op); and,
plan-wide, the batch axis, remat, ZeRO-2 and the schedule. Plans that cannot fit are dropped, the
rest ranked by predicted seconds per iteration.

Where the space is small every plan is priced. Where it is large, a dynamic program over stage
boundaries and device offsets (the shape of Alpa's inter-operator pass) proposes plans: for each
layer-group range, block size and pipeline slot, the fastest (dp, op) that fits; then, for each
bound t_max on a stage's time, the stages minimising sum(stage times) + (micro - 1) * t_max. The
proposals of every pipeline degree and plan-wide setting are then priced exactly by `estimate`
(which simulates the schedule) and ranked.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from codesign.errors import PlanError
from codesign.planner.columns import plan_columns
from codesign.planner.cost import Estimate, StageCost, Workload, estimate, stage_cost
from codesign.planner.plan import (
    MESH_AXES,
    Plan,
    StagePlan,
    layer_groups,
    plan_from_stages,
)
from codesign.planner.profiles import ProfileBook
from codesign.planner.schedule import max_in_flight
from codesign.spec.config import LinkSpec
from codesign.spec.types import SCHEDULES, Job

EXHAUSTIVE_LIMIT = 3000  # plans: price every one below this, else let the dynamic program propose
THRESHOLDS = 32  # t_max bounds the dynamic program tries per (pipeline degree, setting)
PROPOSALS = 3  # plans each (pipeline degree, setting) hands to exact pricing
RUNNERS_UP = 5


@dataclass(frozen=True)
class Candidate:
    """One priced plan."""

    plan: Plan
    estimate: Estimate


@dataclass(frozen=True)
class AutoChoice:
    """The plans that fit, best predicted first, and what the search cost."""

    ranked: tuple[Candidate, ...]  # at least one
    priced: int  # plans priced exactly by the cost model
    seconds: float  # search time
    devices_per_host: int = 1  # of the job's cluster: how the plan reads as manual-spec columns

    def best(self) -> Candidate:
        return self.ranked[0]

    def record(self) -> dict[str, Any]:
        """all_configs["auto_search"]: the chosen plan as a manual spec would say it, its
        prediction, the search's time and size, and the runners-up with their predictions."""
        best = self.best()
        return {**_described(best, self.devices_per_host), "search_seconds": self.seconds, "priced": self.priced,
                "feasible": len(self.ranked),
                "runners_up": [_described(c, self.devices_per_host) for c in self.ranked[1:1 + RUNNERS_UP]]}


class NoPlanFits(PlanError):
    """No plan of the space fits the device's memory: the attempt is `oom`, with this message."""


@dataclass(frozen=True)
class Setting:
    """The plan-wide choices."""

    batch_axis: str
    remat: bool
    reduce_scatter: bool
    schedule: str


def choose_plan(job: Job, book: ProfileBook, links: Iterable[LinkSpec] = ()) -> AutoChoice:
    """The plans of the job's space that fit, ranked by predicted time; NoPlanFits when none does."""
    start = time.perf_counter()
    workload = Workload.of(job, book.for_job(job), links)
    plans = list(itertools.islice(all_plans(job), EXHAUSTIVE_LIMIT + 1))
    if len(plans) > EXHAUSTIVE_LIMIT:
        plans = dp_plans(job, workload)
    priced = [Candidate(p, estimate(workload, p)) for p in _unique(plans)]
    ranked = tuple(sorted((c for c in priced if c.estimate.fits), key=lambda c: c.estimate.seconds))
    if not ranked:
        raise NoPlanFits(_no_fit_message(job, workload, priced))
    return AutoChoice(ranked, len(priced), time.perf_counter() - start, job.cluster.num_devices_per_host)


# -- the space -------------------------------------------------------------------------------

def settings(pp: int) -> Iterator[Setting]:
    for axis, remat, zero, schedule in itertools.product(
            MESH_AXES, (False, True), (False, True), SCHEDULES if pp > 1 else SCHEDULES[:1]):
        yield Setting(axis, remat, zero, schedule)


def block_sizes(job: Job) -> list[int]:
    """Device counts a stage may take: any within one host, or whole hosts."""
    per_host, hosts = job.cluster.num_devices_per_host, job.cluster.num_hosts
    return sorted(set(range(1, per_host + 1)) | {h * per_host for h in range(1, hosts + 1)})


def block_fits(job: Job, offset: int, size: int) -> bool:
    """A block of devices [offset, offset + size) stays inside one host, or takes whole hosts."""
    per_host, n = job.cluster.num_devices_per_host, job.cluster.num_devices
    if offset + size > n:
        return False
    if size <= per_host and offset % per_host + size <= per_host:
        return True
    return size % per_host == 0 and offset % per_host == 0


def meshes(job: Job, size: int, batch_axis: str) -> list[tuple[int, int]]:
    """(dp, op) of a block whose batch-axis size divides the micro-batch; the batch on op only
    where op > 1 (on an op of 1 it would be replicated over dp)."""
    micro_batch = job.global_batch // job.num_micro_batches
    found = []
    for dp in range(1, size + 1):
        if size % dp:
            continue
        op = size // dp
        shards = dp if batch_axis == "dp" else op
        if micro_batch % shards == 0 and (batch_axis == "dp" or op > 1):
            found.append((dp, op))
    return found


def _compositions(total: int, parts: int, allowed: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        if total in allowed:
            yield (total,)
        return
    for first in allowed:
        if first < total:
            for rest in _compositions(total - first, parts - 1, allowed):
                yield (first, *rest)


def _splits(groups: int, parts: int) -> Iterator[list[range]]:
    """Every way to cut groups 0..groups-1 into `parts` contiguous non-empty runs."""
    for cuts in itertools.combinations(range(1, groups), parts - 1):
        bounds = (0, *cuts, groups)
        yield [range(a, b) for a, b in zip(bounds, bounds[1:])]


def all_plans(job: Job) -> Iterator[Plan]:
    """Every plan of the space (lazily: the caller stops when there are too many)."""
    num_groups, n = len(layer_groups(job)), job.cluster.num_devices
    sizes = block_sizes(job)
    for pp in range(1, min(num_groups, n) + 1):
        for split, blocks in itertools.product(list(_splits(num_groups, pp)), list(_compositions(n, pp, sizes))):
            offsets = list(itertools.accumulate(blocks, initial=0))
            if not all(block_fits(job, o, s) for o, s in zip(offsets, blocks)):
                continue
            for setting in settings(pp):
                for mesh in itertools.product(*(meshes(job, s, setting.batch_axis) for s in blocks)):
                    yield _plan(job, split, [range(o, o + s) for o, s in zip(offsets, blocks)], mesh, setting)


def _plan(job: Job, split: Sequence[range], blocks: Sequence[range], mesh: Sequence[tuple[int, int]],
          setting: Setting) -> Plan:
    return plan_from_stages(job, [list(r) for r in split], [list(b) for b in blocks], list(mesh),
                            batch_axis=setting.batch_axis, remat=setting.remat,
                            reduce_scatter=setting.reduce_scatter, schedule=setting.schedule)


def _unique(plans: Iterable[Plan]) -> list[Plan]:
    return list(dict.fromkeys(plans))


# -- the dynamic program -----------------------------------------------------------------------

class StageTable:
    """Per (group range, block size, slot of a pp-stage pipeline): the fastest (dp, op) that fits,
    and its time per micro-batch (forward + backward with its gradient sync). Stage costs are
    memoised on what they depend on: the range, the mesh, the setting, and the slot only through
    the micro-batches it holds and whether it is the first or last stage."""

    def __init__(self, job: Job, workload: Workload):
        self.job, self.w = job, workload
        self.groups = layer_groups(job)
        self.sizes = block_sizes(job)
        self.busy = job.cluster.num_devices
        self.costs: dict[tuple, StageCost] = {}
        self.order: dict[tuple, list[tuple[int, int]]] = {}

    def cost(self, i: int, j: int, size: int, mesh: tuple[int, int], setting: Setting, index: int,
             pp: int) -> StageCost:
        held = max_in_flight(setting.schedule, pp, index, self.job.num_micro_batches) if pp > 1 else 1
        key = (i, j, size, mesh, setting.batch_axis, setting.remat, setting.reduce_scatter, pp > 1, held,
               index == 0, index == pp - 1)
        if key not in self.costs:
            stage = StagePlan(groups=self.groups[i:j], device_ids=tuple(range(size)), dp=mesh[0], op=mesh[1])
            plan = Plan((), self.job.num_micro_batches, setting.batch_axis, setting.remat, setting.reduce_scatter,
                        setting.schedule, "chosen")
            self.costs[key] = stage_cost(self.w, stage, index, plan, self.busy, pp)
        return self.costs[key]

    def best(self, i: int, j: int, size: int, setting: Setting, index: int,
             pp: int) -> tuple[float, tuple[int, int] | None]:
        """(seconds per micro-batch, (dp, op)) of the fastest mesh that fits; (inf, None) if none."""
        key = (i, j, size, setting.batch_axis, setting.remat, setting.reduce_scatter)
        if key not in self.order:  # meshes fastest first, timed in slot 0 of 1 (time does not depend on it)
            timed = [(self._seconds(self.cost(i, j, size, m, setting, 0, 1)), m)
                     for m in meshes(self.job, size, setting.batch_axis)]
            self.order[key] = [m for _, m in sorted(timed)]
        limit = self.w.profile.memory
        for mesh in self.order[key]:
            found = self.cost(i, j, size, mesh, setting, index, pp)
            if found.memory.total <= limit:
                return self._seconds(found), mesh
        return math.inf, None

    @staticmethod
    def _seconds(cost: StageCost) -> float:
        return cost.forward + cost.backward


def dp_plans(job: Job, workload: Workload) -> list[Plan]:
    """Plans the dynamic program proposes, for every pipeline degree and setting (pp = 1: every
    mesh and setting, which is small)."""
    table = StageTable(job, workload)
    num_groups, n = len(table.groups), job.cluster.num_devices
    plans = [_plan(job, [range(num_groups)], [range(n)], [mesh], s)
             for s in settings(1) for mesh in meshes(job, n, s.batch_axis)]
    for pp in range(2, min(num_groups, n) + 1):
        for setting in settings(pp):
            plans += _pipeline_plans(job, table, pp, setting)
    return plans


def _pipeline_plans(job: Job, table: StageTable, pp: int, setting: Setting) -> list[Plan]:
    """The DP for one pipeline degree and setting: V[t, j, d] = least sum of stage times over the
    stages so far, covering groups [0, j) and devices [0, d), each stage within bound t."""
    g, n, sizes = len(table.groups), job.cluster.num_devices, table.sizes
    micro = job.num_micro_batches
    cost = np.full((pp, g + 1, g + 1, len(sizes)), math.inf)
    mesh: dict[tuple[int, int, int, int], tuple[int, int]] = {}
    for k, i, j, (si, size) in itertools.product(range(pp), range(g), range(1, g + 1), enumerate(sizes)):
        if i < j and i >= k and g - j >= pp - 1 - k:
            cost[k, i, j, si], found = table.best(i, j, size, setting, k, pp)
            if found is not None:
                mesh[k, i, j, si] = found
    finite = np.unique(cost[np.isfinite(cost)])
    if not finite.size:
        return []
    bounds = finite if micro == 1 or finite.size <= THRESHOLDS else np.quantile(finite, np.linspace(0, 1, THRESHOLDS))
    if micro == 1:
        bounds = finite[-1:]
    fits = np.array([[block_fits(job, o, s) for s in sizes] for o in range(n + 1)])  # [offset, size]
    value = np.full((len(bounds), g + 1, n + 1), math.inf)
    value[:, 0, 0] = 0.0
    back = []
    for k in range(pp):
        value, choice = _slot(value, np.where(cost[k][None] <= bounds[:, None, None, None], cost[k][None], math.inf),
                              sizes, fits)
        back.append(choice)
    objective = value[:, g, n] + (micro - 1) * bounds
    plans = []
    for t in np.argsort(objective, kind="stable"):
        if not np.isfinite(objective[t]) or len(plans) == PROPOSALS:
            break
        plan = _trace(job, back, t, g, n, sizes, mesh, setting)
        if plan not in plans:
            plans.append(plan)
    return plans


def _slot(value: np.ndarray, cost: np.ndarray, sizes: Sequence[int],
          fits: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One more stage: new[t, j, d] = min over start group i and block size s of
    value[t, i, d - s] + cost[t, i, j, s], the block [d - s, d) placeable; with the argmins."""
    bounds, groups, devices = value.shape
    best = np.full(value.shape, math.inf)
    best_i = np.zeros(value.shape, dtype=int)
    best_s = np.zeros(value.shape, dtype=int)
    for si, size in enumerate(sizes):
        if size >= devices:
            continue
        before = np.where(fits[:devices - size, si][None, None], value[:, :, :devices - size], math.inf)
        total = before[:, :, None, :] + cost[:, :, :, si][..., None]  # [t, i, j, d - size]
        start = total.argmin(axis=1)
        least = np.take_along_axis(total, start[:, None], axis=1)[:, 0]
        better = least < best[:, :, size:]
        best[:, :, size:] = np.where(better, least, best[:, :, size:])
        best_i[:, :, size:] = np.where(better, start, best_i[:, :, size:])
        best_s[:, :, size:] = np.where(better, si, best_s[:, :, size:])
    return best, (best_i, best_s)


def _trace(job: Job, back: list[tuple[np.ndarray, np.ndarray]], t: int, g: int, n: int, sizes: Sequence[int],
           mesh: dict, setting: Setting) -> Plan:
    """The stages behind value[t, g, n], read back slot by slot."""
    split, blocks, chosen, j, d = [], [], [], g, n
    for k in reversed(range(len(back))):
        starts, size_index = back[k]
        i, si = int(starts[t, j, d]), int(size_index[t, j, d])
        split.append(range(i, j))
        blocks.append(range(d - sizes[si], d))
        chosen.append(mesh[k, i, j, si])
        j, d = i, d - sizes[si]
    return _plan(job, split[::-1], blocks[::-1], chosen[::-1], setting)


# -- reports ---------------------------------------------------------------------------------

def manual_form(plan: Plan, devices_per_host: int) -> dict[str, Any]:
    """The plan as a manual parallel spec says it (plus the layer groups of each stage)."""
    return {**plan_columns(plan, devices_per_host),
            "auto_sharding_option": {"force_batch_dim_to_mesh_dim": MESH_AXES.index(plan.batch_axis),
                                     "prefer_reduce_scatter": plan.reduce_scatter},
            "pipeline_schedule": plan.schedule, "stage_layers": [[list(g) for g in s.groups] for s in plan.stages]}


def _described(c: Candidate, devices_per_host: int) -> dict[str, Any]:
    return {"plan": manual_form(c.plan, devices_per_host), "predicted": c.estimate.breakdown()}


def _no_fit_message(job: Job, workload: Workload, priced: Sequence[Candidate]) -> str:
    device = workload.profile.memory
    if priced:
        least = min(priced, key=lambda c: c.estimate.peak_bytes)
        found = (f"the smallest predicted peak is {least.estimate.peak_bytes / 2**30:.2f} GiB per device "
                 f"({len(least.plan.stages)} stages, remat={least.plan.remat}, ZeRO-2={least.plan.reduce_scatter})")
    else:
        found = "no stage of any plan fits"
    return (f"no plan fits: {found}, the device ({workload.profile.kind}) has {device / 2**30:.2f} GiB; "
            f"use more devices, a smaller avg_batch_size_per_device, more num_micro_batches or a larger "
            f"num_auto_layers")
