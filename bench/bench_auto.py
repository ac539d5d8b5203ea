"""Auto search against every manual plan: measured step time per (model, cluster, micro-batches).

Runs a real sweep (the orchestrator chooses each Auto search plan, the job body runs it, the
store records it) over small ZHEN models on virtual CPU devices, with an Auto search spec beside
every manual (pp, dp, op) plan of each cluster, then prints per group Auto's median step time
over the best manual plan's, and the median and the largest ratio (targets: <= 1.10, <= 1.5).
Step times on a loaded machine are noisy: run it on a quiet one and read the load it prints.
The best of 7-10 noisy manual plans, each timed once, is biased fast against one Auto sample, so
each group's Auto plan and its best manual plan are then run again, in turn (`--confirm` rounds),
and the confirmed ratio is of their medians over those rounds alone.

    python bench/bench_auto.py                                     # mixed model, 4 and 8 devices, mb 1 2 4
    python bench/bench_auto.py --models mixed uniform              # two models (twice the jobs)
    python bench/bench_auto.py -d auto.db --confirm 0              # keep the DB: a rerun reprints it
    python bench/bench_auto.py --devices 4 --micro 2 --models mixed
    python bench/bench_auto.py --trials 1 3                        # Auto search with 1 and with 3 trials
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from codesign.run.local import LocalExecutor
from codesign.run.profile_cache import profiles_for
from codesign.run.sweep import Pricing, run_sweep
from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import PlannedJob, enumerate_jobs
from codesign.config.types import AUTO_SEARCH
from codesign.store.database import Store

MODELS = {  # name: the [[model]] table (4 layers: pp 1, 2 and 4 all divide them)
    "tiny": 'num_features = 8\nemb_dim = 4\noutput_per_emb = 2\nnum_zhen_layers = 2\ntokens = ["LINEAR", "DOT"]',
    "uniform": ('num_features = 32\nemb_dim = 16\noutput_per_emb = 8\nnum_zhen_layers = 4\n'
                'tokens = ["ATTENTION", "LINEAR"]'),
    "mixed": ('num_features = 32\nemb_dim = 16\noutput_per_emb = 8\nnum_zhen_layers = 4\n'
              'tokens = [["DOT", "ATTENTION"], ["LINEAR"], ["CONVOLUTION", "LINEAR"], ["DOT"]]'),
}


def manual_specs(devices: int, layers: int) -> list[tuple[int, int, int]]:
    """Every (pp, dp, op) of a cluster: pp divides the layers, pp * dp * op = devices."""
    return [(pp, dp, devices // pp // dp) for pp in range(1, layers + 1) if layers % pp == 0 and devices % pp == 0
            for dp in range(1, devices // pp + 1) if (devices // pp) % dp == 0]


def config_text(models: list[str], devices: list[int], micro: list[int], iters: int, batch: int,
                trials: tuple[int, ...] = (1,), min_seconds: float = 0.0) -> str:
    layers = max(int(MODELS[m].split("num_zhen_layers = ")[1].split()[0]) for m in models)
    parts = [(f"[training_spec]\navg_batch_size_per_device = {batch}\nnum_iters = {iters}\n"
              f"min_measured_seconds = {min_seconds}\n")]
    parts += [f"[[model]]\n{MODELS[m]}\n" for m in models]
    parts += [f'[[cluster_spec]]\nnum_hosts = 1\nnum_devices_per_host = {n}\ntransport = "NVLink"\nplatform = "cpu"\n'
              for n in devices]
    parts += [f'[[parallel_spec]]\ndescription = "Auto search"\nnum_micro_batches = {micro}\n'
              f'num_auto_layers = {layers}\nauto_trials = {k}\n' for k in trials]  # the manual plans' groups
    for n in devices:
        for pp, dp, op in manual_specs(n, layers):
            parts.append(f'[[parallel_spec]]\ndescription = "pp{pp} dp{dp} op{op}"\nnum_micro_batches = {micro}\n'
                         f'num_auto_layers = {layers}\n"(pp, dp, op)" = [{pp}, {dp}, {op}]\n')
    return "\n".join(parts)


def groups(rows: list[dict], trials: int) -> dict[tuple, dict[str, list[dict]]]:
    """(model, cluster, micro-batches) -> {"auto": the attempts of the Auto search spec with
    auto_trials = trials, "manual": the manual ones}."""
    out: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        parallel = json.loads(r["all_configs"])["parallel"]
        key = (f"F{r['input_features']} L{r['num_zhen_layers']} {r['token_mixer']}",
               f"{r['num_nodes']}x{r['gpus_per_node']}", r["num_micro_batches"])
        found = out.setdefault(key, {"auto": [], "manual": []})
        if parallel["description"] != AUTO_SEARCH:
            found["manual"].append(r)
        elif parallel.get("auto_trials", 1) == trials:
            found["auto"].append(r)
    return out


@dataclass(frozen=True)
class Compared:
    """A group's first pass: Auto's attempt and the fastest manual one."""

    auto: dict
    best: dict

    @property
    def ratio(self) -> float:
        return self.auto["median"] / self.best["median"]


def report(rows: list[dict], trials: int) -> dict[tuple, Compared]:
    """Print one line per group; returns the groups where both ran."""
    print(f"\nauto_trials = {trials}")
    print(f"{'model':<58}{'cluster':>8}{'mb':>4}{'auto ms':>9}{'best ms':>9}{'ratio':>7}  auto plan | best manual")
    compared = {}
    for (model, cluster, micro), found in sorted(groups(rows, trials).items()):
        auto = [r for r in found["auto"] if r["status"] == "succeeded"]
        manual = [r for r in found["manual"] if r["status"] == "succeeded"]
        if not auto or not manual:
            why = (found["auto"] or [{"status": "none", "error": ""}])[0]
            print(f"{model[:57]:<58}{cluster:>8}{micro:>4}  auto {why['status']}, {len(manual)} manual ran "
                  f"{(why['error'] or '').strip().splitlines()[-1:]}")
            continue
        pair = compared[model, cluster, micro] = Compared(auto[0], min(manual, key=lambda r: r["median"]))
        twin = [r["description"] for r in manual if r["predicted_time"] == pair.auto["predicted_time"]
                and r["pp_dp_op"] == pair.auto["pp_dp_op"]]  # priced the same: Auto chose this manual plan
        print(f"{model[:57]:<58}{cluster:>8}{micro:>4}{pair.auto['median'] * 1e3:>9.2f}{pair.best['median'] * 1e3:>9.2f}"
              f"{pair.ratio:>7.2f}  {pair.auto['pp_dp_op']} groups {pair.auto['num_auto_layers']}"
              f"{' = ' + twin[0] if twin else ''} | {pair.best['description']}")
    return compared


def confirmed(planned: list[PlannedJob], compared: dict[tuple, Compared], rounds: int,
              run: Callable[[list[PlannedJob], Path], list[dict]], dbs: Path) -> dict[tuple, float]:
    """Each group's Auto spec and best manual spec run again `rounds` times, the two in turn (a
    fresh DB each round, DBS-i.db): Auto's median step time over the manual's, those rounds alone."""
    by_key = {p.key: p for p in planned}
    jobs = [by_key[row["job_key"]] for key in sorted(compared) for row in (compared[key].auto, compared[key].best)]
    times: dict[str, list[float]] = {}
    for i in range(rounds):
        for r in run(jobs if i % 2 == 0 else jobs[::-1], dbs.with_name(f"{dbs.name}-{i}.db")):
            if r["status"] == "succeeded":
                times.setdefault(r["job_key"], []).append(r["median"])
    return {key: statistics.median(times[pair.auto["job_key"]]) / statistics.median(times[pair.best["job_key"]])
            for key, pair in compared.items() if times.get(pair.auto["job_key"]) and times.get(pair.best["job_key"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mixed"], choices=sorted(MODELS),
                        help="Models of the same depth (default: mixed; add uniform for a second one).")
    parser.add_argument("--devices", nargs="+", type=int, default=[4, 8], help="Virtual CPU devices per cluster.")
    parser.add_argument("--micro", nargs="+", type=int, default=[1, 2, 4], help="Micro-batch counts.")
    parser.add_argument("--iters", type=int, default=20,
                        help="Iterations per job (2 warm-up): a median of 4 steps differed by up to 1.7x between "
                             "two runs of the same plan.")
    parser.add_argument("--min-seconds", type=float, default=2.0,
                        help="Each job's timed steps go on until they add up to this (min_measured_seconds): 18 "
                             "steps of 10-20 ms, timed in under a second, put identical plans 1.14-1.24x apart.")
    parser.add_argument("--trials", nargs="+", type=int, default=[1],
                        help="auto_trials of the Auto search spec; several: one spec each, reported apart.")
    parser.add_argument("--batch", type=int, default=8, help="Samples per device.")
    parser.add_argument("--timeout", type=float, default=300, help="Seconds per job.")
    parser.add_argument("--confirm", type=int, default=3, metavar="ROUNDS",
                        help="Then run each group's Auto and best manual plan again this many times, in turn.")
    parser.add_argument("-d", "--db", help="Keep the results DB here (default: a temporary one).")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        path = Path(tmp) / "auto.toml"
        path.write_text(config_text(args.models, args.devices, args.micro, args.iters, args.batch, tuple(args.trials),
                                   args.min_seconds))
        config = load_config(path)
        planned = list(enumerate_jobs(config, Hosts.local(0)))
        load = os.getloadavg()[0]
        profiles = profiles_for(Hosts.local(0))

        def run(jobs: list[PlannedJob], db: Path) -> list[dict]:
            store = Store(db)
            try:
                run_sweep(jobs, store, LocalExecutor(cache_dir=None), False, args.timeout, 1,
                          Pricing(profiles, config.links))
                return store.attempts()
            finally:
                store.close()

        rows = run(planned, Path(args.db) if args.db else Path(tmp) / "results.db")
        print(f"{len(planned)} jobs on {os.cpu_count()} cores, load average {load:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after; cost model profile: {profiles.book.for_job(planned[0].job).source}")
        for trials in args.trials:
            compared = report(rows, trials)
            if not compared:
                continue
            ratios = [pair.ratio for pair in compared.values()]
            print(f"auto_trials = {trials}: Auto / best manual over {len(ratios)} groups: median "
                  f"{statistics.median(ratios):.2f} (target <= 1.10), max {max(ratios):.2f} (target <= 1.5)")
            again = confirmed(planned, compared, args.confirm, run, Path(tmp) / f"confirm-trials{trials}")
            for key, ratio in sorted(again.items()):
                print(f"  confirmed {key[1]} mb {key[2]}: {ratio:.2f} (first run {compared[key].ratio:.2f}, "
                      f"against {compared[key].best['description']})")
            if again:
                print(f"auto_trials = {trials}: confirmed over {args.confirm} rounds, {len(again)} groups: median "
                      f"{statistics.median(again.values()):.2f} (target <= 1.10), max {max(again.values()):.2f} "
                      f"(target <= 1.5)")
    searches = [json.loads(r["all_configs"])["auto_search"]["search_seconds"] for r in rows
                if "auto_search" in (r["all_configs"] or "")]
    print(f"search time max {max(searches):.3f} s")


if __name__ == "__main__":
    main()
