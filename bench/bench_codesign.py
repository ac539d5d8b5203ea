"""Co-design search: the time to rank the default space, and how well the ranking predicts real runs.

Goals (issues 23, 46): the 79,705 equal-capacity candidates of the default space ranked on simulated
H100 clusters of 8, 16 and 64 GPUs (bench/plan_sim.toml) in at most 60 s on 2 cores; with layer
groups (bench/codesign_groups.toml: num_auto_layers = 4, micro-batches [1, 4]) in at most 60 s, and
with the users' fixture Auto specs (groups 2 and 4, micro-batches [1, 2, 4]) in at most 3 minutes,
each process under 4 GB of peak memory (the targets in parallel processes, as `codesign search
--rank` ranks them; `--workers 1`: all in one); on 4 virtual CPU devices, the predicted ranking of small candidates
against their measured one (every candidate run): Spearman at least 0.8, the predicted best within
10% of the measured best. Prints figures; asserts nothing. Run it under `flock /tmp/codesign-bench.lock`.

    python bench/bench_codesign.py              # both parts
    python bench/bench_codesign.py --part time  # the ranking times only
    python bench/bench_codesign.py --part cpu   # the CPU runs only (a few minutes)
    python bench/bench_codesign.py --ranking groups --precision bf16 --workers 1  # one ranking, one process
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO.parent / "shared" / "fixtures" / "user-configs" / "config.toml"
# (what is ranked, its goal in seconds): each runs in its own process, for its own peak memory
RANKINGS = {"plan_sim": ("bench/plan_sim.toml", 60), "groups": ("bench/codesign_groups.toml", 60),
            "fixtures": ("the fixture config's Auto specs on bench/codesign_groups.toml's clusters", 180)}
PRECISIONS = ("fp32", "bf16")  # users train in both: each ranking is timed in each
CPU_CONFIG = """
[training_spec]
avg_batch_size_per_device = 64
num_iters = 20
min_measured_seconds = 2.0

[[model]]
num_features = 32
emb_dim = 16
output_per_emb = 4
num_zhen_layers = 1
tokens = ["DOT"]

[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 4
transport = "NVLink"
platform = "cpu"

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [1]
"""
# Every one-layer model of 4 mixers over three kinds (15), at small widths; the tolerance keeps them all.
CPU_SPACE = ["--base-features", "32", "--base-emb-dim", "16", "--base-output-per-emb", "4", "--slots", "4",
             "--max-layers", "1", "--param-tolerance", "1", "--base-tokens", "DOT,LINEAR,ATTENTION,LINEAR"]


def ranked_config(name: str, fixture: Path, precision: str):
    """The config a RANKINGS entry ranks, in a precision."""
    from codesign.config.loader import load_config

    if name != "fixtures":
        config = load_config(REPO / RANKINGS[name][0])
    else:
        groups = load_config(REPO / "bench" / "codesign_groups.toml")
        config = dataclasses.replace(groups, parallels=tuple(p for p in load_config(fixture).parallels if p.is_auto))
    return dataclasses.replace(config, training=dataclasses.replace(config.training, precision=precision))


def time_ranking(name: str, fixture: Path, precision: str, workers: int | None) -> None:
    """Rank the default space on one RANKINGS config, as `codesign search --rank` does (the targets
    in parallel processes; `workers` 1: all in this one)."""
    from codesign.cli import build_search_parser
    from codesign.planner import ranking
    from codesign.hardware.profiles import ProfileBook
    from codesign.zhen import search

    config = ranked_config(name, fixture, precision)
    where, goal = RANKINGS[name]
    query = search.search_from_args(build_search_parser().parse_args([]))
    start = time.perf_counter()
    found, rankings = ranking.rank(query, config, ProfileBook(), lambda cluster: "sim", ranking.DEFAULT_TOP,
                                   workers=workers)
    total = time.perf_counter() - start
    for ranked in rankings:
        best = int(ranked.top(1)[0])
        print(f"{ranked.target.describe()}: {int(ranked.searched.sum())} searched in full; best "
              f"{found.model(best).summary()} at {ranked.global_batch / ranked.seconds[best]:,.0f} samples/s "
              f"({ranked.plans[best]})", flush=True)
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20
    print(f"ranking time, {precision}, {len(found):,} candidates on {len(rankings)} targets of {where}: {total:.1f} s "
          f"(goal: at most {goal} s), {'in one process' if workers == 1 else 'in parallel processes'}; peak memory of a process "
          f"{peak:.2f} GiB (goal: under 4 GB)", flush=True)


def time_all(fixture: Path) -> None:
    """Each RANKINGS entry in a process of its own, in fp32 and in bf16."""
    for name in RANKINGS:
        for precision in PRECISIONS:
            subprocess.run([sys.executable, __file__, "--ranking", name, "--fixture", str(fixture), "--precision",
                            precision], check=False, env={**os.environ, "PYTHONPATH": str(REPO)})


def cpu_runs(keep: Path | None) -> None:
    """`codesign search --rank --run-top ALL` on 4 virtual CPU devices; the rankings side by side."""
    folder = keep or Path(tempfile.mkdtemp(prefix="codesign-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    config, table = folder / "cpu.toml", folder / "rank.csv"
    config.write_text(CPU_CONFIG)
    env = {**os.environ, "CODESIGN_PROFILE": os.environ.get("CODESIGN_PROFILE", "builtin")}
    command = [sys.executable, "-m", "codesign", "search", "--rank", "-c", str(config), "-d",
               str(folder / "results.db"), "--csv", str(table), "--run-top", "100", *CPU_SPACE]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, check=False)
    print(f"search --rank --run-top: exit {proc.returncode} in {time.perf_counter() - start:.0f} s ({folder})")
    print("\n".join(line for line in proc.stderr.splitlines() if line.startswith("codesign:")))
    with open(table, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["measured_samples_per_s"]]
    measured = sorted(rows, key=lambda r: -float(r["measured_samples_per_s"]))
    place = {r["model"]: i for i, r in enumerate(measured, 1)}
    print(f"{'predicted rank':>14} {'measured rank':>13} {'predicted/s':>12} {'measured/s':>11}  model, plan")
    for r in sorted(rows, key=lambda r: int(r["rank"])):
        print(f"{r['rank']:>14} {place[r['model']]:>13} {float(r['predicted_samples_per_s']):>12,.0f} "
              f"{float(r['measured_samples_per_s']):>11,.0f}  {r['model']}, {r['plan']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("time", "cpu", "both"), default="both")
    parser.add_argument("--keep", type=Path, help="Folder for the CPU part's config, DB and CSV (default: a temp one).")
    parser.add_argument("--ranking", choices=tuple(RANKINGS), help="Time this ranking alone, in this process.")
    parser.add_argument("--fixture", type=Path, default=FIXTURE, help="The users' config whose Auto specs are ranked.")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="With --ranking: the training precision.")
    parser.add_argument("--workers", type=int, help="With --ranking: processes ranking clusters (default: one per core).")
    args = parser.parse_args()
    if args.ranking:
        time_ranking(args.ranking, args.fixture, args.precision, args.workers)
        return
    if args.part in ("time", "both"):
        time_all(args.fixture)
    if args.part in ("cpu", "both"):
        cpu_runs(args.keep)


if __name__ == "__main__":
    main()
