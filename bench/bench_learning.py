"""Does the cost model learn from every run? (issue 49)

Measures this machine's CPU profile into a fresh profile cache (`codesign profile`, as a user's
first sweep on a new machine does; `--base builtin` takes the built-in profile instead, which
was fitted on the machine the project is developed on), then runs bench/learning_cpu.toml's 36
jobs (three small models; dp, op, dp x op and pipelines with micro-batches on 4 and 8 virtual
CPU devices; manual jobs only) priced by it, with learning and without, in three rounds that
each run every plan once (planned_jobs), each job run with learning then without before the
next (the machine's drift is shared, not compared); then
bench/learning_cpu_other.toml's jobs (two other models) on the learning run's cache. Prints the
median time error |predicted / measured - 1| of the first, second and last third of the
attempts with and without learning, the rank correlation (Spearman) of predicted and measured
times per (model, cluster) group, the second sweep's error from its first job on, the
calibrations fitted, and memory: the share of predicted peaks below the measured by more than
5% and the median over-prediction; and the run-to-run difference of the two runs' measured
medians (one job's two runs, a minute apart), the noise the errors sit on, and, job for job over
the last third, how much closer learning priced it than the same job's run without. Goals (issue 49): last third <= 0.6x the first third and
<= 12%; the second sweep starts within 1.2x of the first's last third; without learning no such
fall; memory: at most 5% below by > 5%, median over-prediction <= 15%.

    python bench/bench_learning.py                  # about 15 minutes on two idle cores
    python bench/bench_learning.py --out DIR        # keep the DBs and the cache in DIR
    python bench/bench_learning.py --jobs 2         # a smoke run: two jobs per sweep
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from codesign.cli.session import jax_cache_in
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs
from codesign.config.loader import load_config
from codesign.outcome import OOM, SUCCEEDED
from codesign.run.learning import calibration_versions
from codesign.run.local import LocalExecutor
from codesign.run.profile_cache import ProfileCache, measure, profiles_for, this_machine
from codesign.run.sweep import Pricing, run_sweep
from codesign.store.database import Store

BENCH = Path(__file__).resolve().parent
FIRST, OTHER = BENCH / "learning_cpu.toml", BENCH / "learning_cpu_other.toml"
UNDER = 0.05  # a predicted peak below the measured by more than this is an under-prediction


def measured_base(caches: list[Path]) -> str:
    """This machine's CPU profile, measured once into every cache (one base for every run)."""
    machine = this_machine("cpu", Hosts.local(0))
    profile = measure(machine, ProfileCache(caches[0]))
    if profile is None:
        raise SystemExit("bench_learning: measuring the CPU profile failed (see above)")
    for cache in caches[1:]:
        ProfileCache(cache).save(machine, profile)
    return profile.source


def planned_jobs(config_path: Path, seed: int, jobs: int | None = None) -> list:
    """The config's jobs (the first `jobs` of them) in rounds, one round per model: each round
    runs every plan once, its models rotated from round to round (a Latin square), in a seeded
    shuffled order within it. So each third of the first sweep holds the same plans, and the
    last third's errors compare with the first's job for job kind: a shuffled order had put
    other plans in each third, and a third's median moved with them."""
    planned = list(enumerate_jobs(load_config(str(config_path)), Hosts.local(0)))
    models = list(dict.fromkeys(item.job.model for item in planned))
    by_plan: dict[tuple, dict] = {}
    for item in planned:
        by_plan.setdefault(plan_of(item.job), {})[item.job.model] = item
    order, shuffle = [], random.Random(seed).shuffle
    for turn in range(len(models)):
        round_ = [found[models[(i + turn) % len(models)]] for i, found in enumerate(by_plan.values())
                  if models[(i + turn) % len(models)] in found]
        shuffle(round_)
        order += round_
    return order[:jobs]


def plan_of(job) -> tuple:
    """What a job runs apart from its model."""
    return job.cluster, job.parallel, job.num_micro_batches


def run_one(item, config_path: Path, db: Path, cache: Path, learning: bool, timeout: float) -> None:
    """One job as a sweep of its own, priced by the cache's latest calibration (with learning)."""
    profiles = profiles_for(Hosts.local(0), cache=ProfileCache(cache), learning=learning)
    store = Store(db)
    try:
        run_sweep([item], store, LocalExecutor(jax_cache_in(db.parent)), False, timeout, 1,
                  Pricing(profiles, load_config(str(config_path)).links))
    finally:
        store.close()


def paired(config_path: Path, runs: list[tuple[Path, Path, bool]], seed: int, timeout: float,
           jobs: int | None = None) -> list[list[dict]]:
    """Each job of the config run once per (DB, cache, learning) of `runs`, one after the other
    before the next job starts, so that every run sees the machine as it was for the others (a
    machine's pace drifts by more than the errors compared); each run's attempts in order."""
    for item in planned_jobs(config_path, seed, jobs):
        for db, cache, learning in runs:
            run_one(item, config_path, db, cache, learning, timeout)
    return [_attempts(db) for db, _, _ in runs]


def _attempts(db: Path) -> list[dict]:
    store = Store(db)
    try:
        return store.attempts()
    finally:
        store.close()


def time_errors(rows: list[dict]) -> np.ndarray:
    """|predicted / measured - 1| of each measured attempt, in the order they ran."""
    return np.array([abs(r["predicted_time"] / r["median"] - 1) for r in rows
                     if r["status"] == SUCCEEDED and r["median"] and r["predicted_time"]])


def thirds(errors: np.ndarray) -> list[float]:
    return [float(np.median(part)) if len(part) else float("nan") for part in np.array_split(errors, 3)]


def rank_correlations(rows: list[dict]) -> dict[str, float]:
    """Spearman's rho of predicted against measured step time per (model, cluster) group."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["status"] == SUCCEEDED and r["median"] and r["predicted_time"]:
            key = (f"F{r['input_features']} D{r['emb_dimensions']} L{r['num_zhen_layers']} {r['token_mixer']}"
                   f" on {r['num_nodes'] * r['gpus_per_node']}")
            groups.setdefault(key, []).append((r["predicted_time"], r["median"]))
    return {k: float(spearmanr(*zip(*v)).statistic) for k, v in sorted(groups.items()) if len(v) > 2}


def memory_figures(rows: list[dict]) -> tuple[float, float, int]:
    """(share of predicted peaks below the measured by more than UNDER, median over-prediction, n);
    an oom attempt's prediction is below its peak."""
    ratios = [r["predicted_memory"] / r["max_memory"] for r in rows
              if r["status"] == SUCCEEDED and r["max_memory"] and r["predicted_memory"]]
    under = sum(x < 1 - UNDER for x in ratios) + sum(r["status"] == OOM for r in rows)
    n = len(ratios) + sum(r["status"] == OOM for r in rows)
    return under / max(n, 1), float(np.median(ratios)) - 1 if ratios else float("nan"), n


def run_to_run(rows: list[dict], again: list[dict]) -> float:
    """The median |median2 / median - 1| of the jobs both runs measured: the noise the errors sit on."""
    first = {r["job_key"]: r["median"] for r in rows if r["status"] == SUCCEEDED and r["median"]}
    both = [abs(r["median"] / first[r["job_key"]] - 1) for r in again
            if r["status"] == SUCCEEDED and r["median"] and r["job_key"] in first]
    return float(np.median(both)) if both else float("nan")


def closer(rows: list[dict], without: list[dict]) -> tuple[float, int, int]:
    """Over the last third of `rows`' measured attempts: the median of each job's error with
    learning minus its error without (the same job, run just after), and how many of them
    learning priced closer, of how many. The two runs share the machine's drift, so the
    difference is what learning changed, less noisy than either third's median."""
    unlearned = {r["job_key"]: abs(r["predicted_time"] / r["median"] - 1) for r in without
                 if r["status"] == SUCCEEDED and r["median"] and r["predicted_time"]}
    timed = [r for r in rows if r["status"] == SUCCEEDED and r["median"] and r["predicted_time"]]
    last = [r for r in np.array_split(np.array(timed, dtype=object), 3)[2] if r["job_key"] in unlearned]
    gains = [abs(r["predicted_time"] / r["median"] - 1) - unlearned[r["job_key"]] for r in last]
    return (float(np.median(gains)) if gains else float("nan")), sum(g < 0 for g in gains), len(gains)


def print_sweep(name: str, rows: list[dict]) -> np.ndarray:
    errors = time_errors(rows)
    first, second, last = thirds(errors)
    statuses = {s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}}
    print(f"{name}: {len(errors)} measured ({statuses}); median time error by thirds "
          f"{first:.1%} / {second:.1%} / {last:.1%}; last / first {last / first:.2f}; all {np.median(errors):.1%}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="Keep the DBs and profile caches here (default: a temp folder).")
    parser.add_argument("--seed", type=int, default=49, help="Seed of the jobs' shuffled order.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds before a job is killed.")
    parser.add_argument("--jobs", type=int, help="Run only the first N jobs of each sweep (a smoke run).")
    parser.add_argument("--base", choices=("measured", "builtin"), default="measured",
                        help="The profile learning starts from (default: %(default)s).")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="codesign-bench-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("CODESIGN_PROFILE", "CODESIGN_LEARNING"):  # the cache is used, learning as each sweep says
        os.environ.pop(name, None)
    learned, unlearned = out / "cache-learning", out / "cache-none"
    began, load = time.monotonic(), os.getloadavg()[0]
    if args.base == "measured":
        measured_base([learned, unlearned])
    with_rows, without_rows = paired(FIRST, [(out / "learning.db", learned, True),
                                             (out / "no-learning.db", unlearned, False)], args.seed, args.timeout, args.jobs)
    (other_rows,) = paired(OTHER, [(out / "other.db", learned, True)], args.seed, args.timeout, args.jobs)
    print(f"bench_learning: base profile {args.base}; {time.monotonic() - began:.0f} s wall, load {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; DBs and caches in {out}")
    errors = print_sweep("with learning   ", with_rows)
    print_sweep("without learning", without_rows)
    print(f"run-to-run difference of the measured medians, the two runs of the same jobs: "
          f"{run_to_run(with_rows, without_rows):.1%} (median)")
    gain, fewer, n = closer(with_rows, without_rows)
    print(f"last third, job for job: learning's error minus the same job's without, median {gain:+.1%}; "
          f"learning closer in {fewer} of {n}")
    other = print_sweep("second sweep (other models, learning cache)", other_rows)
    print(f"second sweep's first third against the first sweep's last: "
          f"{thirds(other)[0] / thirds(errors)[2]:.2f}x (goal <= 1.2); its first five attempts: "
          + ", ".join(f"{e:.1%}" for e in other[:5]))
    for name, rows in (("with learning", with_rows), ("without learning", without_rows), ("second sweep", other_rows)):
        rhos = rank_correlations(rows)
        mean = f"{np.mean(list(rhos.values())):.2f}" if rhos else "n/a (no group of 3 attempts)"
        print(f"rank correlation per (model, cluster), {name}: mean {mean}; "
              + "; ".join(f"{k}: {v:.2f}" for k, v in rhos.items()))
    for name, rows in (("learning (both sweeps)", with_rows + other_rows), ("without learning", without_rows)):
        under, over, n = memory_figures(rows)
        print(f"memory, {name}: {under:.1%} of {n} predicted peaks below the measured by > {UNDER:.0%}; "
              f"median over-prediction {over:.1%}")
    for version in calibration_versions(ProfileCache(learned), this_machine("cpu", Hosts.local(0))):
        print(version.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
