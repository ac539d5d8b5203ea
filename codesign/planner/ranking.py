"""Co-design search: every equal-capacity ZHEN model ranked by its best plan on each cluster.

The candidates are every model of `codesign search`'s space within --param-tolerance of the base
(no draw). For each target (a cluster of the config, with an Auto search spec and micro-batch
count), each candidate gets the plan Auto search would choose, in three steps:

- a fast pass (planner.fast_pass) prices every candidate's one-program plans (pp = 1: each
  (dp, op), batch axis and ZeRO-2, without remat, which only ever adds time) through the cost
  model's own stage functions, from per-layer prices: a layer's compute is priced once per
  (mixers, widths) and mesh, and a candidate's stage is the sum over its layers, priced on all
  candidates of a block at once. Where the spec has one layer group (or the cluster one device)
  that is Auto search's whole space, so the pass is its answer;
- a lower bound on any plan's time (fast_pass): the least of the one-program plans' times and
  of any pipeline's, each pipeline simulated with its stages at what they spend at least;
- the full Auto search (`auto.choose_plan`) where the fast pass is not the answer: a candidate no
  one-program plan fits (it gets the reason when nothing fits), and, in ascending bound order, the
  candidates whose bound beats the K-th best time known so far (pruning stops at the first that
  cannot). The final top K always come from `choose_plan`: the plans a sweep would run.

Each candidate's predicted joules per iteration are those of the plan it is ranked by, priced as
`estimate` prices them. Two Pareto frontiers per target: candidates no other beats on both
parameters and predicted samples/s, and on both samples/s and samples/J (time against energy).
Same input, same output: nothing is drawn, ties keep the space's order.
"""

from __future__ import annotations

import dataclasses

import functools
import itertools
import json
import logging
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from codesign.errors import PlanError
from codesign.planner.objective import pareto
from codesign.planner.auto import AutoChoice, NoPlanFits, choose_plan
from codesign.planner.fast_pass import Pricer, fast_pass, pipeline_bound
from codesign.cost.plan import layer_groups, plan_name
from codesign.hardware.profiles import ProfileBook
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
from codesign import families
from codesign.transformer.search import Shapes
from codesign.zhen import search

log = logging.getLogger(__name__)
DEFAULT_TOP = 5
DEFAULT_CSV = "codesign_rank.csv"
COLUMNS = ("cluster", "micro_batches", "rank", "model", "num_zhen_layers", "tokens", "params",
           "params_vs_base", "train_gflops_per_sample", "predicted_samples_per_s", "predicted_step_ms",
           "predicted_memory_gib", "plan", "searched", "bound_samples_per_s", "pareto", "reason",
           "measured_samples_per_s", "job_key", "samples_per_joule", "energy_frontier", "gemms")


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
    cluster (1 when none matches). The ranking is by speed: each spec's plans are chosen by time
    (its samples per joule are those of the fastest plan), whatever objective the spec names."""
    autos = [dataclasses.replace(p, objective="time", max_slowdown=None, eta=0.5) for p in config.parallels if p.is_auto]
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

    def label(self, c: int) -> tuple[str, int, str, str]:
        """(summary, layers, tokens as JSON, GEMM shapes: none, they follow from the tokens)."""
        m = self.model(c)
        return m.summary(), m.num_zhen_layers, json.dumps([list(t) for t in m.tokens]), ""

    def toml(self, c: int, base_params: int) -> str:
        return search.to_toml(search.Choice("candidate", self.model(c), int(self.params[c])), base_params)

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


# -- the ranking ----------------------------------------------------------------------------------

@dataclass
class Ranking:
    """One target's figures for every candidate (position = the candidate's)."""

    target: Target
    global_batch: int
    seconds: np.ndarray  # predicted step time of its best plan; inf where nothing fits
    memory: np.ndarray  # its predicted peak bytes per device
    joules: np.ndarray  # its predicted joules per iteration, every device of the cluster (NaN: unpriced)
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

    def samples_per_joule(self) -> np.ndarray:
        """NaN where nothing fits or the device has no power model."""
        with np.errstate(divide="ignore"):
            return np.where(np.isfinite(self.seconds), self.global_batch / self.joules, np.nan)


# candidates whose bound is tightened at once: a chunk's arrays stay small enough for the
# allocator to reuse (all of a space's at once, page faults took a third of the time)
TIGHTEN_CHUNK = 20_000
PARALLEL_FROM = 10_000  # candidates: a smaller ranking takes less than a worker process to start


def rank(query: search.Search, config: Config, book: ProfileBook, platform_of: Callable[[ClusterSpec], str],
         top: int = DEFAULT_TOP, prune: bool = True, workers: int | None = None) -> tuple[Candidates, list[Ranking]]:
    """Every candidate of the query on every target of the config, best plan each: the targets
    in up to `workers` processes (default: one per core where the space is large enough), the
    dearest first, each process sharing layer prices among the targets it ranks. A target's
    figures do not depend on which process ranks it."""
    found, listed = candidates(query), targets(config, platform_of)
    if workers is None:
        workers = os.cpu_count() or 1 if len(found) >= PARALLEL_FROM else 1
    workers = min(len(listed), workers)
    if workers <= 1:
        return found, _ranked(listed, query, config, book, top, prune, progress=True, found=found)
    ranked: dict[Target, Ranking] = {}
    with (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool,
          tqdm(total=len(listed), desc=f"ranking on {workers} processes", unit="target", file=sys.stderr,
               disable=None, leave=False) as bar):
        running = [pool.submit(_ranked, [t], query, config, book, top, prune)
                   for t in sorted(listed, key=_work, reverse=True)]
        for done in as_completed(running):
            for ranking in done.result():
                ranked[ranking.target] = ranking
                log.info("%s: %d of %d candidates searched in full", ranking.target.describe(),
                         int(ranking.searched.sum()), len(found))
            bar.update(len(done.result()))
    return found, [ranked[t] for t in listed]


def rank_shapes(found: Shapes, config: Config, book: ProfileBook,
                platform_of: Callable[[ClusterSpec], str]) -> list[Ranking]:
    """A family without a fast pass (transformers: tens of shapes, not millions of models): each
    candidate's own Auto search on each target, so every figure is the plan a sweep would run."""
    rankings = []
    for target in targets(config, platform_of):
        n = len(found)
        ranking = Ranking(target, target.job(found.base, config.training).global_batch, np.full(n, np.inf),
                          np.zeros(n), np.full(n, np.nan), np.zeros(n),
                          np.array([families.counts(m).forward_flops_per_sample(m) for m in found.models], float),
                          [""] * n, np.zeros(n, bool))
        for c in tqdm(range(n), desc=f"searches on {target.cluster.summary()}", unit="shape", file=sys.stderr,
                      disable=None, leave=False):
            _search_one(ranking, found, config.training, book, config.links, c)
        ranking.bound = ranking.seconds.copy()  # every plan searched: its time is its bound
        rankings.append(ranking)
    return rankings


def _work(target: Target) -> int:
    """What ranking a target costs, roughly: its cluster's devices (meshes, pipeline placements)."""
    return target.cluster.num_devices


_WORKER: dict = {}  # in a (spawned) worker process: its candidates and layer prices, kept for its next targets


def _ranked(listed: list[Target], query: search.Search, config: Config, book: ProfileBook, top: int, prune: bool,
            progress: bool = False, found: Candidates | None = None) -> list[Ranking]:
    """Targets ranked in turn, sharing layer prices; in a worker process (found None) it lists
    the candidates once, as the same query lists them in the same order, and keeps the prices
    for its next targets."""
    if found is not None:
        prices = {}
    else:
        if "found" not in _WORKER:
            _WORKER.update(found=candidates(query), prices={})
        found, prices = _WORKER["found"], _WORKER["prices"]
    return [rank_target(t, config.training, book, config.links, found, top, prune, prices, progress)
            for t in listed]


def rank_target(target: Target, training: TrainingSpec, book: ProfileBook, links: Sequence[LinkSpec],
                found: Candidates, top: int, prune: bool = True, prices: dict | None = None,
                progress: bool = True) -> Ranking:
    """The fast pass over every candidate, then the full searches it cannot stand for. prices: the
    layer prices of the targets ranked before (with the same training, profiles and links);
    progress: bars on a terminal (a worker process's would garble its parent's)."""
    positions = None if prices is None else prices.setdefault((target.cluster, target.platform, target.micro), {})
    computes = None if prices is None else prices.setdefault("layer computes", {})
    pricer = Pricer(target.job(found.base, training), training, book, links, target.parallel.num_auto_layers,
                    positions, computes)
    ranking = _fast_ranking(target, pricer, found, top, progress)
    exact = pricer.degrees == 1  # the space holds one-program plans only
    with tqdm(desc=f"full searches on {target.cluster.summary()}", unit="search", file=sys.stderr,
              disable=None if progress else True, leave=False) as bar:
        def search_one(c: int) -> None:
            _search_one(ranking, found, training, book, links, c)
            bar.update()

        for c in np.flatnonzero(~np.isfinite(ranking.seconds)):
            if int(c) not in ranking.reasons:
                search_one(int(c))
        if not exact:
            _pruned_searches(ranking, search_one, top, prune)
        while not all(ranking.searched[c] for c in ranking.top(top)):  # the top K as a sweep would run them
            for c in ranking.top(top):
                if not ranking.searched[c]:
                    search_one(int(c))
    if progress:
        log.info("%s: %d of %d candidates searched in full", target.describe(), int(ranking.searched.sum()),
                 len(found))
    return ranking


def _fast_ranking(target: Target, pricer: Pricer, found: Candidates, top: int, progress: bool) -> Ranking:
    parts, reasons = [], {}
    with tqdm(total=len(found), desc=f"ranking on {target.cluster.summary()}", unit="cand", unit_scale=True,
              file=sys.stderr, disable=None if progress else True, leave=False) as bar:
        for _, block, part in found.runs():
            parts.append(fast_pass(pricer, block, found.index[part], found.base))
            why = _invalid(target, pricer, found.model(part.start))
            if why:
                reasons.update(dict.fromkeys(range(part.start, part.stop), why))
                parts[-1].seconds[:] = np.inf
            bar.update(part.stop - part.start)
    join = lambda name: np.concatenate([getattr(p, name) for p in parts]) if parts else np.zeros(0)
    names = [v.name() for v in pricer.variants]
    seconds, bound = join("seconds"), join("bound")
    if pricer.pipelines and parts:
        layers = max(p.terms.shape[1] for p in parts)
        terms = np.concatenate([np.pad(p.terms, ((0, 0), (0, layers - p.terms.shape[1]), (0, 0))) for p in parts])
        depth = np.array([len(b.layers) for b in found.blocks])[found.block]
        _tighten(bound, join("least"), terms, depth, _kth(seconds, top), pricer)
    plans = [names[v] if np.isfinite(s) else "" for v, s in zip(join("variant").astype(int), seconds)]
    return Ranking(target, pricer.job.global_batch, seconds, join("memory"), join("joules"), bound,
                   join("flops"), plans, np.zeros(len(found), dtype=bool), reasons)


def _tighten(bound: np.ndarray, least: np.ndarray, terms: np.ndarray, depth: np.ndarray, threshold: float,
             pricer: Pricer) -> None:
    """Where the bound does not already prune (under `threshold`, the K-th best time the fast pass
    knows, which the searches only lower): raise it to the least of the candidate's one-program
    plans' times and pipeline_bound, less a margin for rounding; TIGHTEN_CHUNK candidates at a time."""
    below = np.flatnonzero(bound < threshold)
    for open_ in np.array_split(below, max(1, math.ceil(len(below) / TIGHTEN_CHUNK))):
        tighter = np.minimum(least[open_], pipeline_bound(pricer, terms[open_], depth[open_], threshold))
        bound[open_] = np.maximum(bound[open_], tighter * (1 - 1e-9))


def _invalid(target: Target, pricer: Pricer, model: ModelSpec) -> str:
    """Why no plan of the target can run a block's models ("" when some can)."""
    job = target.job(model, pricer.training)
    if job.global_batch % job.num_micro_batches:
        return f"global batch {job.global_batch} is not divisible by num_micro_batches = {job.num_micro_batches}"
    try:
        layer_groups(job)
    except PlanError as err:
        return str(err)
    return "" if pricer.variants else "no (dp, op) of the cluster splits the micro-batch"


def _search_one(ranking: Ranking, found: Candidates | Shapes, training: TrainingSpec, book: ProfileBook,
                links: Sequence[LinkSpec], c: int) -> None:
    """Auto search's own answer for candidate c (or why nothing fits)."""
    ranking.searched[c] = True
    try:
        choice = choose_plan(ranking.target.job(found.model(c), training), book, links)
    except (NoPlanFits, PlanError) as err:
        ranking.seconds[c], ranking.joules[c], ranking.plans[c], ranking.reasons[c] = np.inf, np.nan, "", str(err)
        return
    best = choice.best()
    ranking.choices[c] = choice
    ranking.seconds[c], ranking.memory[c] = best.estimate.seconds, best.estimate.peak_bytes
    ranking.joules[c] = best.estimate.energy
    ranking.plans[c] = plan_name(best.plan)


def _pruned_searches(ranking: Ranking, search_one: Callable[[int], None], top: int, prune: bool) -> None:
    """Full searches in ascending bound order while a candidate's bound beats the K-th best time
    known (every time known is a plan's, so the true K-th best is no slower)."""
    kth = functools.partial(_kth, ranking.seconds, top)
    threshold = kth()
    for c in np.argsort(ranking.bound, kind="stable"):
        if prune and ranking.bound[c] >= threshold:
            break
        if not ranking.searched[c] and int(c) not in ranking.reasons:
            search_one(int(c))
            if ranking.seconds[c] < threshold:
                threshold = kth()


def _kth(seconds: np.ndarray, k: int) -> float:
    """The k-th best finite time (inf where fewer are)."""
    finite = seconds[np.isfinite(seconds)]
    return float(np.partition(finite, k - 1)[k - 1]) if len(finite) >= k else math.inf



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

def write_toml(found: Candidates | Shapes, rankings: Sequence[Ranking], top: int, out) -> None:
    """The top K of each target as `[[model]]` tables, each with its plan; a model already printed
    for an earlier target is named, not repeated (a config holds each model once)."""
    base_params = families.counts(found.base).param_count(found.base)
    printed: set[int] = set()
    for ranking in rankings:
        best, per_joule = ranking.top(top), ranking.samples_per_joule()
        out.write(f"# {ranking.target.describe()}: top {len(best)} of {len(found):,} candidates\n")
        for r, c in enumerate(best, 1):
            c = int(c)
            line = (f"# rank {r}: {ranking.global_batch / ranking.seconds[c]:,.0f} samples/s and "
                    f"{_figure(per_joule[c])} samples/J predicted, {ranking.memory[c] / 2**30:.2f} GiB per device; "
                    f"plan: {ranking.plans[c]}")
            if c in printed:
                out.write(f"{line}; {found.model(c).summary()}, printed above\n")
                continue
            printed.add(c)
            out.write(f"{line}\n{found.toml(c, base_params)}")
        out.write("\n")


def csv_rows(found: Candidates | Shapes, rankings: Sequence[Ranking],
             measured: dict[tuple[int, int], tuple[float, str]] | None = None) -> Iterator[list[object]]:
    """The CSV's rows (COLUMNS): every candidate of every target, text cells safe for a
    spreadsheet. measured: (target, candidate) -> (measured samples/s, job key) of the
    candidates `--run-top` ran."""
    from codesign.csv_cells import safe_cell

    measured = measured or {}
    base_params = families.counts(found.base).param_count(found.base)
    labels = [(safe_cell(summary), layers, safe_cell(table), gemms)
              for summary, layers, table, gemms in map(found.label, range(len(found)))]
    for t, ranking in enumerate(rankings):
        speed = ranking.samples_per_s()
        ranks = np.zeros(len(found), dtype=int)
        ranks[ranking.order()] = np.arange(1, len(ranking.order()) + 1)
        frontier = pareto(found.params.astype(float), speed)
        per_joule = ranking.samples_per_joule()
        energy = pareto(speed, per_joule)  # time against energy: samples/s and samples/J
        bound = ranking.global_batch / ranking.bound
        cluster, plans = safe_cell(ranking.target.cluster.summary()), {p: safe_cell(p) for p in set(ranking.plans)}
        for c in range(len(found)):
            run = measured.get((t, c), (math.nan, ""))
            yield [cluster, ranking.target.micro, ranks[c] or "", labels[c][0],
                   labels[c][1], labels[c][2], int(found.params[c]),
                   f"{(found.params[c] - base_params) / base_params:.4f}", f"{3 * ranking.flops[c] / 1e9:.4g}",
                   _num(speed[c]), _num(ranking.seconds[c] * 1e3), _num(ranking.memory[c] / 2**30),
                   plans[ranking.plans[c]], "full" if ranking.searched[c] else "one-program",
                   _num(bound[c]), int(frontier[c]), safe_cell(ranking.reasons.get(c, "")), _num(run[0]), run[1],
                   _num(per_joule[c]), int(energy[c]), labels[c][3]]


def _num(value: float) -> str:
    return f"{value:.6g}" if np.isfinite(value) else ""


def _figure(value: float) -> str:
    """Three significant figures for a reader, without an exponent ("n/a" where not priced)."""
    if not np.isfinite(value) or value <= 0:
        return "n/a"
    return f"{value:,.{max(0, 2 - math.floor(math.log10(value)))}f}"


def write_csv(found: Candidates | Shapes, rankings: Sequence[Ranking], path: str,
              measured: dict[tuple[int, int], tuple[float, str]] | None = None) -> int:
    """Every candidate of every target to `path`; returns the row count."""
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        count = 0
        for row in csv_rows(found, rankings, measured):
            writer.writerow(row)
            count += 1
    return count


def agreement_line(figures: dict[str, float]) -> str:
    """The agreement in words, for stderr and the report."""
    if not figures:
        return "no winner was measured (see the sweep's summary above)"
    return (f"{figures['runs']} measured; Spearman {figures['spearman']:.2f} between predicted and measured "
            f"samples/s; the predicted best measured {figures['predicted_best_measured']:,.0f} samples/s, "
            f"{figures['best_ratio']:.1%} of the measured best ({figures['measured_best']:,.0f})")
