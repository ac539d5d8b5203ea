"""How far the cost model's predictions are from what attempts measured.

For every succeeded attempt with a prediction: |predicted_time - median| / median and
|predicted_memory - max_memory| / max_memory, summarised (median and p90) over all attempts,
by platform and by plan kind. With --repredict, the predictions are recomputed by the current
cost model from each attempt's plan and the profiles at hand (built-in, this machine's cached
ones; --profile FILE: a profile JSON, as `codesign profile` prints it, for its device kind), to
try a model or profile change on measurements already made. --builtin re-prices each attempt by
the built-in profile of the device kind it ran on, measured ones ignored: how a machine of that
kind is priced before it is profiled (bench/gpu_check.sh prints both on every GPU run).

    python bench/bench_cost_model.py -d cost_cpu.db [--repredict [--profile cpu.json]] [--builtin]

With --noise DB2 (the same jobs run again into another DB), it also prints how far the two
runs' medians are apart, |median2 - median| / median, by plan kind: the measurement noise the
prediction errors are to be read against.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from codesign.outcome import SUCCEEDED
from codesign.hardware.profiles import DeviceProfile, ProfileBook, builtin_kind
from codesign.run.profile_cache import profiles_for
from codesign.run.reprice import prediction
from codesign.config.hosts import Hosts
from codesign.store.database import Store


def plan_kind(row: dict) -> str:
    """"dp", "op", "dp x op", "pp GPipe"... with remat, ZeRO-2 and batch-on-op marked; an Auto
    search attempt by the plan it ran (uneven stages by their largest dp and op), marked "auto"."""
    pp, dp, op = (max(v) if isinstance(v, list) else v for v in json.loads(row["pp_dp_op"]))
    configs = json.loads(row["all_configs"])
    chosen, options = configs.get("chosen_plan"), dict(configs["parallel"]["auto_sharding_option"])
    if chosen:
        schedule, zero, on_op = chosen["schedule"], chosen["reduce_scatter"], chosen["batch_axis"] == "op"
    else:
        schedule, zero = configs["parallel"]["pipeline_schedule"], options.get("prefer_reduce_scatter")
        on_op = options.get("force_batch_dim_to_mesh_dim", 0) == 1
    if pp > 1:
        kind = f"pp {schedule}" + (" x dp" if dp > 1 else "") + (" x op" if op > 1 else "")
    else:
        kind = " x ".join([a for a, n in (("dp", dp), ("op", op)) if n > 1]) or "single"
    marks = ["remat"] * bool(row["remat_layer"]) + ["zero2"] * bool(zero) + ["batch@op"] * on_op
    return " ".join([kind, *marks, *["auto"] * bool(chosen)])


def repredict(store: Store, rows: list[dict], profile: str | None = None) -> list[dict]:
    """The rows with predicted_time and predicted_memory from the current cost model."""
    book = profiles_for(Hosts.local(0), store).book
    if profile:
        measured = DeviceProfile.from_dict(json.loads(Path(profile).read_text()))
        book.add(measured)
        book.local[measured.platform] = measured.kind
    return [{**r, **prediction(r, book)[0]} for r in rows]


def builtin_prices(rows: list[dict]) -> list[dict]:
    """The rows priced by the current cost model, each by the built-in profile of its attempt's device kind."""
    return [{**r, **prediction(r, builtin_book(r))[0]} for r in rows]


def builtin_book(row: dict) -> ProfileBook:
    """The built-in profiles alone, the attempt's platform on the one of the kind it ran on."""
    book = ProfileBook()
    kind = builtin_kind(row["device_kind"] or "")
    if kind is not None:
        book.local[row["platform"]] = kind
    return book


def succeeded(db: str) -> list[dict]:
    store = Store(db, read_only=True)
    try:
        return store.attempts((SUCCEEDED,))
    finally:
        store.close()


def noise(db: str, again: str) -> list[dict]:
    """One dict per job that succeeded in both DBs: its kind and |median2 - median| / median as "time"."""
    first = {r["job_key"]: r for r in succeeded(db)}
    return [{"platform": r["platform"], "kind": plan_kind(r), "memory": 0.0,
             "time": abs(r["median"] - first[r["job_key"]]["median"]) / first[r["job_key"]]["median"]}
            for r in succeeded(again) if r["job_key"] in first]


def errors(db: str, fresh: bool = False, profile: str | None = None, builtin: bool = False) -> list[dict]:
    """One dict per succeeded attempt with a prediction: platform, kind, time and memory errors."""
    store = Store(db, read_only=True)
    try:
        rows = store.attempts((SUCCEEDED,))
        if builtin:
            rows = builtin_prices(rows)
        elif fresh:
            rows = repredict(store, rows, profile)
        rows = [r for r in rows if r.get("predicted_time") is not None]
    finally:
        store.close()
    return [{"platform": r["platform"], "kind": plan_kind(r),
             "time": abs(r["predicted_time"] - r["median"]) / r["median"],
             "memory": abs(r["predicted_memory"] - r["max_memory"]) / r["max_memory"]} for r in rows]


def summary(found: list[dict]) -> dict[str, float]:
    t, m = np.array([e["time"] for e in found]), np.array([e["memory"] for e in found])
    return {"n": len(found), "time_median": float(np.median(t)), "time_p90": float(np.percentile(t, 90)),
            "memory_median": float(np.median(m)), "memory_p90": float(np.percentile(m, 90))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-d", "--db", default="results.db")
    parser.add_argument("--repredict", action="store_true", help="Predict again with the current cost model.")
    priced_by = parser.add_mutually_exclusive_group()
    priced_by.add_argument("--profile", metavar="FILE", help="With --repredict: price with this profile JSON.")
    priced_by.add_argument("--builtin", action="store_true",
                           help="Re-price each attempt by the built-in profile of its device kind.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Also print every attempt's errors.")
    parser.add_argument("--noise", metavar="DB2", help="The same jobs run again: print the run-to-run differences.")
    args = parser.parse_args()
    found = errors(args.db, args.repredict, args.profile, args.builtin)
    if args.verbose:
        for e in found:
            print(f"{e['kind']:30} time {e['time']:7.1%}  memory {e['memory']:7.1%}")
    if not found:
        print(f"{args.db}: no succeeded attempt with a prediction", file=sys.stderr)
        return 1
    print_table(found)
    if args.noise:
        print(f"\nrun-to-run difference of the step time, {args.db} against {args.noise}:")
        print_table(noise(args.db, args.noise))
    return 0


def print_table(found: list[dict]) -> None:
    groups: dict[str, list[dict]] = defaultdict(list)
    for e in found:
        groups["all"].append(e)
        groups[f"platform {e['platform']}"].append(e)
        groups[f"  {e['platform']}: {e['kind']}"].append(e)
    print(f"{'group':40} {'n':>4} {'time med':>9} {'time p90':>9} {'mem med':>9} {'mem p90':>9}")
    for name in sorted(groups, key=lambda g: (g != "all", g.strip().split(":")[0], g)):
        s = summary(groups[name])
        print(f"{name:40} {s['n']:>4} {s['time_median']:>9.1%} {s['time_p90']:>9.1%} "
              f"{s['memory_median']:>9.1%} {s['memory_p90']:>9.1%}")


if __name__ == "__main__":
    sys.exit(main())
