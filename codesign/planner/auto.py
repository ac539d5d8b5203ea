"""Auto search: choose a job's parallel plan by pricing the plans of its space (planner.space)
with the cost model, not compiling them. Plans that cannot fit are dropped, the rest ranked by
predicted seconds per iteration.

Where the space is small every plan is priced. Where it is large, a dynamic program over stage
boundaries and device offsets (the shape of Alpa's inter-operator pass) proposes plans: for each
layer-group range, block size and pipeline slot, the fastest (dp, op) that fits; then, for each
bound t_max on a stage's time, the stages minimising sum(stage times) + (micro - 1) * t_max. The
proposals of every pipeline degree and plan-wide setting are then priced exactly by `estimate`
(which simulates the schedule), the neighbours of the best few priced too (other splits, meshes,
settings), and all ranked.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from codesign.config.loader import LinkSpec
from codesign.config.types import SCHEDULES, Job
from codesign.errors import PlanError
from codesign.planner.columns import plan_columns
from codesign.cost.model import StageCost, Workload, estimate, stage_cost
from codesign.hardware.profiles import ProfileBook
from codesign.planner.objective import of_spec, order
from codesign.cost.plan import MESH_AXES, Plan, StagePlan, layer_groups
from codesign.cost.schedule import max_in_flight
from codesign.planner.space import (
    Candidate,
    Setting,
    all_plans,
    assemble,
    block_fits,
    block_sizes,
    degrees,
    in_space,
    meshes,
    settings,
    space_size,
    splits as all_splits,
    tiled,
)

EXHAUSTIVE_LIMIT = 3000  # plans: price every one below this, else let the dynamic program propose
THRESHOLDS = 16  # t_max bounds the dynamic program tries per (pipeline degree, setting)
PROPOSALS = 3  # plans each (pipeline degree, setting) hands to exact pricing
REFINE = 5  # best priced plans whose neighbours (splits, meshes, settings) are priced too
RESPLITS = 64  # splits of one plan priced in full; beyond, each boundary moved by one group
RUNNERS_UP = 5


def shape(plan: Plan) -> tuple:
    """Each stage's layers and (dp, op): what a plan's columns show."""
    return tuple((s.layers, s.dp, s.op) for s in plan.stages)


@dataclass(frozen=True)
class AutoChoice:
    """The plans that fit, best predicted first, and what the search cost."""

    ranked: tuple[Candidate, ...]  # at least one
    priced: int  # plans priced exactly by the cost model
    seconds: float  # search time
    devices_per_host: int = 1  # of the job's cluster: how the plan reads as manual-spec columns

    def best(self) -> Candidate:
        return self.ranked[0]

    def trials(self, k: int) -> tuple[Candidate, ...]:
        """What `auto_trials = k` measures, best predicted first: the best plan of each pipeline
        degree (the best one's, then one program's, pp = 1, then the others'), then of the next
        best shapes. The cost model's errors are shared within a degree (one schedule simulated,
        one contention; on CPU pipelines were priced at 0.5-0.9 of their measured time while
        single programs were not), and differ most between one program and a pipeline, so
        trials across degrees hedge against the largest of them. Variants of one shape (another
        schedule, device order, or an option that changes little there) are never trialled
        against each other: they are priced within a fraction of a percent, and measuring them
        only measured the noise."""
        rank = {id(c): i for i, c in enumerate(self.ranked)}
        best_per_degree: dict[int, Candidate] = {}
        for candidate in self.ranked:
            best_per_degree.setdefault(len(candidate.plan.stages), candidate)
        first = [self.ranked[0], best_per_degree.get(1), *best_per_degree.values()]
        chosen: dict[tuple, Candidate] = {}
        for candidate in (*first, *self.ranked):
            if len(chosen) >= k:
                break
            if candidate is not None:
                chosen.setdefault(shape(candidate.plan), candidate)
        return tuple(sorted(chosen.values(), key=lambda c: rank[id(c)]))

    def record(self) -> dict[str, Any]:
        """all_configs["auto_search"]: the chosen plan as a manual spec would say it, its
        prediction, the search's time and size, and the runners-up with their predictions."""
        best = self.best()
        return {**_described(best, self.devices_per_host), "search_seconds": self.seconds, "priced": self.priced,
                "feasible": len(self.ranked),
                "runners_up": [_described(c, self.devices_per_host) for c in self.ranked[1:1 + RUNNERS_UP]]}


class NoPlanFits(PlanError):
    """No plan of the space fits the device's memory: the attempt is `oom`, with this message."""


def choose_plan(job: Job, book: ProfileBook, links: Iterable[LinkSpec] = ()) -> AutoChoice:
    """The plans of the job's space that fit, best first by the spec's objective (time, unless it
    says energy or cost: then at the power settings the device accepts); NoPlanFits when none does."""
    start = time.perf_counter()
    workload = Workload.of(job, book.for_job(job), links)
    priced = price_space(job, workload)
    fitting = tuple(c for c in order(priced, of_spec(job.parallel), workload) if c.estimate.fits)
    if not fitting:
        raise NoPlanFits(no_fit_message(workload, priced))
    return AutoChoice(fitting, len(priced), time.perf_counter() - start, job.cluster.num_devices_per_host)


def price_space(job: Job, workload: Workload) -> list[Candidate]:
    """The plans Auto search prices, in the order it prices them: every plan of a small space;
    of a large one, the dynamic program's proposals and their neighbours."""
    if space_size(job, EXHAUSTIVE_LIMIT) <= EXHAUSTIVE_LIMIT:
        return [Candidate(p, estimate(workload, p)) for p in all_plans(job)]
    return dp_search(job, workload)


# -- the dynamic program -----------------------------------------------------------------------

class StageTable:
    """Per (group range, block size, pipeline slot): the fastest (dp, op) that fits, and its time
    per micro-batch (forward + backward, with its gradient sync where that runs in each
    micro-batch's backward, Plan.syncs_once). A stage's time does not depend on its slot; its
    memory depends on it through whether it is the first or last stage and how many
    micro-batches it holds, and grows with the latter, so each mesh is asked once how many it
    can hold."""

    def __init__(self, job: Job, workload: Workload):
        self.job, self.w = job, workload
        self.groups = layer_groups(job)
        self.sizes = block_sizes(job)
        self.costs: dict[tuple, StageCost] = {}
        self.order: dict[tuple, list[tuple[int, int]]] = {}
        self.holds: dict[tuple, int] = {}
        self.solved: dict[tuple, list[tuple]] = {}

    def best(self, i: int, j: int, size: int, setting: Setting, index: int,
             pp: int) -> tuple[float, tuple[int, int] | None]:
        """(seconds per micro-batch, (dp, op)) of the fastest mesh that fits stage `index` of a
        pp-stage pipeline; (inf, None) if none does."""
        micro = self.job.num_micro_batches
        held = _in_flight(setting.schedule, pp, index, micro)
        slot = (i, j, size, setting.batch_axis, setting.remat, setting.reduce_scatter, index == 0, index == pp - 1)
        if slot not in self.order:
            timed = [(_seconds(self._cost(slot, m, micro)), m) for m in meshes(self.job, size, setting.batch_axis)]
            self.order[slot] = [m for _, m in sorted(timed)]
        for mesh in self.order[slot]:
            if self._holds(slot, mesh) >= held:
                return _seconds(self._cost(slot, mesh, micro)), mesh
        return math.inf, None

    def _holds(self, slot: tuple, mesh: tuple[int, int]) -> int:
        """The most in-flight micro-batches (0..micro) the stage fits with (binary search)."""
        if (slot, mesh) not in self.holds:
            low, high = 0, self.job.num_micro_batches
            if self._cost(slot, mesh, high).memory.total <= self.w.profile.memory:
                low = high  # the common case, and the cost its time was read from
            while low < high:
                mid = (low + high + 1) // 2
                if self._cost(slot, mesh, mid).memory.total <= self.w.profile.memory:
                    low = mid
                else:
                    high = mid - 1
            self.holds[slot, mesh] = low
        return self.holds[slot, mesh]

    def _cost(self, slot: tuple, mesh: tuple[int, int], held: int) -> StageCost:
        if (slot, mesh, held) not in self.costs:
            i, j, size, axis, remat, zero, first, last = slot
            # a block placed at device 0 spans the hosts any placement of it does (block_fits)
            stage = StagePlan(groups=self.groups[i:j], device_ids=tuple(range(size)), dp=mesh[0], op=mesh[1])
            plan = Plan((), self.job.num_micro_batches, axis, remat, zero, SCHEDULES[0], "chosen")
            index, pp = (0, 2) if first else ((1, 2) if last else (1, 3))
            self.costs[slot, mesh, held] = stage_cost(self.w, stage, index, plan, self.job.cluster.num_devices, pp,
                                                      in_flight=held)
        return self.costs[slot, mesh, held]


_in_flight = functools.cache(max_in_flight)  # asked for every (slot, range, size) the DP prices


def _seconds(cost: StageCost) -> float:
    return cost.forward + cost.backward


def dp_plans(job: Job, workload: Workload) -> list[Plan]:
    """Plans to price exactly: for each pipeline degree and setting, what the dynamic program
    proposes over contiguous blocks; host-tiled placements at the FLOP-balanced split, one mesh
    for all stages; pp = 1 in full (every mesh and setting: few)."""
    table = StageTable(job, workload)
    groups = len(table.groups)
    plans = []
    for pp in degrees(job):
        for setting in settings(pp):
            if pp > 1:
                plans += _pipeline_plans(job, table, pp, setting)
            balanced = tuple(range(int(r[0]), int(r[-1]) + 1) for r in np.array_split(np.arange(groups), pp))
            for devices in tiled(job, pp) if pp > 1 else [[tuple(range(job.cluster.num_devices))]]:
                plans += [assemble(job, balanced, devices, [m] * pp, setting)
                          for m in meshes(job, len(devices[0]), setting.batch_axis)]
    return plans


def _pipeline_plans(job: Job, table: StageTable, pp: int, setting: Setting) -> list[Plan]:
    """The DP for one pipeline degree and setting: value[t, j, d] = least sum of stage times over
    the stages so far, covering groups [0, j) and devices [0, d), each stage within bound t."""
    g, sizes = len(table.groups), table.sizes
    micro = job.num_micro_batches
    cost = np.full((pp, g + 1, g + 1, len(sizes)), math.inf)
    mesh: dict[tuple[int, int, int, int], tuple[int, int]] = {}
    for k, i, j, (si, size) in itertools.product(range(pp), range(g), range(1, g + 1), enumerate(sizes)):
        if k <= i < j <= g - (pp - 1 - k) and (i == 0) == (k == 0) and (j == g) == (k == pp - 1):
            cost[k, i, j, si], found = table.best(i, j, size, setting, k, pp)
            if found is not None:
                mesh[k, i, j, si] = found
    finite = np.unique(cost[np.isfinite(cost)])
    if not finite.size:
        return []
    if micro == 1:  # the objective is the sum alone: no bound needed
        bounds = finite[-1:]
    else:
        bounds = finite if finite.size <= THRESHOLDS else np.quantile(finite, np.linspace(0, 1, THRESHOLDS))
    key = (pp, cost.tobytes())  # settings that differ only where nothing binds give the same DP
    if key not in table.solved:
        table.solved[key] = _solve(job, cost, bounds, sizes)
    return [assemble(job, [r for r, _, _ in stages], [b for _, b, _ in stages], [mesh[key] for _, _, key in stages],
                  setting) for stages in table.solved[key]]


def _solve(job: Job, cost: np.ndarray, bounds: np.ndarray, sizes: Sequence[int]) -> list[tuple]:
    """The best stage lists (groups, devices, cost index) under each bound, best objective first."""
    pp, g, n = cost.shape[0], cost.shape[1] - 1, job.cluster.num_devices
    fits = np.array([[block_fits(job, o, s) for s in sizes] for o in range(n + 1)])  # [offset, size]
    value = np.full((len(bounds), g + 1, n + 1), math.inf)
    value[:, 0, 0] = 0.0
    back = []
    for k in range(pp):
        bounded = np.where(cost[k][None] <= bounds[:, None, None, None], cost[k][None], math.inf)
        value, choice = _slot(value, bounded, sizes, fits)
        back.append(choice)
    objective = value[:, g, n] + (job.num_micro_batches - 1) * bounds
    traced: list[tuple] = []
    for t in np.argsort(objective, kind="stable"):
        if not np.isfinite(objective[t]) or len(traced) == PROPOSALS:
            break
        stages = _trace(back, int(t), g, n, sizes)
        if stages not in traced:
            traced.append(stages)
    return traced


def _slot(value: np.ndarray, cost: np.ndarray, sizes: Sequence[int],
          fits: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One more stage: new[t, j, d] = min over start group i and block size s of
    value[t, i, d - s] + cost[t, i, j, s], the block [d - s, d) placeable; with the argmins."""
    devices = value.shape[2]
    best = np.full(value.shape, math.inf)
    best_i = np.zeros(value.shape, dtype=int)
    best_s = np.zeros(value.shape, dtype=int)
    for si, size in enumerate(sizes):
        if size >= devices or not np.isfinite(cost[..., si]).any():
            continue
        before = np.where(fits[:devices - size, si][None, None], value[:, :, :devices - size], math.inf)
        total = before[:, :, None, :] + cost[:, :, :, si][..., None]  # [t, i, j, d - size]
        start, least = total.argmin(axis=1), total.min(axis=1)
        better = least < best[:, :, size:]
        best[:, :, size:] = np.where(better, least, best[:, :, size:])
        best_i[:, :, size:] = np.where(better, start, best_i[:, :, size:])
        best_s[:, :, size:] = np.where(better, si, best_s[:, :, size:])
    return best, (best_i, best_s)


def _trace(back: list[tuple[np.ndarray, np.ndarray]], t: int, g: int, n: int,
           sizes: Sequence[int]) -> tuple[tuple[range, range, tuple[int, int, int, int]], ...]:
    """The stages behind value[t, g, n], read back slot by slot: (groups, devices, mesh key)."""
    stages, j, d = [], g, n
    for k in reversed(range(len(back))):
        starts, size_index = back[k]
        i, si = int(starts[t, j, d]), int(size_index[t, j, d])
        stages.append((range(i, j), range(d - sizes[si], d), (k, i, j, si)))
        j, d = i, d - sizes[si]
    return tuple(stages[::-1])


def dp_search(job: Job, workload: Workload) -> list[Candidate]:
    """The DP's proposals priced, and around the best few and each pipeline degree's best: every
    other split of the layer groups (or, where those are too many, each boundary moved by one
    group) on the same devices, each stage's other meshes, and the other plan-wide settings.
    What the DP's objective leaves out (transfers, dispatch, the update) can move the best cuts
    and meshes."""
    priced = [Candidate(p, estimate(workload, p)) for p in dict.fromkeys(dp_plans(job, workload)) if in_space(p)]
    seen = {c.plan for c in priced}
    fitting = sorted((c for c in priced if c.estimate.fits), key=lambda c: c.estimate.seconds)
    per_degree = {len(c.plan.stages): c.plan for c in reversed(fitting)}  # each pipeline degree's best
    extra = []
    for best in dict.fromkeys([*(c.plan for c in fitting[:REFINE]), *per_degree.values()]):
        for plan in itertools.chain(_resplits(job, best), _remeshes(job, best), _resettings(job, best)):
            if plan not in seen and in_space(plan):
                seen.add(plan)
                extra.append(Candidate(plan, estimate(workload, plan)))
    return priced + extra


def _resettings(job: Job, plan: Plan) -> Iterator[Plan]:
    """The plan's stages under each other plan-wide setting their meshes allow."""
    for s in settings(len(plan.stages)):
        if all((stage.dp, stage.op) in meshes(job, len(stage.device_ids), s.batch_axis) for stage in plan.stages):
            yield dataclasses.replace(plan, batch_axis=s.batch_axis, remat=s.remat, reduce_scatter=s.reduce_scatter,
                                      schedule=s.schedule)


def _remeshes(job: Job, plan: Plan) -> Iterator[Plan]:
    """The plan with one stage's devices viewed as another (dp, op)."""
    for k, stage in enumerate(plan.stages):
        for dp, op in meshes(job, len(stage.device_ids), plan.batch_axis):
            if (dp, op) != (stage.dp, stage.op):
                stages = (*plan.stages[:k], dataclasses.replace(stage, dp=dp, op=op), *plan.stages[k + 1:])
                yield dataclasses.replace(plan, stages=stages)


def _resplits(job: Job, plan: Plan) -> Iterator[Plan]:
    groups, pp = len(layer_groups(job)), len(plan.stages)
    bounds = list(itertools.accumulate((len(s.groups) for s in plan.stages), initial=0))
    if math.comb(groups - 1, pp - 1) <= RESPLITS:
        splits = all_splits(groups, pp)
    else:
        moved = ({*bounds[:k], b + step, *bounds[k + 1:]} for k, b in enumerate(bounds[1:-1], 1) for step in (-1, 1))
        splits = (tuple(range(a, b) for a, b in zip(cuts, cuts[1:]))
                  for cuts in (sorted(m) for m in moved) if len(cuts) == pp + 1)
    setting = Setting(plan.batch_axis, plan.remat, plan.reduce_scatter, plan.schedule)
    for split in splits:
        yield assemble(job, split, [s.device_ids for s in plan.stages], [(s.dp, s.op) for s in plan.stages], setting)


# -- reports ---------------------------------------------------------------------------------

def manual_form(plan: Plan, devices_per_host: int) -> dict[str, Any]:
    """The plan as a manual parallel spec says it (plus the layer groups of each stage)."""
    return {**plan_columns(plan, devices_per_host),
            "auto_sharding_option": {"force_batch_dim_to_mesh_dim": MESH_AXES.index(plan.batch_axis),
                                     "prefer_reduce_scatter": plan.reduce_scatter},
            "pipeline_schedule": plan.schedule, "stage_layers": [[list(g) for g in s.groups] for s in plan.stages]}


def _described(c: Candidate, devices_per_host: int) -> dict[str, Any]:
    return {"plan": manual_form(c.plan, devices_per_host), "predicted": c.estimate.breakdown()}


def no_fit_message(workload: Workload, priced: Sequence[Candidate]) -> str:
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
