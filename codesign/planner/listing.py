"""`codesign plan`: the plans of each (model, cluster, micro-batch count), ranked, as a table or CSV.

Each (model, cluster, micro-batch count) lists a block of plans per space (column `space`):
- "Auto search groups=N", for each `num_auto_layers` of the Auto search specs with that
  micro-batch count: the plans Auto search prices in that space (all of a small space; in a large
  one, the dynamic program's proposals and their neighbours), in its order, so rank 1 is the plan
  it chooses, marked with the specs' summaries;
- "manual groups=L", where manual specs match the cluster with that micro-batch count: every plan
  of the space with one layer group per layer that a manual spec could express, the config's
  manual specs marked (and listed even when outside that space or the top K).

Each row is one plan with its predicted seconds per iteration, peak memory per device and their
breakdown, whether it fits, and its speed-up over plain data parallel (pp 1, dp = devices) of its
block; its joules per iteration, and whether it is on the block's time-energy frontier (ordered
by energy or cost, rows on it are listed even beyond the top K). Blocks are ordered by an objective (planner.objective):
an Auto search block by its spec's unless the command names one; with energy or cost, each
plan is also priced at the power limits the device accepts (column `power_w`).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
from typing import Iterable, Iterator, TextIO

from codesign.config.hosts import Hosts, platform_for
from codesign.config.jobs import matches
from codesign.config.loader import Config
from codesign.config.types import ClusterSpec, Job, ParallelSpec
from codesign.errors import PlanError
from codesign.planner.auto import no_fit_message, price_space
from codesign.cost.model import Workload, estimate
from codesign.hardware.profiles import ProfileBook
from codesign.cost.plan import make_plan, plan_name
from codesign.planner.objective import TIME, Objective, frontier, of_spec, order
from codesign.planner.space import MANUAL, Candidate, all_plans, same_plan

log = logging.getLogger(__name__)

# The manual listing's finest cut: its plans grow combinatorially with groups, and a deep model
# (a transformer's dozens of layers) would list millions of them.
MANUAL_GROUPS = 8
COLUMNS = ("model", "cluster", "micro_batches", "space", "rank", "plan", "fits", "time_ms", "memory_gib",
           "speedup_vs_dp", "compute_ms", "communication_ms", "bubble_ms", "optimizer_ms",
           "params_gib", "grads_gib", "adam_gib", "activations_gib", "workspace_gib", "manual",
           "energy_j", "samples_per_j", "power_w", "frontier")


@dataclasses.dataclass(frozen=True)
class Block:
    """One space's plans for one job, ranked, and the config's specs each runs (by index)."""

    job: Job
    space: str
    plans: list[Candidate]
    marks: dict[int, list[str]]
    objective: Objective = TIME


def plan_rows(config: Config, book: ProfileBook, top: int | None = None, hosts: Hosts | None = None,
              objective: Objective | None = None) -> Iterator[dict[str, object]]:
    """Each cluster on the platform a sweep on these hosts would run it on (a cluster they cannot
    provide: on the platform it declares), priced by the same profiles; ordered by `objective`
    (None: an Auto search block by its spec's, a manual one by time)."""
    for cluster in config.clusters:
        platform = platform_for(cluster, hosts)
        for model in config.models:
            for micro in micro_batch_counts(config.parallels, cluster):
                job = Job(model, cluster, config.training, ParallelSpec("plan", (micro,)), micro, platform)
                for block in [*_auto_blocks(job, config, book, objective),
                              *_manual_blocks(job, config, book, objective or TIME)]:
                    yield from _rows(block, top)


def micro_batch_counts(parallels: Iterable[ParallelSpec], cluster: ClusterSpec) -> list[int]:
    """Every num_micro_batches value of the specs that match the cluster."""
    return sorted({m for p in parallels if matches(p, cluster) for m in p.num_micro_batches})


def _specs(job: Job, config: Config, auto: bool) -> list[ParallelSpec]:
    """The config's Auto search (or manual) specs that run on the job's cluster and micro-batch
    count, each for that count alone."""
    return [dataclasses.replace(p, num_micro_batches=(job.num_micro_batches,)) for p in config.parallels
            if p.is_auto == auto and matches(p, job.cluster) and job.num_micro_batches in p.num_micro_batches]


def _auto_blocks(job: Job, config: Config, book: ProfileBook, objective: Objective | None) -> Iterator[Block]:
    """Per layer-group count (and objective) of the Auto search specs: the plans Auto search
    prices, its choice first (when any plan fits)."""
    specs = _specs(job, config, auto=True)
    for groups, goal in dict.fromkeys((s.num_auto_layers, objective or of_spec(s)) for s in specs):
        same = [s for s in specs if s.num_auto_layers == groups and (objective or of_spec(s)) == goal]
        searched = dataclasses.replace(job, parallel=same[0])
        workload = Workload.of(searched, book.for_job(searched), config.links)
        try:
            plans = order(price_space(searched, workload), goal, workload)
        except PlanError as err:
            log.warning("%s on %s, %d micro-batches: %s", same[0].summary(), job.cluster.summary(),
                        job.num_micro_batches, err)
            continue
        chosen = bool(plans) and plans[0].estimate.fits
        if not chosen:
            log.warning("%s on %s, %d micro-batches: %s", same[0].summary(), job.cluster.summary(),
                        job.num_micro_batches, no_fit_message(workload, plans))
        yield Block(searched, f"Auto search groups={groups}", plans, {0: [s.summary() for s in same]} if chosen else {},
                    goal)


def _manual_blocks(job: Job, config: Config, book: ProfileBook, objective: Objective) -> Iterator[Block]:
    """Where manual specs run: the space's plans a manual spec could express, one group per
    layer up to MANUAL_GROUPS groups; each manual spec marked on its plan, which is added where
    the space lacks it."""
    specs = _specs(job, config, auto=False)
    if not specs:
        return
    groups = min(job.model.num_layers, MANUAL_GROUPS)
    spaced = dataclasses.replace(job, parallel=ParallelSpec("manual", (job.num_micro_batches,), groups))
    workload = Workload.of(spaced, book.for_job(spaced), config.links)
    plans = [Candidate(p, estimate(workload, p)) for p in all_plans(spaced, MANUAL)]
    marks: dict[int, list[str]] = {}
    for spec in specs:
        try:
            plan = make_plan(dataclasses.replace(job, parallel=spec))
        except PlanError:
            continue
        match = next((i for i, c in enumerate(plans) if same_plan(c.plan, plan)), None)
        if match is None:
            plans.append(Candidate(plan, estimate(workload, plan)))
            match = len(plans) - 1
        marks.setdefault(match, []).append(spec.description)
    ordered = order(plans, objective, workload)
    rank = {i: next(r for r, c in enumerate(ordered) if c.plan is plans[i].plan) for i in marks}
    yield Block(spaced, f"manual groups={groups}", ordered, {rank[i]: names for i, names in marks.items()}, objective)


def _rows(block: Block, top: int | None) -> Iterator[dict[str, object]]:
    """The block's top plans (all without top), its marked ones and, ordered by energy or cost,
    its frontier, by rank."""
    baseline = next((c for c in block.plans if _plain_dp(c, block.job)), None)
    on_frontier = {id(c) for c in frontier(block.plans)}
    shown = on_frontier if block.objective.name != "time" else set()
    for i, candidate in enumerate(block.plans):
        if top is None or i < top or i in block.marks or id(candidate) in shown:
            yield _row(block, i + 1, candidate, baseline, block.marks.get(i, []), id(candidate) in on_frontier)


def _plain_dp(c: Candidate, job: Job) -> bool:
    stage = c.plan.stages[0]
    return (len(c.plan.stages) == 1 and stage.dp == job.cluster.num_devices and not c.plan.remat
            and not c.plan.reduce_scatter and not c.estimate.power_limits)


def _row(block: Block, rank: int, c: Candidate, baseline: Candidate | None, marks: list[str],
         on_frontier: bool) -> dict[str, object]:
    e, mem, job = c.estimate, c.estimate.memory, block.job
    joules = None if math.isnan(e.energy) else float(e.energy)
    speedup = baseline.estimate.seconds / e.seconds if baseline and baseline.estimate.fits else None
    return {"model": job.model.summary(), "cluster": job.cluster.summary(), "micro_batches": job.num_micro_batches,
            "space": block.space, "rank": rank, "plan": plan_name(c.plan), "fits": e.fits,
            "time_ms": e.seconds * 1e3, "memory_gib": e.peak_bytes / 2**30, "speedup_vs_dp": speedup,
            "compute_ms": max(e.compute) * 1e3, "communication_ms": sum(e.communication.values()) * 1e3,
            "bubble_ms": e.bubble * 1e3, "optimizer_ms": e.optimizer * 1e3,
            **{f"{k}_gib": v / 2**30 for k, v in mem.as_dict().items()}, "manual": "; ".join(marks),
            "energy_j": joules, "samples_per_j": job.global_batch / joules if joules else None,
            "power_w": "/".join(f"{w:.0f}" for w in e.power_limits) or None, "frontier": "yes" if on_frontier else None}


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 1000 else f"{value:.0f}"
    return str(value)


def write_table(rows: Iterable[dict[str, object]], out: TextIO) -> int:
    """Aligned columns, one block per (model, cluster, micro-batches); returns the row count."""
    cells = [[_cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    out.write("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")
    return len(cells)


def write_csv(rows: Iterable[dict[str, object]], out: TextIO) -> int:
    from codesign.csv_cells import safe_cell

    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    count = 0
    for row in rows:
        writer.writerow({k: "" if v is None else safe_cell(v) for k, v in row.items()})
        count += 1
    return count
