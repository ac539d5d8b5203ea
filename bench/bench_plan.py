"""Time `codesign plan` end to end (a fresh process, imports included) on simulated clusters.

    python bench/bench_plan.py [-c bench/plan_sim.toml] [--repeat 3]

Prints the wall and CPU time of each run (goal: at most 1 s for bench/plan_sim.toml, 64 simulated
GPUs; the CPU time says how much of the wall a loaded machine added) and how many plans each
(cluster, micro-batches, space) ranks.
"""

from __future__ import annotations

import argparse
import csv
import io
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default=str(HERE / "plan_sim.toml"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.repeat):
        start, cpu = time.perf_counter(), _children_cpu()
        proc = subprocess.run([sys.executable, "-m", "codesign", "plan", "-c", args.config, "-d", "/nonexistent.db",
                               "--format", "csv"], capture_output=True, text=True, cwd=HERE.parent)
        seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        print(f"codesign plan: {seconds:.2f} s wall, {cpu:.2f} s CPU")
    blocks: dict[tuple[str, str, str], list[dict]] = {}  # in the listing's order, best first
    for r in csv.DictReader(io.StringIO(proc.stdout)):
        blocks.setdefault((r["cluster"], r["micro_batches"], r["space"]), []).append(r)
    for (cluster, micro, space), rows in blocks.items():
        print(f"  {cluster:24} micro-batches {micro:>2}  {space:22} {len(rows):>5} plans ranked; "
              f"best {rows[0]['plan']}")
    return 0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    sys.exit(main())
