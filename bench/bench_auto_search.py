"""Auto search's time per job on simulated H100 clusters of 1 to 64 devices (target: <= 5 s at 64).

    python bench/bench_auto_search.py [--max-devices 64] [--layers 4 8] [--micro 1 4 8]

For each (cluster, layer groups, micro-batches): the search's wall time, how it searched (every
plan, or the DP's proposals), how many plans it priced against the size of the space, and the
chosen plan with its predicted step time.
"""

from __future__ import annotations

import argparse
import sys

from codesign.planner.auto import EXHAUSTIVE_LIMIT, choose_plan
from codesign.hardware.profiles import ProfileBook
from codesign.cost.plan import plan_name
from codesign.planner.space import space_size
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec

CLUSTERS = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]  # (hosts, devices per host)
SPACE_CAP = 10**6  # count the space up to this


def seed_model(layers: int) -> ModelSpec:
    return ModelSpec(512, 160, 20, layers, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-devices", type=int, default=64)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8], help="ZHEN layers = layer groups")
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    book = ProfileBook()
    print(f"{'cluster':>8} {'groups':>6} {'micro':>5} {'search_s':>8} {'method':>10} {'priced':>6} {'space':>9} "
          f"{'step_ms':>8}  plan")
    worst: dict[int, float] = {}
    for hosts, per_host in CLUSTERS:
        n = hosts * per_host
        if n > args.max_devices:
            continue
        for layers in args.layers:
            for micro in args.micro:
                cluster = ClusterSpec(hosts, per_host, "EFAx4" if hosts > 1 else "NVLink", "sim", "H100")
                job = Job(seed_model(layers), cluster, TrainingSpec(1024, 10),
                          ParallelSpec("Auto search", (micro,), num_auto_layers=layers), micro, "sim")
                choice = choose_plan(job, book)
                size = space_size(job, SPACE_CAP)
                method = "every plan" if size <= EXHAUSTIVE_LIMIT else "DP"
                best = choice.best()
                print(f"{hosts}x{per_host:<6} {layers:>6} {micro:>5} {choice.seconds:>8.2f} {method:>10} "
                      f"{choice.priced:>6} {size if size <= SPACE_CAP else f'>{SPACE_CAP:.0e}':>9} "
                      f"{best.estimate.seconds * 1e3:>8.2f}  {plan_name(best.plan)}")
                worst[n] = max(worst.get(n, 0.0), choice.seconds)
    for n, seconds in sorted(worst.items()):
        print(f"slowest search on {n} devices: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
