"""SIGKILL the orchestrator at random moments, rerun it until done, count what went wrong.

Each trial starts `python -m codesign` (real ZHEN jobs on virtual CPU devices: killed while JAX
imports, compiles, steps or the DB is written) or the same command line with fake jobs
(`tests.fault_cli`: fast, many moments per second of run), on a fresh DB, kills it, looks for
any process of its jobs still alive after 5 s, reruns it plainly until it exits 0, and checks
the DB: one succeeded attempt per job, no duplicate success, integrity_check ok. Then a job is
SIGSTOPped a few times and the time past its timeout until it is killed and recorded is taken.

    python bench/bench_faults.py                       # 20 trials, 6 of them with real ZHEN jobs
    python bench/bench_faults.py --trials 40 --real 10 --seed 1
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fault_trials

from tests.fault_trials import kill_trial, stopped_job_overshoot  # noqa: E402

KILL_WINDOW = {False: (0.2, 4.0), True: (0.5, 14.0)}  # seconds after the start: fake, real jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="kill -9 trials in all")
    parser.add_argument("--real", type=int, default=6, help="how many of them run real ZHEN jobs")
    parser.add_argument("--stops", type=int, default=3, help="SIGSTOPped-job trials")
    parser.add_argument("--timeout", type=float, default=2.0, help="job timeout of the SIGSTOP trials (s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = [True] * args.real + [False] * (args.trials - args.real)
    rng.shuffle(kinds)
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        print(f"{'trial':>5} {'jobs':>7} {'killed at s':>12} {'reruns':>7} {'lost':>5} {'dupes':>6} "
              f"{'orphans':>8} {'integrity':>10} {'interrupted':>12}")
        results = []
        for i, real in enumerate(kinds):
            result = kill_trial(Path(tmp) / f"trial{i}", real, rng.uniform(*KILL_WINDOW[real]))
            results.append(result)
            print(f"{i:>5} {('zhen ' if real else 'fake ') + str(result.jobs):>7} {result.killed_at:>12.2f} "
                  f"{result.reruns:>7} {result.lost:>5} {result.duplicates:>6} {result.orphans:>8} "
                  f"{result.integrity:>10} {result.interrupted:>12}", flush=True)
        stops = [stopped_job_overshoot(Path(tmp) / f"stop{i}", args.timeout) for i in range(args.stops)]
    print(f"\ntrials: {len(results)} ({args.real} with real ZHEN jobs), jobs: {sum(r.jobs for r in results)}")
    print(f"kills that interrupted a running job: {sum(r.interrupted > 0 for r in results)}")
    print(f"jobs lost: {sum(r.lost for r in results)}")
    print(f"duplicate successes: {sum(r.duplicates for r in results)}")
    print(f"orphan processes: {sum(r.orphans for r in results)}")
    print(f"attempts left running: {sum(r.running_left for r in results)}")
    print(f"integrity_check not ok: {sum(r.integrity != 'ok' for r in results)}")
    print(f"worst timeout overshoot of a SIGSTOPped job: {max(s for s, _ in stops):.2f} s "
          f"(timeout {args.timeout:g} s, {args.stops} trials, stopped job gone: {all(g for _, g in stops)})")


if __name__ == "__main__":
    main()
