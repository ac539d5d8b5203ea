"""Co-design search: every equal-capacity ZHEN model ranked by its best plan on each cluster.

The candidates are every model of `codesign search`'s space within --param-tolerance of the base
(no draw). For each target (a cluster of the config, with an Auto search spec and micro-batch
count), each candidate gets the plan Auto search would choose, in three steps:

- a fast pass prices every candidate's one-program plans (pp = 1: each (dp, op), batch axis and
  ZeRO-2, without remat, which only ever adds time) exactly as `cost.estimate` does, but from
  per-layer prices: a layer's compute is priced once per (mixers, widths) and variant, and a
  candidate's time is sums over its layers plus its gradient sync and update, computed on all
  candidates of a block at once. Where the spec has one layer group (or the cluster one device)
  that is Auto search's whole space, so the pass is its answer;
- a lower bound on any plan's time, the largest of: its FLOPs at the device's fastest rate; its
  layers' one-device work spread over every device (work is conserved); the fixed costs per call
  that every device of a stage pays, over the most pipeline stages the spec allows;
- the full Auto search (`auto.choose_plan`) where the fast pass is not the answer: a candidate no
  one-program plan fits (it gets the reason when nothing fits), and, in ascending bound order, the
  candidates whose bound beats the K-th best time known so far (pruning stops at the first that
  cannot). The final top K always come from `choose_plan`: the plans a sweep would run.

The Pareto frontier, per target: candidates no other beats on both parameters and predicted
samples/s. Same input, same output: nothing is drawn, ties keep the space's order.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from codesign.errors import PlanError
from codesign.planner.auto import AutoChoice, NoPlanFits, choose_plan, meshes
from codesign.planner.cost import (
    ACTIVATION_BYTES,
    PARAM_BYTES,
    Submesh,
    Workload,
    accumulate_time,
    engine_calls,
    gradient_sync,
    lockstep,
    program_overheads,
    stage_compute,
    stage_params,
    stage_update,
)
from codesign.planner.plan import MESH_AXES, Plan, layer_groups
from codesign.planner.plan import StagePlan, plan_name as describe_plan
from codesign.planner.device_profiles import LAYER, DeviceProfile, ProfileBook, cluster_links
from codesign.config.loader import Config, LinkSpec
from codesign.config.jobs import matches
from codesign.config.types import (
    AUTO_SEARCH,
    ClusterSpec,
    Job,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
)
from codesign.zhen import counts, search

log = logging.getLogger(__name__)
DEFAULT_TOP = 5
DEFAULT_CSV = "codesign_rank.csv"
COLUMNS = ("cluster", "micro_batches", "rank", "model", "num_zhen_layers", "tokens", "params",
           "params_vs_base", "train_gflops_per_sample", "predicted_samples_per_s", "predicted_step_ms",
           "predicted_memory_gib", "plan", "searched", "bound_samples_per_s", "pareto", "reason",
           "measured_samples_per_s", "job_key")


# -- what is ranked, and where ------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One cluster of the config under one Auto search spec and micro-batch count."""

    cluster: ClusterSpec
    platform: str  # resolved as a sweep on these hosts would: "gpu", "cpu" or "sim"
    parallel: ParallelSpec
    micro: int

    def job(self, model: ModelSpec, training: TrainingSpec) -> Job:
        return Job(model, self.cluster, training, self.parallel, self.micro, self.platform)

    def describe(self) -> str:
        return f"{self.cluster.summary()}, {self.micro} micro-batches, groups={self.parallel.num_auto_layers}"


def targets(config: Config, platform_of: Callable[[ClusterSpec], str]) -> list[Target]:
    """Per cluster, each micro-batch count of the config's Auto search specs; without one, an Auto
    search spec of one layer group over the micro-batch counts of the manual specs matching the
    cluster (1 when none matches)."""
    autos = [p for p in config.parallels if p.is_auto]
    found = []
    for cluster in config.clusters:
        specs = autos
        if not specs:
            micros = sorted({m for p in config.parallels if matches(p, cluster) for m in p.num_micro_batches})
            specs = [ParallelSpec(AUTO_SEARCH, tuple(micros or [1]))]
        found += [Target(cluster, platform_of(cluster), p, m) for p in specs for m in p.num_micro_batches]
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Candidates:
    """Every candidate that passes the filters, in space order."""

    base: ModelSpec
    blocks: tuple[search.Block, ...]
    block: np.ndarray  # per candidate: its block's position in `blocks`
    index: np.ndarray  # per candidate: its flat index in the block
    params: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    def model(self, c: int) -> ModelSpec:
        return search.decode(self.blocks[self.block[c]], int(self.index[c]), self.base)

    def runs(self) -> Iterator[tuple[int, search.Block, slice]]:
        """(block position, block, its candidates' slice): candidates are grouped by block."""
        bounds = np.flatnonzero(np.diff(self.block, prepend=-1, append=len(self.blocks)))
        for start, stop in itertools.pairwise(bounds):
            yield int(self.block[start]), self.blocks[self.block[start]], slice(int(start), int(stop))


def candidates(query: search.Search) -> Candidates:
    blocks, block, index, params = [], [], [], []
    for b, (found, hits, counted) in enumerate(search.similar(query)):
        blocks.append(found)
        block.append(np.full(len(hits), b))
        index.append(hits)
        params.append(counted)
    join = (lambda parts: np.concatenate(parts)) if blocks else (lambda parts: np.zeros(0, dtype=np.int64))
    return Candidates(query.base, tuple(blocks), join(block), join(index), join(params))


# -- the fast pass: one-program plans from per-layer prices ---------------------------------------

@dataclass(frozen=True)
class Variant:
    """A one-program plan of the cluster: its (dp, op) over every device, batch axis, ZeRO-2."""

    dp: int
    op: int
    axis: str
    zero: bool

    def describe(self) -> str:
        stage = StagePlan((), tuple(range(self.dp * self.op)), self.dp, self.op)
        return describe_plan(Plan((stage,), 1, self.axis, False, self.zero, "1F1B", "chosen"))


@dataclass(frozen=True)
class LayerPrices:
    """One position of a block: per multiset row (and variant), what the layer costs."""

    compute: np.ndarray  # [row, variant]: forward + backward seconds of one micro-batch, less its op collectives,
    # before cost.lockstep (which slows a whole stage where any layer has op collectives)
    collectives: np.ndarray  # [row, variant]: its op collectives' seconds
    overhead: np.ndarray  # [row, variant]: program_overheads, paid once per step on CPU
    solo: np.ndarray  # [row]: forward + backward of a micro-batch on one device (the bound's work)
    fixed: np.ndarray  # [row]: fixed costs per call of a micro-batch, which every device of its stage pays
    params: np.ndarray  # [row]
    sharded: np.ndarray  # [row]: the params op shards
    tensors: np.ndarray  # [row]
    kept: np.ndarray  # [row, variant]: residual bytes of a micro-batch on one device
    working: np.ndarray  # [row, variant]: kept + the backward's scratch (the peak of one layer)
    flops: np.ndarray  # [row]: forward FLOPs per sample


class Pricer:
    """One target's prices: every distinct layer (mixers, widths) priced once per variant."""

    def __init__(self, target: Target, training: TrainingSpec, book: ProfileBook, links: Iterable[LinkSpec],
                 base: ModelSpec):
        self.target, self.training, self.links = target, training, tuple(links)
        self.job = target.job(base, training)
        self.profile: DeviceProfile = book.for_job(self.job)
        self.intra, self.inter = cluster_links(self.profile, target.cluster, self.links)
        self.n = target.cluster.num_devices
        self.variants = [Variant(dp, op, axis, zero) for axis in MESH_AXES for zero in (False, True)
                         for dp, op in meshes(self.job, self.n, axis)]
        self.meshes = [Submesh(tuple(range(self.n)), v.dp, v.op, v.axis) for v in self.variants]
        self.positions: dict[tuple, LayerPrices] = {}

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
            self.positions[key] = LayerPrices(*(np.array(column) for column in zip(*priced)))
        return self.positions[key]

    def layer(self, tokens: tuple[str, ...], block: search.Block, i: int, base: ModelSpec) -> tuple:
        """One layer's prices, from a one-layer workload of its exact widths (cost.stage_compute)."""
        proxy = ModelSpec(base.num_features, base.emb_dim, base.output_per_emb, len(block.layers),
                          tuple(tokens if j == i else ("LINEAR",) * n for j, n in enumerate(block.layers)))
        own, mixers = _layer_work(proxy, i, self.training.fold_dot)
        work = sum((w for _, w in mixers), own)
        w = self.workload(proxy, (work,), (own,), (mixers,))
        compute, collectives = zip(*(self.compute(w, mesh) for mesh in self.meshes))
        solo = sum(stage_compute(w, [0], Submesh((0,), 1, 1), False, self.n)[:2])
        kept, working = zip(*(self.residuals(work, v) for v in self.variants))
        overhead = [program_overheads(w, [0], self.n, mesh.op) for mesh in self.meshes]
        return (compute, collectives, overhead, solo, self.fixed(mixers), work.params,
                work.sharded_params, work.tensors, kept, working, work.flops)

    def compute(self, w: Workload, mesh: Submesh) -> tuple[float, float]:
        """(compute less collectives, before lockstep; collectives) of the one layer of w on mesh."""
        fwd, bwd, comm = stage_compute(w, [0], mesh, False, self.n)
        collectives = sum(comm.values())
        return (fwd + bwd - collectives) / (lockstep(self.profile, mesh.op) if collectives else 1.0), collectives

    def fixed(self, mixers: tuple[tuple[str, counts.Work], ...]) -> float:
        """The per-call costs stage_compute charges every device of a stage for one micro-batch of
        this layer (3 per mixer call, cost.engine_calls: its forward and backward's two; 2 for the
        layer's own work). On devices sharing cores a step pays them once, and measured points
        replace them: 0 there."""
        if self.profile.shares_cores:
            return 0.0
        rates = [(self.profile.rate(self.training.precision, k), 3) for k, _ in engine_calls(mixers)]
        rates.append((self.profile.rate(self.training.precision, LAYER), 2))
        return sum(0.0 if r.forward_points else calls * r.overhead for r, calls in rates)

    def residuals(self, work: counts.Work, v: Variant) -> tuple[float, float]:
        """As cost.stage_memory keeps one layer of a fused step: (residuals, residuals + the backward's
        fold scratch) in bytes."""
        byte = ACTIVATION_BYTES[self.training.precision]
        samples = self.job.global_batch // self.job.num_micro_batches / (v.dp if v.axis == "dp" else v.op)
        split = v.op if v.axis == "dp" else 1
        kept = samples * byte * (work.activations - work.sharded_activations + work.sharded_activations / split)
        return kept, kept + work.fold_rows / v.op * byte + 2 * work.fold_kernel / v.op * PARAM_BYTES


@functools.cache
def _layer_work(proxy: ModelSpec, i: int, fold: bool) -> tuple[counts.Work, tuple]:
    return counts.layer_own_work(proxy, i), counts.layer_mixers(proxy, i, fold)


@dataclass(frozen=True)
class Fast:
    """The fast pass over one block's candidates."""

    seconds: np.ndarray  # best fitting one-program plan's step time; inf where none fits
    memory: np.ndarray  # its peak bytes per device (the smallest peak where none fits)
    variant: np.ndarray  # its position in Pricer.variants
    bound: np.ndarray  # lower bound on any plan's step time
    flops: np.ndarray  # forward FLOPs per sample


def fast_pass(pricer: Pricer, block: search.Block, index: np.ndarray, base: ModelSpec) -> Fast:
    """Every one-program plan of every candidate in `index`, as cost.estimate prices pp = 1."""
    prices = [pricer.position(block, i, base) for i in range(len(block.layers))]
    digit = dict(search.digits(index, [len(p.params) for p in prices]))
    rows = [digit[i] for i in range(len(prices))]
    total = lambda name: sum(getattr(p, name)[r] for p, r in zip(prices, rows))
    collectives, kept, overhead = total("collectives"), total("kept"), total("overhead")
    slow = np.array([lockstep(pricer.profile, v.op) for v in pricer.variants])
    compute = total("compute") * np.where(collectives > 0, slow, 1.0) + collectives
    working = np.max([p.working[r] for p, r in zip(prices, rows)], axis=0)
    synthetic = pricer.workload(base, (counts.Work(params=total("params"), sharded_params=total("sharded"),
                                                   tensors=total("tensors")),))
    micro, n_last = pricer.job.num_micro_batches, block.layers[-1]
    seconds, memory = np.empty_like(compute), np.empty_like(compute)
    for v, (variant, mesh) in enumerate(zip(pricer.variants, pricer.meshes)):
        seconds[:, v], memory[:, v] = _variant(pricer, synthetic, variant, mesh, compute[:, v], kept[:, v],
                                               working[:, v], overhead[:, v], n_last)
    best, fits = _best(pricer, seconds, memory)
    flop_bound = 3 * total("flops") * pricer.job.global_batch / (pricer.n * _peak(pricer.profile,
                                                                                  pricer.training.precision))
    degrees = min(pricer.target.parallel.num_auto_layers, pricer.n)  # the most pipeline stages
    bound = np.maximum.reduce([flop_bound, micro * total("solo") / pricer.n, micro * total("fixed") / degrees])
    chosen = np.take_along_axis(memory, best[:, None], 1)[:, 0]
    return Fast(np.where(fits, np.take_along_axis(seconds, best[:, None], 1)[:, 0], np.inf),
                np.where(fits, chosen, memory.min(axis=1)), best, bound, total("flops"))


def _variant(pricer: Pricer, synthetic: Workload, v: Variant, mesh: Submesh, compute: np.ndarray,
             kept: np.ndarray, working: np.ndarray, overhead: np.ndarray, n_last: int) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, peak bytes) of one variant over the candidates: estimate's pp = 1 branch, with
    stage_cost's gradient sync, update and accumulation, and stage_memory's fused-step peak."""
    job, profile, n = pricer.job, pricer.profile, pricer.n
    micro = job.num_micro_batches
    _, sync = gradient_sync(synthetic, [0], mesh, v.zero, n)
    update, _ = stage_update(synthetic, [0], mesh, v.zero, n)
    params = stage_params(synthetic, [0], v.op) * PARAM_BYTES
    grads = params / v.dp if v.zero else params
    accumulate = accumulate_time(grads, profile, profile.memory_share(n), micro)
    once = v.axis == "dp" and not v.zero  # Plan.syncs_once(1)
    seconds = (profile.call_cost(n) + micro * (compute + accumulate + (0 if once else sync))
               - (micro - 1) * overhead + update + (sync if once else 0))
    shards = v.dp if v.axis == "dp" else v.op
    model = synthetic.model
    carry = job.global_batch // micro / shards * ACTIVATION_BYTES[pricer.training.precision] * counts.input_width(model)
    activations, working = profile.activation_share * (kept + carry), profile.activation_share * working
    data = job.global_batch / shards * 4 * (counts.input_width(model)
                                            + model.emb_dim * n_last * model.output_per_emb)
    local = params if (v.zero and v.dp > 1) or micro > 1 else 0.0
    scratch = np.maximum(working, profile.update_scratch * grads - activations) + local
    return seconds, np.floor(params + grads + 2 * grads + activations + data + scratch)


def _best(pricer: Pricer, seconds: np.ndarray, memory: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fastest fitting variant, whether any fits), as Auto search ranks them."""
    fits = memory <= pricer.profile.memory
    timed = np.where(fits, seconds, np.inf)
    return timed.argmin(axis=1), fits.any(axis=1)


def _peak(profile: DeviceProfile, precision: str) -> float:
    """The device's fastest FLOP rate over every kind and direction, measured points included."""
    table = dict(dict(profile.rates).get(precision) or dict(profile.rates)["fp32"])
    fastest = 0.0
    for rate in table.values():
        points = [f / s for f, s in (*rate.forward_points, *rate.backward_points) if s > 0]
        fastest = max(fastest, rate.forward, rate.backward, *points)
    return fastest


# -- the ranking ----------------------------------------------------------------------------------

@dataclass
class Ranking:
    """One target's figures for every candidate (position = the candidate's)."""

    target: Target
    global_batch: int
    seconds: np.ndarray  # predicted step time of its best plan; inf where nothing fits
    memory: np.ndarray  # its predicted peak bytes per device
    bound: np.ndarray  # lower bound on any plan's step time
    flops: np.ndarray  # forward FLOPs per sample
    plans: list[str]  # its best plan, described
    searched: np.ndarray  # whether the full Auto search priced it
    reasons: dict[int, str] = field(default_factory=dict)  # why nothing fits
    choices: dict[int, AutoChoice] = field(default_factory=dict)  # the full searches' answers

    def order(self) -> np.ndarray:
        """Candidates that fit, fastest first (ties in space order)."""
        fits = np.flatnonzero(np.isfinite(self.seconds))
        return fits[np.argsort(self.seconds[fits], kind="stable")]

    def top(self, k: int) -> np.ndarray:
        return self.order()[:k]

    def samples_per_s(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.where(np.isfinite(self.seconds), self.global_batch / self.seconds, np.nan)


def rank(query: search.Search, config: Config, book: ProfileBook, platform_of: Callable[[ClusterSpec], str],
         top: int = DEFAULT_TOP, prune: bool = True) -> tuple[Candidates, list[Ranking]]:
    """Every candidate of the query on every target of the config, best plan each."""
    found = candidates(query)
    return found, [rank_target(t, config.training, book, config.links, found, top, prune)
                   for t in targets(config, platform_of)]


def rank_target(target: Target, training: TrainingSpec, book: ProfileBook, links: Sequence[LinkSpec],
                found: Candidates, top: int, prune: bool = True) -> Ranking:
    """The fast pass over every candidate, then the full searches it cannot stand for."""
    pricer = Pricer(target, training, book, links, found.base)
    ranking = _fast_ranking(pricer, found)
    groups = target.parallel.num_auto_layers
    exact = min(groups, pricer.n) == 1  # the space holds one-program plans only
    search_one = functools.partial(_search_one, ranking, found, training, book, links)
    for c in np.flatnonzero(~np.isfinite(ranking.seconds)):
        if int(c) not in ranking.reasons:
            search_one(int(c))
    if not exact:
        _pruned_searches(ranking, search_one, top, prune)
    while not all(ranking.searched[c] for c in ranking.top(top)):  # the top K as a sweep would run them
        for c in ranking.top(top):
            if not ranking.searched[c]:
                search_one(int(c))
    log.info("%s: %d of %d candidates searched in full", target.describe(), int(ranking.searched.sum()), len(found))
    return ranking


def _fast_ranking(pricer: Pricer, found: Candidates) -> Ranking:
    parts, reasons = [], {}
    with tqdm(total=len(found), desc=f"ranking on {pricer.target.cluster.summary()}", unit="cand",
              unit_scale=True, file=sys.stderr, disable=None, leave=False) as bar:
        for _, block, part in found.runs():
            parts.append(fast_pass(pricer, block, found.index[part], found.base))
            why = _invalid(pricer, found.model(part.start))
            if why:
                reasons.update(dict.fromkeys(range(part.start, part.stop), why))
                parts[-1].seconds[:] = np.inf
            bar.update(part.stop - part.start)
    join = lambda name: np.concatenate([getattr(p, name) for p in parts]) if parts else np.zeros(0)
    names = [v.describe() for v in pricer.variants]
    seconds = join("seconds")
    plans = [names[v] if np.isfinite(s) else "" for v, s in zip(join("variant").astype(int), seconds)]
    return Ranking(pricer.target, pricer.job.global_batch, seconds, join("memory"), join("bound"),
                   join("flops"), plans, np.zeros(len(found), dtype=bool), reasons)


def _invalid(pricer: Pricer, model: ModelSpec) -> str:
    """Why no plan of the target can run a block's models ("" when some can)."""
    job = pricer.target.job(model, pricer.training)
    if job.global_batch % job.num_micro_batches:
        return f"global batch {job.global_batch} is not divisible by num_micro_batches = {job.num_micro_batches}"
    try:
        layer_groups(job)
    except PlanError as err:
        return str(err)
    return "" if pricer.variants else "no (dp, op) of the cluster splits the micro-batch"


def _search_one(ranking: Ranking, found: Candidates, training: TrainingSpec, book: ProfileBook,
                links: Sequence[LinkSpec], c: int) -> None:
    """Auto search's own answer for candidate c (or why nothing fits)."""
    ranking.searched[c] = True
    try:
        choice = choose_plan(ranking.target.job(found.model(c), training), book, links)
    except (NoPlanFits, PlanError) as err:
        ranking.seconds[c], ranking.plans[c], ranking.reasons[c] = np.inf, "", str(err)
        return
    best = choice.best()
    ranking.choices[c] = choice
    ranking.seconds[c], ranking.memory[c] = best.estimate.seconds, best.estimate.peak_bytes
    ranking.plans[c] = describe_plan(best.plan)


def _pruned_searches(ranking: Ranking, search_one: Callable[[int], None], top: int, prune: bool) -> None:
    """Full searches in ascending bound order while a candidate's bound beats the K-th best time
    known (every time known is a plan's, so the true K-th best is no slower)."""
    def kth() -> float:
        finite = ranking.seconds[np.isfinite(ranking.seconds)]
        return float(np.partition(finite, top - 1)[top - 1]) if len(finite) >= top else math.inf

    threshold = kth()
    for c in np.argsort(ranking.bound, kind="stable"):
        if prune and ranking.bound[c] >= threshold:
            break
        if not ranking.searched[c] and int(c) not in ranking.reasons:
            search_one(int(c))
            if ranking.seconds[c] < threshold:
                threshold = kth()


def pareto(params: np.ndarray, samples_per_s: np.ndarray) -> np.ndarray:
    """Candidates no other matches on both parameters and samples/s with one of them higher."""
    ok = np.flatnonzero(np.isfinite(samples_per_s))
    order = ok[np.lexsort((-samples_per_s[ok], -params[ok]))]  # most parameters first, then fastest
    best_before = np.maximum.accumulate(np.concatenate([[-np.inf], samples_per_s[order]]))[:-1]
    marked = np.zeros(len(params), dtype=bool)
    marked[order[samples_per_s[order] > best_before]] = True
    return marked


def agreement(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """How well the prediction ranked what ran: Spearman's rho of predicted and measured samples/s,
    and the measured samples/s of the predicted best against the measured best."""
    from scipy.stats import spearmanr

    pairs = [(p, m) for p, m in zip(predicted, measured) if np.isfinite(p) and np.isfinite(m)]
    if not pairs:
        return {}
    p, m = map(np.array, zip(*pairs))
    rho = float(spearmanr(p, m).statistic) if len(pairs) > 2 else math.nan
    chosen = float(m[np.argmax(p)])
    return {"runs": len(pairs), "spearman": rho, "predicted_best_measured": chosen,
            "measured_best": float(m.max()), "best_ratio": chosen / float(m.max())}


# -- output ---------------------------------------------------------------------------------------

def write_toml(found: Candidates, rankings: Sequence[Ranking], top: int, out) -> None:
    """The top K of each target as `[[model]]` tables, each with its plan; a model already printed
    for an earlier target is named, not repeated (a config holds each model once)."""
    base_params = counts.param_count(found.base)
    printed: set[int] = set()
    for ranking in rankings:
        best = ranking.top(top)
        out.write(f"# {ranking.target.describe()}: top {len(best)} of {len(found):,} candidates\n")
        for r, c in enumerate(best, 1):
            c = int(c)
            line = (f"# rank {r}: {ranking.global_batch / ranking.seconds[c]:,.0f} samples/s predicted, "
                    f"{ranking.memory[c] / 2**30:.2f} GiB per device; plan: {ranking.plans[c]}")
            if c in printed:
                out.write(f"{line}; {found.model(c).summary()}, printed above\n")
                continue
            printed.add(c)
            choice = search.Choice("candidate", found.model(c), int(found.params[c]))
            out.write(f"{line}\n{search.to_toml(choice, base_params)}")
        out.write("\n")


def csv_rows(found: Candidates, rankings: Sequence[Ranking],
             measured: dict[tuple[int, int], tuple[float, str]] | None = None) -> Iterator[list[object]]:
    """The CSV's rows (COLUMNS): every candidate of every target. measured: (target, candidate) ->
    (measured samples/s, job key) of the candidates `--run-top` ran."""
    measured = measured or {}
    base_params = counts.param_count(found.base)
    models = [found.model(c) for c in range(len(found))]
    labels = [(m.summary(), m.num_zhen_layers, json.dumps([list(t) for t in m.tokens])) for m in models]
    for t, ranking in enumerate(rankings):
        speed = ranking.samples_per_s()
        ranks = np.zeros(len(found), dtype=int)
        ranks[ranking.order()] = np.arange(1, len(ranking.order()) + 1)
        frontier = pareto(found.params.astype(float), speed)
        bound = ranking.global_batch / ranking.bound
        for c in range(len(found)):
            run = measured.get((t, c), (math.nan, ""))
            yield [ranking.target.cluster.summary(), ranking.target.micro, ranks[c] or "", labels[c][0],
                   labels[c][1], labels[c][2], int(found.params[c]),
                   f"{(found.params[c] - base_params) / base_params:.4f}", f"{3 * ranking.flops[c] / 1e9:.4g}",
                   _num(speed[c]), _num(ranking.seconds[c] * 1e3), _num(ranking.memory[c] / 2**30),
                   ranking.plans[c], "full" if ranking.searched[c] else "one-program",
                   _num(bound[c]), int(frontier[c]), ranking.reasons.get(c, ""), _num(run[0]), run[1]]


def _num(value: float) -> str:
    return f"{value:.6g}" if np.isfinite(value) else ""


def write_csv(found: Candidates, rankings: Sequence[Ranking], path: str,
              measured: dict[tuple[int, int], tuple[float, str]] | None = None) -> int:
    """Every candidate of every target to `path`; returns the row count."""
    import csv

    from codesign.csv_cells import safe_cell

    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        count = 0
        for row in csv_rows(found, rankings, measured):
            writer.writerow([safe_cell(cell) for cell in row])
            count += 1
    return count


def agreement_line(figures: dict[str, float]) -> str:
    """The agreement in words, for stderr and the report."""
    if not figures:
        return "no winner was measured (see the sweep's summary above)"
    return (f"{figures['runs']} measured; Spearman {figures['spearman']:.2f} between predicted and measured "
            f"samples/s; the predicted best measured {figures['predicted_best_measured']:,.0f} samples/s, "
            f"{figures['best_ratio']:.1%} of the measured best ({figures['measured_best']:,.0f})")
