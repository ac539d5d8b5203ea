"""The co-design ranking's prices: every candidate of a block at once, through the cost model's
own stage functions.

A block's candidates differ only in which mixers each layer holds, so each distinct layer (its
mixers and widths) is priced once per one-program plan by `cost.layer_compute`; a candidate's
stage is the sum of its layers' `cost.Compute`s, which flows, as arrays over the block's
candidates, through the same `cost.stage_cost` and `cost.one_program` that `estimate` runs.

The lower bound on any plan of Auto search's space is the largest of: its FLOPs at the device's
fastest rate; its one-device work spread over every device (work is conserved); and, on devices
of their own, the least of its one-program plans' exact times and `pipeline_bound`, the least
time any pipeline of its layers could take.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from codesign.planner.auto import meshes
from codesign.planner.cost import (
    PARAM_BYTES,
    Compute,
    Submesh,
    Workload,
    accumulate_time,
    adam_time,
    layer_compute,
    one_program,
    stage_compute,
    stage_cost,
)
from codesign.planner.device_profiles import DeviceProfile, ProfileBook, cluster_links
from codesign.planner.plan import MESH_AXES, Plan, StagePlan
from codesign.planner.shared_cores import memory_share
from codesign.config.loader import LinkSpec
from codesign.config.types import SCHEDULES, Job, ModelSpec, TrainingSpec
from codesign.zhen import counts, search

BISECTIONS = 40  # halvings of pipeline_bound's bracket: within 1e-12 of it, and never above


@dataclass(frozen=True)
class Variant:
    """A one-program plan of the cluster: its (dp, op) over every device, batch axis, ZeRO-2."""

    dp: int
    op: int
    axis: str
    zero: bool


@dataclass(frozen=True)
class LayerPrices:
    """One position of a block: per multiset row (and variant), what the layer costs."""

    compute: Compute  # fields [row, variant]: one micro-batch through it on the variant's mesh
    work: counts.Work  # fields [row]: its counts
    solo: np.ndarray  # [row]: forward + backward of a micro-batch on one device (the bound's work)
    launch: np.ndarray  # [row]: of that, the fixed costs per call, which every device of a stage pays


class Pricer:
    """One target's prices: every distinct layer (mixers, widths) priced once per variant."""

    def __init__(self, job: Job, training: TrainingSpec, book: ProfileBook, links: Iterable[LinkSpec],
                 groups: int):
        self.job, self.training = job, training
        self.profile: DeviceProfile = book.for_job(job)
        self.intra, self.inter = cluster_links(self.profile, job.cluster, tuple(links))
        self.n = job.cluster.num_devices
        self.variants = [Variant(dp, op, axis, zero) for axis in MESH_AXES for zero in (False, True)
                         for dp, op in meshes(job, self.n, axis)]
        self.meshes = [Submesh(tuple(range(self.n)), v.dp, v.op, v.axis) for v in self.variants]
        self.plans = [Plan((), job.num_micro_batches, v.axis, False, v.zero, SCHEDULES[0], "chosen")
                      for v in self.variants]
        self.positions: dict[tuple, LayerPrices] = {}
        self.degrees = min(groups, self.n)  # the most pipeline stages
        # pipeline_bound holds for devices of their own: on shared cores a stage runs at its own
        # devices' speed, faster than the one-device work it spreads
        self.pipelines = self.degrees > 1 and not self.profile.shares_cores

    def workload(self, model: ModelSpec, layers: tuple, own: tuple = (), mixers: tuple = ()) -> Workload:
        job = self.job
        return Workload(model, job.cluster, self.training.precision, job.global_batch, job.num_micro_batches,
                        self.profile, self.intra, self.inter, layers, own, mixers)

    def position(self, block: search.Block, i: int, base: ModelSpec) -> LayerPrices:
        f_in, skip = counts.feature_widths(base.num_features, base.output_per_emb, block.layers, i)
        key = (block.kinds, block.layers[i], f_in, skip, i > 0)
        if key not in self.positions:
            rows = search.multisets(block.layers[i], len(block.kinds))
            priced = [self.layer(search.layer_tokens(block.kinds, r), block, i, base) for r in rows]
            computes, works, solo, launch = zip(*priced)
            fields = np.array([[c.astuple() for c in row] for row in computes])  # [row, variant, field]
            self.positions[key] = LayerPrices(Compute(*np.moveaxis(fields, 2, 0)),
                                              counts.Work(*np.array([w.astuple() for w in works]).T),
                                              np.array(solo), np.array(launch))
        return self.positions[key]

    def layer(self, tokens: tuple[str, ...], block: search.Block, i: int, base: ModelSpec) -> tuple:
        """One layer's prices, from a one-layer workload of its exact widths."""
        proxy = _proxy(base, block.layers, i, tokens)
        own, mixers = _layer_work(proxy, i, self.training.fold_dot)
        work = sum((w for _, w in mixers), own)
        w = self.workload(proxy, (work,), (own,), (mixers,))
        one = Submesh((0,), 1, 1)
        solo = sum(stage_compute(w, [0], one, False, self.n)[:2])
        return ([layer_compute(w, 0, mesh, self.n) for mesh in self.meshes], work, solo,
                layer_compute(w, 0, one, self.n).overheads)


def _proxy(base: ModelSpec, layers: Sequence[int], i: int = -1, tokens: tuple[str, ...] = ()) -> ModelSpec:
    """A model of the block's widths (layer j holds layers[j] mixers), layer i holding `tokens`."""
    return ModelSpec(base.num_features, base.emb_dim, base.output_per_emb, len(layers),
                     tuple(tokens if j == i else ("LINEAR",) * n for j, n in enumerate(layers)))


@functools.cache
def _layer_work(proxy: ModelSpec, i: int, fold: bool) -> tuple[counts.Work, tuple]:
    return counts.layer_own_work(proxy, i), counts.layer_mixers(proxy, i, fold)


@dataclass(frozen=True)
class Fast:
    """The fast pass over one block's candidates."""

    seconds: np.ndarray  # best fitting one-program plan's step time; inf where none fits
    memory: np.ndarray  # its peak bytes per device (the smallest peak where none fits)
    variant: np.ndarray  # its position in Pricer.variants
    least: np.ndarray  # the least step time of any one-program plan, fitting or not
    bound: np.ndarray  # lower bound on any plan's step time, but for pipeline_bound
    flops: np.ndarray  # forward FLOPs per sample
    stages: np.ndarray  # [candidate, layer, 2]: pipeline_bound's (fixed, spread) seconds per layer


def fast_pass(pricer: Pricer, block: search.Block, index: np.ndarray, base: ModelSpec) -> Fast:
    """Every one-program plan of every candidate in `index`, as cost.estimate prices pp = 1."""
    prices = [pricer.position(block, i, base) for i in range(len(block.layers))]
    digit = dict(search.digits(index, [len(p.solo) for p in prices]))
    rows = [digit[i] for i in range(len(prices))]
    computes = [Compute(*(f[r] for f in p.compute.astuple())) for p, r in zip(prices, rows)]
    compute = sum(computes[1:], computes[0])
    works = tuple(counts.Work(*(f[r] for f in p.work.astuple())) for p, r in zip(prices, rows))
    w = pricer.workload(_proxy(base, block.layers), works)
    layers = tuple(range(len(block.layers)))
    seconds, memory = (np.empty(compute.forward.shape) for _ in range(2))
    for v, (variant, plan) in enumerate(zip(pricer.variants, pricer.plans)):
        stage = StagePlan((layers,), tuple(range(pricer.n)), variant.dp, variant.op)
        priced = stage_cost(w, stage, 0, plan, pricer.n, 1, compute=Compute(*(f[:, v] for f in compute.astuple())))
        seconds[:, v], memory[:, v] = one_program(w, plan, priced, pricer.n), np.floor(priced.memory.total)
    fits = memory <= pricer.profile.memory
    best = np.where(fits, seconds, np.inf).argmin(axis=1)
    pick = lambda table: np.take_along_axis(table, best[:, None], 1)[:, 0]
    flops = sum(p.work.flops[r] for p, r in zip(prices, rows))
    micro, n = pricer.job.num_micro_batches, pricer.n
    solo = [p.solo[r] for p, r in zip(prices, rows)]
    bound = np.maximum(3 * flops * pricer.job.global_batch / (n * _peak(pricer.profile, pricer.training.precision)),
                       micro * sum(solo) / n)
    return Fast(np.where(fits.any(axis=1), pick(seconds), np.inf),
                np.where(fits.any(axis=1), pick(memory), memory.min(axis=1)), best, seconds.min(axis=1),
                bound, flops, _stage_terms(pricer, prices, rows, solo) if pricer.pipelines else np.zeros((len(index), 0, 2)))


def _stage_terms(pricer: Pricer, prices: list[LayerPrices], rows: list[np.ndarray],
                 solo: list[np.ndarray]) -> np.ndarray:
    """Per candidate and layer, what any pipeline stage holding it spends per step on each of its
    d devices, at least: `fixed` + `spread` / d. Fixed: each micro-batch's fixed costs per call,
    which every device pays (none counted where measured points price the calls). Spread: the
    rest of its micro-batches' one-device work, their gradient accumulation and its update, which
    the stage's devices at best share evenly (its parameters split d ways at most)."""
    p, micro = pricer.profile, pricer.job.num_micro_batches
    share = memory_share(p, pricer.n)
    launched = not _has_points(p)
    terms = []
    for price, r, work in zip(prices, rows, solo):
        fixed = micro * price.launch[r] if launched else np.zeros(len(r))
        param_bytes = price.work.params[r] * PARAM_BYTES
        spread = (micro * work - fixed + micro * accumulate_time(param_bytes, p, share, micro)
                  + adam_time(param_bytes, p, share))
        terms.append(np.stack([fixed, spread], axis=1))
    return np.stack(terms, axis=1)


def pipeline_bound(stages: np.ndarray, degrees: int, n: int) -> np.ndarray:
    """The least step time of any pipeline of at most `degrees` stages over n devices, per
    candidate: over every cut of its layers into contiguous stages, the least T such that stages
    of (fixed + spread / d) seconds on d devices each, any real d, fit n devices. Every term the
    relaxation leaves out (collectives, launches, the bubble, remat, memory) only adds time.
    stages: [candidate, layer, (fixed, spread)], as _stage_terms; layers past a model's end are 0."""
    least = np.full(len(stages), np.inf)
    layers = stages.shape[1]
    for pp in range(2, min(degrees, layers) + 1):
        for cuts in itertools.combinations(range(1, layers), pp - 1):
            parts = np.add.reduceat(stages, [0, *cuts], axis=1)  # [candidate, stage, 2]
            least = np.minimum(least, _balanced(parts[..., 0], parts[..., 1], n))
    return least


def _balanced(fixed: np.ndarray, spread: np.ndarray, n: int) -> np.ndarray:
    """Least T (from below) with sum over stages of spread / (T - fixed) <= n: bisection."""
    low = np.max(fixed + spread / n, axis=1)
    high = np.max(fixed, axis=1) + spread.sum(axis=1) / n  # d proportional to spread fits
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(BISECTIONS):
            mid = (low + high) / 2
            gap = mid[:, None] - fixed
            need = np.where(gap > 0, spread / gap, np.where(spread > 0, np.inf, 0.0)).sum(axis=1)
            fits = need <= n
            low, high = np.where(fits, low, mid), np.where(fits, mid, high)
    return low


def _has_points(profile: DeviceProfile) -> bool:
    return any(rate.forward_points or rate.backward_points for _, table in profile.rates for _, rate in table)


def _peak(profile: DeviceProfile, precision: str) -> float:
    """The device's fastest FLOP rate over every kind and direction, measured points included."""
    table = dict(dict(profile.rates).get(precision) or dict(profile.rates)["fp32"])
    fastest = 0.0
    for rate in table.values():
        points = [f / s for f, s in (*rate.forward_points, *rate.backward_points) if s > 0]
        fastest = max(fastest, rate.forward, rate.backward, *points)
    return fastest
