"""What the energy objective and the power knob buy, as the cost model predicts it.

    python bench/bench_energy.py [-c bench/plan_sim.toml] [--micro 4] [--groups 4]

For each cluster of the config, Auto search's choice under each objective (time; energy within
5% of the fastest; energy unbounded; cost with eta 0.5): predicted time and joules per
iteration, the power limits chosen, joules saved and time lost against the fastest, and the
search's seconds. Then per-stage limits on a two-stage pipeline, uneven and balanced: the
joules they save and what they do to the iteration. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from codesign.config.loader import load_config
from codesign.config.types import Job, ParallelSpec
from codesign.planner.auto import choose_plan
from codesign.cost.model import Workload, estimate
from codesign.hardware.profiles import ProfileBook
from codesign.cost.plan import Plan, StagePlan, plan_name
from codesign.planner.power_limits import per_stage

HERE = Path(__file__).resolve().parent
OBJECTIVES = (("time", None, 0.5), ("energy", 0.05, 0.5), ("energy", None, 0.5), ("cost", None, 0.5))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default=str(HERE / "plan_sim.toml"))
    parser.add_argument("--micro", type=int, default=4, help="micro-batches (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=4, help="layer groups (default: %(default)s)")
    args = parser.parse_args()
    config, book = load_config(args.config), ProfileBook()
    print(f"{'cluster':24} {'objective':16} {'plan':40} {'ms':>8} {'J':>9} {'limits W':>12} "
          f"{'J saved':>8} {'slower':>7} {'search s':>8}")
    for cluster in config.clusters:
        fastest = None
        for name, slowdown, eta in OBJECTIVES:
            spec = ParallelSpec("Auto search", (args.micro,), args.groups, objective=name, max_slowdown=slowdown, eta=eta)
            job = Job(config.models[0], cluster, config.training, spec, args.micro, cluster.platform)
            start = time.perf_counter()
            best = choose_plan(job, book).best()
            seconds = time.perf_counter() - start
            e = best.estimate
            fastest = fastest or e
            label = name + (f" {slowdown:.0%}" if slowdown is not None else "")
            limits = "/".join(f"{w:.0f}" for w in e.power_limits) or "-"
            print(f"{cluster.summary():24} {label:16} {plan_name(best.plan):40} {e.seconds * 1e3:8.2f} "
                  f"{e.energy:9.2f} {limits:>12} {1 - e.energy / fastest.energy:8.1%} "
                  f"{e.seconds / fastest.seconds - 1:7.1%} {seconds:8.2f}")
    _pipelines(config, book, args.micro)
    return 0


def _pipelines(config, book: ProfileBook, micro: int) -> None:
    """Per-stage limits on two stages of four devices each, layers split unevenly and evenly."""
    cluster = config.clusters[0]
    model = dataclasses.replace(config.models[0], num_zhen_layers=4, tokens=(config.models[0].tokens[0],) * 4)
    job = Job(model, cluster, config.training, ParallelSpec("bench", (micro,), 4), micro, cluster.platform)
    w = Workload.of(job, book.for_job(job))
    half = cluster.num_devices // 2
    print(f"\nper-stage limits, 2 stages x {half} devices on {cluster.summary()}, {micro} micro-batches")
    for first, second in (((0, 1, 2), (3,)), ((0, 1), (2, 3))):
        stages = (StagePlan(tuple((i,) for i in first), tuple(range(half)), half, 1),
                  StagePlan(tuple((i,) for i in second), tuple(range(half, 2 * half)), half, 1))
        plan = Plan(stages, micro, "dp", False, False, "1F1B", "chosen")
        before = estimate(w, plan)
        after = per_stage(w, plan, before) or before
        limits = "/".join(f"{x:.0f}" for x in after.power_limits) or "-"
        print(f"  layers {len(first)}+{len(second)}: {before.seconds * 1e3:.3f} -> {after.seconds * 1e3:.3f} ms, "
              f"{before.energy:.2f} -> {after.energy:.2f} J ({1 - after.energy / before.energy:.1%} saved), "
              f"limits {limits} W")


if __name__ == "__main__":
    raise SystemExit(main())
