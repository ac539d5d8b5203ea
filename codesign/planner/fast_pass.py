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
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from codesign.cost.model import finish, layer_compute, one_program, op_collective, stage_busy, stage_cost
from codesign.hardware.links import cluster_links
from codesign.hardware.profiles import DeviceProfile, ProfileBook, profile_id
from codesign.cost.power import iteration_joules
from codesign.cost.timeline import simulate
from codesign.cost.workload import Submesh, Workload
from codesign.hardware.device import Devices
from codesign.cost.formulas import Compute, Memory, StageCost
from codesign.cost.plan import MESH_AXES, Plan, StagePlan, plan_name
from codesign.planner.space import meshes, placements, shards_state
from codesign.config.loader import LinkSpec
from codesign.config.types import SCHEDULES, Job, ModelSpec, TrainingSpec
from codesign.zhen import counts, search


@dataclass(frozen=True)
class Variant:
    """A one-program plan of the cluster: its (dp, op) over every device, batch axis, ZeRO-2."""

    dp: int
    op: int
    axis: str
    zero: bool

    def name(self) -> str:
        stage = StagePlan((), tuple(range(self.dp * self.op)), self.dp, self.op)
        return plan_name(Plan((stage,), 1, self.axis, False, self.zero, SCHEDULES[0], "chosen"))


@dataclass(frozen=True)
class LayerPrices:
    """One position of a block: per multiset row (and variant), what the layer costs."""

    compute: Compute  # fields [row, mesh]: one micro-batch through it on each of Pricer.meshes
    work: counts.Work  # fields [row]: its counts
    solo: np.ndarray  # [row, 2]: forward, backward of a micro-batch on one device (the bounds' work)
    launch: np.ndarray  # [row, 2]: of those, the fixed costs per call, which every device of a stage pays
    split: np.ndarray  # [row, 2]: of those, what op splits (priced on op 2: the compute is linear in 1 / op)
    sharded: np.ndarray  # [row, 2]: its op-sharded mixers (whose collectives op adds), their sharded params
    by_shards: np.ndarray  # [row, shards, 4]: at each of Pricer.shards, a device's work with its batch shard
    # (forward, backward) and what op splits of it, as solo and split (GEMMs are faster on more rows)


class Pricer:
    """One target's prices: every distinct layer (mixers, widths) priced once per mesh."""

    def __init__(self, job: Job, training: TrainingSpec, book: ProfileBook, links: Iterable[LinkSpec],
                 groups: int, positions: dict[tuple, LayerPrices] | None = None, computes: dict | None = None):
        self.job, self.training = job, training
        self.profile: DeviceProfile = book.for_job(job)
        self.intra, self.inter = cluster_links(self.profile, job.cluster, tuple(links))
        self.hw = Devices.of(self.profile, job.cluster, self.intra, self.inter)
        self.n = job.cluster.num_devices
        self.variants = [Variant(dp, op, axis, zero) for axis in MESH_AXES for zero in (False, True)
                         for dp, op in meshes(job, self.n, axis) if shards_state(zero, [(dp, op)])]
        meshes_of = [Submesh(tuple(range(self.n)), v.dp, v.op, v.axis) for v in self.variants]
        self.meshes = list(dict.fromkeys(meshes_of))  # ZeRO-2 or not, a mesh computes alike
        self.mesh_of = [self.meshes.index(m) for m in meshes_of]
        self.plans = [Plan((), job.num_micro_batches, v.axis, False, v.zero, SCHEDULES[0], "chosen")
                      for v in self.variants]
        self.positions = {} if positions is None else positions  # another target's, where only its groups differ
        # layer_compute's answers, shared by every target of the same devices and links (_compute)
        self.computes = {} if computes is None else computes
        self.devices = (profile_id(self.profile), self.intra, self.inter, self.hw.nics, job.cluster.num_devices_per_host)
        self.degrees = min(groups, self.n)  # the most pipeline stages
        # pipeline_bound holds for devices of their own: on shared cores a stage runs at its own
        # devices' speed, faster than the one-device work it spreads
        self.pipelines = self.degrees > 1 and not self.hw.shares_cores
        # the batch shards of a pipeline stage's meshes (it has fewer devices than the cluster):
        # pipeline_bound prices each stage's work at its own
        self.shards = sorted({dp if axis == "dp" else op for axis in MESH_AXES for d in range(1, self.n)
                              for dp, op in meshes(job, d, axis)}) if self.pipelines else []

    def workload(self, model: ModelSpec, layers: tuple, own: tuple = (), mixers: tuple = (), gemms: tuple = (),
                 own_gemms: tuple = ()) -> Workload:
        job = self.job
        return Workload(model, job.cluster, self.training.precision, job.global_batch, job.num_micro_batches,
                        self.profile, self.intra, self.inter, layers, own, mixers, gemms, own_gemms)

    def position(self, block: search.Block, i: int, base: ModelSpec) -> LayerPrices:
        f_in, skip = counts.feature_widths(base.num_features, base.output_per_emb, block.layers, i)
        key = (block.kinds, block.layers[i], f_in, skip, i > 0)
        if key not in self.positions:
            rows = search.multisets(block.layers[i], len(block.kinds))
            priced = [self.layer(search.layer_tokens(block.kinds, r), block, i, base) for r in rows]
            computes, works, solo, launch, split, sharded, by_shards = zip(*priced)
            fields = np.array([[c.astuple() for c in row] for row in computes])  # [row, mesh, field]
            self.positions[key] = LayerPrices(Compute(*np.moveaxis(fields, 2, 0)),
                                              counts.Work(*np.array([w.astuple() for w in works]).T),
                                              np.array(solo), np.array(launch), np.array(split),
                                              np.array(sharded, dtype=float),
                                              np.array(by_shards, dtype=float).reshape(len(rows), len(self.shards), 4))
        return self.positions[key]

    def layer(self, tokens: tuple[str, ...], block: search.Block, i: int, base: ModelSpec) -> tuple:
        """One layer's prices, from a one-layer workload of its exact widths."""
        proxy = _proxy(base, block.layers, i, tokens)
        layer = (proxy, i, self.training.fold_dot)
        own, mixers, gemms, own_gemms = _layer_work(*layer)
        work = sum((w for _, w in mixers), own)
        w = self.workload(proxy, (work,), (own,), (mixers,), (gemms,), (own_gemms,))
        alone, halved = self.split(w, layer, 1)
        sharded = [m.sharded_params for _, m in mixers if m.sharded_flops]  # as layer_compute asks op_collective
        return ([self._compute(w, layer, mesh) for mesh in self.meshes], work,
                finish(self.hw, 1, False, alone)[:2], (alone.fixed, alone.overheads - alone.fixed),
                _halves(alone, halved), (len(sharded), sum(sharded)),
                [x for s in self.shards for x in _by_shard(*self.split(w, layer, s))])

    def split(self, w: Workload, layer: tuple, shards: int) -> tuple[Compute, Compute]:
        """A one-layer workload on one device of `shards` batch shards, alone and with op = 2."""
        return tuple(self._compute(w, layer, Submesh(tuple(range(shards * op)), shards, op)) for op in (1, 2))

    def _compute(self, w: Workload, layer: tuple, mesh: Submesh) -> Compute:
        """layer_compute of a one-layer workload (`layer`: _layer_work's arguments) with every device of
        the cluster busy, keyed by all it reads of the mesh: meshes, micro-batch counts and
        clusters of the same devices and links that give a device the same samples share it."""
        hw = self.hw
        key = (self.devices, layer, w.precision, w.micro_batch / mesh.batch_shards, mesh.op, mesh.batch_axis,
               w.group(mesh.op_group), hw.share(self.n), hw.fixed_share(self.n, mesh.op))
        if key not in self.computes:
            self.computes[key] = layer_compute(w, 0, mesh, self.n)
        return self.computes[key]


def _halves(alone: Compute, halved: Compute) -> tuple:
    """What op splits of a call's work, (forward, backward): twice what op = 2 saves."""
    return 2 * (alone.forward - halved.forward), 2 * (alone.backward - halved.backward)


def _by_shard(alone: Compute, halved: Compute) -> tuple:
    """LayerPrices.by_shards' four figures of one batch shard count."""
    split = _halves(alone, halved)
    return alone.forward, split[0], alone.backward, split[1]


def _proxy(base: ModelSpec, layers: Sequence[int], i: int = -1, tokens: tuple[str, ...] = ()) -> ModelSpec:
    """A model of the block's widths (layer j holds layers[j] mixers), layer i holding `tokens`."""
    return ModelSpec(base.num_features, base.emb_dim, base.output_per_emb, len(layers),
                     tuple(tokens if j == i else ("LINEAR",) * n for j, n in enumerate(layers)))


@functools.cache
def _layer_work(proxy: ModelSpec, i: int, fold: bool) -> tuple[counts.Work, tuple, tuple, tuple]:
    return (counts.layer_own_work(proxy, i), counts.layer_mixers(proxy, i, fold), counts.layer_gemms(proxy, i, fold),
            counts.layer_own_gemms(proxy, i))


@dataclass(frozen=True)
class Fast:
    """The fast pass over one block's candidates."""

    seconds: np.ndarray  # best fitting one-program plan's step time; inf where none fits
    memory: np.ndarray  # its peak bytes per device (the smallest peak where none fits)
    joules: np.ndarray  # its joules per iteration, every device of the cluster; NaN where none fits
    variant: np.ndarray  # its position in Pricer.variants
    least: np.ndarray  # the least step time of any one-program plan, fitting or not
    bound: np.ndarray  # lower bound on any plan's step time, but for pipeline_bound
    flops: np.ndarray  # forward FLOPs per sample
    terms: np.ndarray  # [candidate, layer, TERMS]: what pipeline_bound adds up


def one_programs(pricer: Pricer, block: search.Block, rows: list[np.ndarray],
                 base: ModelSpec) -> tuple[np.ndarray, np.ndarray, list[StageCost]]:
    """(seconds, peak bytes) [candidate, variant] of the candidates whose layer i holds the
    multisets rows[i], as cost.estimate prices each one-program plan; and per variant its stage's
    cost (fields over candidates), for one_program_joules."""
    prices = [pricer.position(block, i, base) for i in range(len(block.layers))]
    computes = [Compute(*(f[r] for f in p.compute.astuple())) for p, r in zip(prices, rows)]
    compute = sum(computes[1:], computes[0])
    works = tuple(counts.Work(*(f[r] for f in p.work.astuple())) for p, r in zip(prices, rows))
    w = pricer.workload(_proxy(base, block.layers), works)
    layers = tuple(range(len(block.layers)))
    seconds, memory = (np.empty((len(rows[0]), len(pricer.variants))) for _ in range(2))
    costs = []
    for v, (variant, plan) in enumerate(zip(pricer.variants, pricer.plans)):
        stage = StagePlan((layers,), tuple(range(pricer.n)), variant.dp, variant.op)
        mesh = pricer.mesh_of[v]
        priced = stage_cost(w, stage, 0, plan, pricer.n, 1, compute=Compute(*(f[:, mesh] for f in compute.astuple())))
        seconds[:, v], memory[:, v] = one_program(w, plan, priced, pricer.n), np.floor(priced.memory.total)
        costs.append(priced)
    return seconds, memory, costs


def one_program_joules(pricer: Pricer, v: int, cost: StageCost, seconds: np.ndarray) -> np.ndarray:
    """Joules per iteration of variant v's one-program plan (its stage's cost and step seconds, over
    candidates), as cost.estimate prices them."""
    variant = pricer.variants[v]
    stage = StagePlan((), tuple(range(pricer.n)), variant.dp, variant.op)
    return iteration_joules(pricer.hw, [stage_busy(pricer.plans[v], stage, cost, seconds)], seconds, pricer.n)


def fast_pass(pricer: Pricer, block: search.Block, index: np.ndarray, base: ModelSpec) -> Fast:
    """Every one-program plan of every candidate in `index`: the fastest that fits, and bounds."""
    prices = [pricer.position(block, i, base) for i in range(len(block.layers))]
    digit = dict(search.digits(index, [len(p.solo) for p in prices]))
    rows = [digit[i] for i in range(len(prices))]
    seconds, memory, costs = one_programs(pricer, block, rows, base)
    fits = memory <= pricer.profile.memory
    best = np.where(fits, seconds, np.inf).argmin(axis=1)
    pick = lambda table: np.take_along_axis(table, best[:, None], 1)[:, 0]
    flops = sum(p.work.flops[r] for p, r in zip(prices, rows))
    micro, n = pricer.job.num_micro_batches, pricer.n
    solo = [p.solo[r] for p, r in zip(prices, rows)]  # [candidate, 2] per layer
    bound = pricer.profile.calibration.least_time_factor * np.maximum(
        3 * flops * pricer.job.global_batch / (n * _peak(pricer)),
        micro * sum(s.sum(axis=1) for s in solo) / n)
    terms = (_layer_terms(pricer, prices, rows, solo, _proxy(base, block.layers)) if pricer.pipelines
             else np.zeros((len(index), 0, len(TERMS))))
    fitting = fits.any(axis=1)
    joules = np.full(len(index), np.nan)
    for v in np.unique(best[fitting]):  # the variants chosen: no other's joules are read
        chosen = fitting & (best == v)
        joules[chosen] = one_program_joules(pricer, v, costs[v], seconds[:, v])[chosen]
    return Fast(np.where(fitting, pick(seconds), np.inf), np.where(fitting, pick(memory), memory.min(axis=1)),
                joules, best, seconds.min(axis=1), bound, flops, terms)


def _layer_terms(pricer: Pricer, prices: list[LayerPrices], rows: list[np.ndarray], solo: list[np.ndarray],
                 model: ModelSpec) -> np.ndarray:
    """Per candidate and layer, what pipeline_bound adds up over a stage's layers (TERMS): of one
    micro-batch on one device, the fixed costs per call, which every device of a stage pays (none
    counted where measured points price the calls), the rest of its work and what op splits of
    it (_share); its parameters; what it hands on."""
    launched = not _has_points(pricer.profile)
    terms = []
    w = pricer.workload(model, ())
    for i, (price, r, work) in enumerate(zip(prices, rows, solo)):
        fixed = price.launch[r] if launched else np.zeros((len(r), 2))
        split = price.split[r] if launched else work  # measured points: no line to split, all of it at best
        carry = np.full(len(r), float(w.micro_batch * w.activation_bytes * counts.carry_width(model, i)))
        shard = price.by_shards[r]  # [row, shards, (forward, its split, backward, its split)]
        if not launched:
            shard = shard.copy()
            shard[:, :, 1], shard[:, :, 3] = shard[:, :, 0], shard[:, :, 2]
        shard = shard - np.array([1, 0, 1, 0]) * np.stack([fixed[:, 0], fixed[:, 0], fixed[:, 1], fixed[:, 1]], 1)[:, None]
        terms.append(np.concatenate([np.stack([fixed[:, 0], work[:, 0] - fixed[:, 0], split[:, 0], fixed[:, 1],
                                               work[:, 1] - fixed[:, 1], split[:, 1], price.work.params[r],
                                               price.work.sharded_params[r], price.work.tensors[r],
                                               *price.sharded[r].T, carry], axis=1),
                                     shard.reshape(len(r), -1)], axis=1))
    return np.stack(terms, axis=1)


TERMS = ("fixed_forward", "work_forward", "split_forward", "fixed_backward", "work_backward", "split_backward",
         "params", "sharded_params", "tensors", "sharded_mixers", "sharded_mixer_params", "carry")
CARRY = TERMS.index("carry")  # bytes a stage ending at the layer hands on per micro-batch: not summed


EXACT_MESHES = 2  # pipelines of at most this many stages get every candidate's exact figure
MAX_COMBOS = 256  # mesh combinations of one deeper pipeline shape and setting simulated each


@dataclass(frozen=True)
class Floor:
    """At least what a pipeline stage spends on one mesh under one plan-wide setting (arrays over
    candidates)."""

    step: np.ndarray  # per step: its micro-batches, gradient sync and update
    forward: np.ndarray  # per micro-batch
    backward: np.ndarray  # per micro-batch, with its gradient accumulation (and sync, unless run once)
    after: np.ndarray  # after its last backward: the update (and a sync run once)


def pipeline_bound(pricer: Pricer, terms: np.ndarray, depth: np.ndarray, threshold: float = np.inf) -> np.ndarray:
    """The least step time any pipeline of Auto search's space could take, per candidate: over
    its pipeline degrees, cuts of its layers into stages and placements (auto.placements), plan-wide
    settings and schedules, timeline.simulate of its stages' floors (which only adds and takes
    maxima, so lower times give a lower end), and no less than its slowest stage's floor. What it
    leaves out (remat, memory) only adds time. terms: [candidate, layer, TERMS] (_layer_terms,
    past a model's `depth` layers zeros). Only candidates whose slowest stage is under
    `threshold` are simulated: the others' bound is already no lower."""
    least = np.full(len(terms), np.inf)
    for layers in np.unique(depth):
        chosen = np.flatnonzero(depth == layers)
        least[chosen] = _pipelines(pricer, terms[chosen, :layers], threshold)
    return least


def _pipelines(pricer: Pricer, terms: np.ndarray, threshold: float) -> np.ndarray:
    layers, per_host = terms.shape[1], pricer.job.cluster.num_devices_per_host
    ends = np.concatenate([np.zeros_like(terms[:, :1]), np.cumsum(terms, axis=1)], axis=1)
    floors: dict[tuple, tuple[dict[tuple[str, bool], list[Floor]], dict[tuple[str, bool], np.ndarray]]] = {}

    def floor(i: int, j: int, devices: tuple[int, ...]) -> tuple[dict, dict]:
        """The stage's floors per setting and mesh, and per setting its least step over the meshes."""
        key = (i, j, tuple(d - devices[0] // per_host * per_host for d in devices))  # the same on any host
        if key not in floors:
            found = stage_floors(pricer, ends[:, j] - ends[:, i], devices)
            floors[key] = found, {s: functools.reduce(np.minimum, (f.step for f in fs)) for s, fs in found.items()}
        return floors[key]

    shapes, slowest = [], np.full(len(terms), np.inf)
    for pp in range(2, min(pricer.degrees, layers) + 1):
        placed = list(placements(pricer.job, pp))
        for cuts in itertools.combinations(range(1, layers), pp - 1):
            edges = (0, *cuts, layers)
            for devices in placed:
                priced, least = zip(*(floor(a, b, tuple(d)) for a, b, d in zip(edges, edges[1:], devices)))
                carries = [terms[:, cut - 1, CARRY] for cut in cuts]
                settings = set.intersection(*(set(p) for p in priced))
                shapes.append((devices, [{k: p[k] for k in settings} for p in priced], carries))
                for setting in settings:
                    slowest = np.minimum(slowest, functools.reduce(np.maximum, (s[setting] for s in least)))
    close = np.flatnonzero(slowest < threshold)
    if close.size:
        slowest[close] = np.maximum(slowest[close], _simulations(pricer, shapes, close, threshold))
    return slowest


def _simulations(pricer: Pricer, shapes: list, close: np.ndarray, threshold: float = np.inf) -> np.ndarray:
    """The least simulated end, over the pipelines' `shapes`, of the `close` candidates. Per shape
    and setting, first each stage at the least figures of its meshes, transfers from all its
    devices (loose, cheap); where that is under both `threshold` and the least so far (or the
    pipeline has at most EXACT_MESHES stages), each combination of its stages' meshes (those no
    other mesh of the stage beats on every figure and batch shards), each transfer from its source
    mesh's batch shards (exact, up to MAX_COMBOS combinations)."""
    least = np.full(len(close), np.inf)
    w = pricer.workload(pricer.job.model, ())
    for devices, priced, carries in shapes:
        carried = [c[close] for c in carries]
        cuts = list(zip(devices, devices[1:]))
        for setting in priced[0]:
            per_mesh = [[_of(f, close) for f in p[setting]] for p in priced]
            hops = [_hop(w, c, src, dst, len(src)) for c, (src, dst) in zip(carried, cuts)]
            loose = _simulated(pricer, devices, setting, [_least(m) for m in per_mesh], hops)
            shallow = len(devices) <= EXACT_MESHES
            open_ = np.flatnonzero(loose < (np.inf if shallow else np.minimum(least, threshold)))
            before = least[open_]
            least = np.minimum(least, loose)
            if not open_.size or all(len(m) == 1 for m in per_mesh):
                continue
            axis = setting[0]
            options = []  # per stage: (its floor over the open candidates, its batch shards) per mesh
            for m, d in zip(per_mesh, devices):
                shards = [dp if axis == "dp" else op for dp, op in meshes(pricer.job, len(d), axis)]
                options.append(_undominated([(_of(f, open_), k) for f, k in zip(m, shards)]))
            if not shallow and math.prod(len(o) for o in options) > MAX_COMBOS:
                continue  # the loose figure stands
            exact = np.full(len(open_), np.inf)
            cap = np.inf if shallow else np.minimum(before, threshold)
            sub = [c[open_] for c in carried]
            for stages in itertools.product(*options):
                slowest = np.max([f.step for f, _ in stages], axis=0)
                if np.all(slowest >= cap):  # no lower than its slowest stage: not simulated
                    exact = np.minimum(exact, slowest)
                    continue
                hops = [_hop(w, c, src, dst, k) for c, (_, k), (src, dst) in zip(sub, stages, cuts)]
                exact = np.minimum(exact, _simulated(pricer, devices, setting, [f for f, _ in stages], hops))
            least[open_] = np.minimum(before, np.maximum(loose[open_], exact))
    return least


def _undominated(floors: list[tuple[Floor, int]]) -> list[tuple[Floor, int]]:
    """The (floor, batch shards) that no other is at least as good as on every figure, for every
    candidate, with at least as many batch shards (of equals, the first is kept)."""
    kept = []
    for i, (f, k) in enumerate(floors):
        def beats(g: Floor, k2: int, j: int) -> bool:
            no_worse = k2 >= k and all(np.all(a <= b) for a, b in zip(_fields(g), _fields(f)))
            same = k2 == k and all(np.array_equal(a, b) for a, b in zip(_fields(g), _fields(f)))
            return no_worse and (j < i or not same)

        if not any(j != i and beats(g, k2, j) for j, (g, k2) in enumerate(floors)):
            kept.append((f, k))
    return kept


def _of(floor: Floor, chosen: np.ndarray) -> Floor:
    return Floor(*(np.broadcast_to(x, floor.step.shape)[chosen] for x in _fields(floor)))


def _fields(floor: Floor) -> tuple:
    return floor.step, floor.forward, floor.backward, floor.after


def _least(floors: list[Floor]) -> Floor:
    """A floor of any of these meshes: each figure's least (looser than each mesh's own)."""
    return Floor(*(functools.reduce(np.minimum, figures) for figures in zip(*(_fields(f) for f in floors))))


def _simulated(pricer: Pricer, devices: list[tuple[int, ...]], setting: tuple[str, bool], stages: list[Floor],
               hops: list[np.ndarray]) -> np.ndarray:
    """The least end of timeline.simulate over the schedules, of stages at their floors."""
    axis, zero = setting
    plan_stages = tuple(StagePlan(((0,),), tuple(d), 1, 1) for d in devices)
    priced = [StageCost(s.forward, s.backward, s.after, {}, Memory()) for s in stages]
    w = pricer.workload(pricer.job.model, ())
    ends = [functools.reduce(np.maximum, simulate(w, Plan(plan_stages, pricer.job.num_micro_batches, axis, False,
                                                          zero, schedule, "chosen"), priced, hops)[0])
            for schedule in SCHEDULES]
    return np.maximum(functools.reduce(np.minimum, ends), np.max([s.step for s in stages], axis=0))


def _hop(w: Workload, carry: np.ndarray, src: Sequence[int], dst: Sequence[int], shards: int) -> np.ndarray:
    """The seconds to send one micro-batch's carry from stage to stage (or a cotangent back), as
    timeline.transfer_time: each source device its batch shard (at least carry / its devices)."""
    return w.transfer(carry / shards, src, dst)


def stage_floors(pricer: Pricer, sums: np.ndarray, devices: tuple[int, ...]) -> dict[tuple[str, bool], list[Floor]]:
    """A pipeline stage of these layers (sums: [candidate, TERMS]) on these devices, per (batch
    axis, ZeRO-2) and mesh: cost.stage_cost of its compute at least, each device paying the fixed
    costs and its share of the work (_share), with op's collectives; the cost model adds its
    gradient accumulation, sync and update."""
    fixed_f, work_f, split_f, fixed_b, work_b, split_b, params, sharded, tensors, mixers, weights, _ = sums.T[:len(TERMS)]
    by_shards = sums[:, len(TERMS):].reshape(len(sums), -1, 4)  # [candidate, shards, 4]: _layer_terms' per shard count
    job, n, micro = pricer.job, pricer.n, pricer.job.num_micro_batches
    w = pricer.workload(job.model, (counts.Work(params=params, sharded_params=sharded, tensors=tensors),))
    floors, computes = {}, {}
    for axis, zero in itertools.product(MESH_AXES, (False, True)):
        plan = Plan((), micro, axis, False, zero, SCHEDULES[0], "chosen")
        found = []
        for dp, op in meshes(job, len(devices), axis):
            mesh = Submesh(devices, dp, op, axis)
            if mesh not in computes:  # ZeRO-2 or not, a mesh computes alike
                reduced = mixers * counts.op_reduced(job.model.output_per_emb, job.model.emb_dim)
                kind, collectives = op_collective(w, counts.Work(sharded_params=weights, reduced=reduced),
                                                  w.micro_batch / mesh.batch_shards, mesh, mixers) if op > 1 else ("", 0.0)
                forward, backward = _share(by_shards[:, pricer.shards.index(mesh.batch_shards)], mesh)
                computes[mesh] = Compute(fixed_f + forward, fixed_b + backward,
                                         **{"all_reduce" if kind == "op all-reduce" else "all_gather": collectives})
            c = stage_cost(w, StagePlan(((0,),), devices, dp, op), 0, plan, n, 2, 1, computes[mesh], peak=False)
            found.append(Floor(micro * (c.forward + c.backward) + c.update, c.forward, c.backward, c.update))
        if found:
            floors[axis, zero] = found
    return floors


def _share(shard: np.ndarray, mesh: Submesh) -> tuple[np.ndarray, np.ndarray]:
    """A device's (forward, backward) work on this mesh, from its work at its batch shard (shard:
    [candidate, 4], LayerPrices.by_shards less the fixed costs): all of it where the batch is on op
    (dp replicates it), of which op splits the split part where the batch is on dp."""
    forward, split_f, backward, split_b = shard.T
    if mesh.batch_axis == "op":
        return forward, backward
    return forward - split_f + split_f / mesh.op, backward - split_b + split_b / mesh.op


def _has_points(profile: DeviceProfile) -> bool:
    return any(rate.forward_points or rate.backward_points for _, table in profile.rates for _, rate in table)


def _peak(pricer: Pricer) -> float:
    """The device's fastest FLOP rate over every kind and direction, measured points included (a
    GEMM-priced device's: the data sheet's peak)."""
    profile, precision = pricer.profile, pricer.training.precision
    fastest = pricer.hw.fastest_rate(precision)
    if fastest is not None:
        return fastest
    table = dict(dict(profile.rates).get(precision) or dict(profile.rates)["fp32"])
    fastest = 0.0
    for rate in table.values():
        points = [f / s for f, s in (*rate.forward_points, *rate.backward_points) if s > 0]
        fastest = max(fastest, rate.forward, rate.backward, *points)
    return fastest
