"""`codesign plan`: every plan of each (model, cluster, micro-batch count), ranked, as a table or CSV.

Each row is one plan with its predicted seconds per iteration, peak memory per device and their
breakdown, whether it fits, and its speed-up over plain data parallel (pp 1, dp = devices);
the config's own manual specs are marked (and listed even when outside the space or the top K), and
so is the plan each Auto search spec would choose (marked with the spec's summary).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
from typing import Iterable, Iterator, TextIO

from codesign.errors import PlanError
from codesign.planner.auto import choose_plan
from codesign.planner.cost import Workload
from codesign.planner.device_profiles import ProfileBook
from codesign.planner.space import Priced, plan_space, price, rank_key, same_plan
from codesign.config.loader import Config
from codesign.config.hosts import Hosts, platform_for
from codesign.config.jobs import matches
from codesign.config.types import Job, ParallelSpec

log = logging.getLogger(__name__)

COLUMNS = ("model", "cluster", "micro_batches", "rank", "plan", "fits", "time_ms", "memory_gib",
           "speedup_vs_dp", "compute_ms", "communication_ms", "bubble_ms", "optimizer_ms",
           "params_gib", "grads_gib", "adam_gib", "activations_gib", "workspace_gib", "manual")


def plan_rows(config: Config, book: ProfileBook, top: int | None = None,
              hosts: Hosts | None = None) -> Iterator[dict[str, object]]:
    """Each cluster on the platform a sweep on these hosts would run it on (a cluster they cannot
    provide: on the platform it declares), priced by the same profiles."""
    for cluster in config.clusters:
        platform = platform_for(cluster, hosts)
        for model in config.models:
            for micro in micro_batch_counts(config.parallels, cluster):
                job = Job(model, cluster, config.training, ParallelSpec("plan", (micro,)), micro, platform)
                yield from _space_rows(job, config, book, top)


def micro_batch_counts(parallels: Iterable[ParallelSpec], cluster) -> list[int]:
    """Every num_micro_batches value of the specs that match the cluster."""
    return sorted({m for p in parallels if matches(p, cluster) for m in p.num_micro_batches})


def _space_rows(job: Job, config: Config, book: ProfileBook, top: int | None) -> Iterator[dict[str, object]]:
    workload = Workload.of(job, book.for_job(job), config.links)
    space = plan_space(job, workload)
    manual = _manual(job, workload, config.parallels) + _auto(job, book, config)
    baseline = next((p for p in space if _plain_dp(p, job)), None)
    marks: dict[int, list[str]] = {}
    for spec, priced in manual:
        match = next((i for i, p in enumerate(space) if same_plan(p.plan, priced.plan)), None)
        if match is None:
            space.append(priced)
            match = len(space) - 1
        marks.setdefault(match, []).append(spec.description)
    order = sorted(range(len(space)), key=lambda i: rank_key(space[i]))
    for rank, i in enumerate(order, 1):
        if top is None or rank <= top or i in marks:
            yield _row(job, rank, space[i], baseline, marks.get(i, []))


def _manual(job: Job, workload: Workload, parallels: Iterable[ParallelSpec]) -> list[tuple[ParallelSpec, Priced]]:
    """The config's manual specs for this job's cluster and micro-batch count, priced."""
    found = []
    for spec in parallels:
        if spec.is_auto or not matches(spec, job.cluster) or job.num_micro_batches not in spec.num_micro_batches:
            continue
        priced = price(job, workload, dataclasses.replace(spec, num_micro_batches=(job.num_micro_batches,)))
        if priced is not None:
            found.append((spec, priced))
    return found


def _auto(job: Job, book: ProfileBook, config: Config) -> list[tuple[ParallelSpec, Priced]]:
    """The plan each Auto search spec of the config would choose for this job, priced."""
    found = []
    for spec in config.parallels:
        if not spec.is_auto or job.num_micro_batches not in spec.num_micro_batches:
            continue
        concrete = dataclasses.replace(spec, num_micro_batches=(job.num_micro_batches,))
        try:
            best = choose_plan(dataclasses.replace(job, parallel=concrete), book, config.links).best()
        except PlanError as err:
            log.warning("%s on %s, %d micro-batches: %s", spec.summary(), job.cluster.summary(),
                        job.num_micro_batches, err)
            continue
        found.append((dataclasses.replace(spec, description=spec.summary()), Priced(concrete, best.plan, best.estimate)))
    return found


def _plain_dp(p: Priced, job: Job) -> bool:
    stage = p.plan.stages[0]
    return (len(p.plan.stages) == 1 and stage.dp == job.cluster.num_devices and not p.plan.remat
            and not p.plan.reduce_scatter)


def _row(job: Job, rank: int, p: Priced, baseline: Priced | None, manual: list[str]) -> dict[str, object]:
    e, mem = p.estimate, p.estimate.memory
    speedup = baseline.estimate.seconds / e.seconds if baseline and baseline.estimate.fits else None
    return {"model": job.model.summary(), "cluster": job.cluster.summary(), "micro_batches": job.num_micro_batches,
            "rank": rank, "plan": p.spec.description if not manual else _name(p), "fits": e.fits,
            "time_ms": e.seconds * 1e3, "memory_gib": e.peak_bytes / 2**30, "speedup_vs_dp": speedup,
            "compute_ms": max(e.compute) * 1e3, "communication_ms": sum(e.communication.values()) * 1e3,
            "bubble_ms": e.bubble * 1e3, "optimizer_ms": e.optimizer * 1e3,
            **{f"{k}_gib": v / 2**30 for k, v in mem.as_dict().items()}, "manual": "; ".join(manual)}


def _name(p: Priced) -> str:
    """E.g. "pp2 dp4 op1 1F1B contiguous"; where stages differ, per stage: "pp2 dp[2,1] op1 groups[1,3] ..."."""
    plan, stages = p.plan, p.plan.stages
    parts = [f"pp{len(stages)} dp{_per_stage([s.dp for s in stages])} op{_per_stage([s.op for s in stages])}"]
    counts = [len(s.groups) for s in stages]
    parts += [f"groups{_per_stage(counts)}"] * (len(set(counts)) > 1) + ["remat"] * plan.remat
    parts += ["zero2"] * plan.reduce_scatter + ([plan.schedule] if len(plan.stages) > 1 else [])
    return " ".join(parts + ["batch@op"] * (plan.batch_axis == "op") + [plan.placement])


def _per_stage(values: list[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else "[" + ",".join(map(str, values)) + "]"


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
