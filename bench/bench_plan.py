"""Time `codesign plan` end to end (a fresh process, imports included) on simulated clusters.

    python bench/bench_plan.py [-c bench/plan_sim.toml] [--repeat 3]

Prints the wall time of each run and how many plans each (model, cluster, micro-batches) ranks.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
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
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "codesign", "plan", "-c", args.config, "-d", "/nonexistent.db",
                               "--format", "csv"], capture_output=True, text=True, cwd=HERE.parent)
        seconds = time.perf_counter() - start
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        print(f"codesign plan: {seconds:.2f} s")
    groups = collections.Counter((r["cluster"], r["micro_batches"]) for r in csv.DictReader(io.StringIO(proc.stdout)))
    for (cluster, micro), n in sorted(groups.items()):
        print(f"  {cluster:28} micro-batches {micro}: {n} plans ranked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
