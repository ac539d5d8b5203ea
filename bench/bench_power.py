"""Measured energy against the cost model's, on a GPU (bench/gpu_check.sh part 9).

    python bench/bench_power.py -d gpu.db              # each succeeded attempt: J/iter measured / predicted
    python bench/bench_power.py -d gpu.db --limits     # the first job again at 3 power limits

The first table reads the attempts a sweep recorded (energy_per_iter, predicted_energy, the
counter or why there is none). --limits runs the DB's first succeeded job (its measured window
stretched to --seconds, so the energy counter sees enough of it) under the device's default
power limit and lower ones, through the local executor, whose guard sets and restores them;
it prints measured time and energy against the prediction recorded at the default limit. Where
the limit cannot be set (no NVML, not root) it says why and stops: exit 0, nothing is changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from codesign.config.types import Job
from codesign.outcome import SUCCEEDED
from codesign.run.local import LocalExecutor
from codesign.store.database import Store

STEPS = (1.0, 0.8, 0.6)  # fractions of the default limit (the guard clamps to the device's range)


def ratio(measured: float | None, predicted: float | None) -> str:
    return f"{measured / predicted:.3f}" if measured and predicted else "-"


def energy_table(rows: list[dict]) -> None:
    print(f"{'job':>44} {'J/iter':>9} {'pred J':>9} {'ratio':>6} {'W/dev':>7}  source or reason")
    for row in rows:
        reading = json.loads(row["all_configs"] or "{}").get("energy") or {}
        name = f"{row['token_mixer'][:24]} {row['precision']} b{row['input_batch_size']}"
        print(f"{name:>44} {row['energy_per_iter'] or 0:9.3f} {row['predicted_energy'] or 0:9.3f} "
              f"{ratio(row['energy_per_iter'], row['predicted_energy']):>6} {row['avg_power'] or 0:7.1f}  "
              f"{row['energy_source'] or reading.get('reason') or 'no reading recorded'}")


def default_watts() -> float | None:
    """GPU 0's default power limit, or None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000.0
    except Exception as err:
        print(f"power limits: NVML cannot say the default limit ({err}); not run")
        return None


def run_at(job: Job, watts: float, timeout: float) -> dict:
    executor = LocalExecutor(cache_dir=os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    try:
        run = executor.start(job, timeout, power_limits={d: watts for d in range(job.cluster.num_devices)})
        ((_, outcome),) = executor.wait([run], timeout + 30)
    finally:
        executor.close()
    return {"status": outcome.status, "error": outcome.error[-300:], **outcome.metrics}


def limits_table(row: dict, seconds: float, timeout: float) -> None:
    default = default_watts()
    if default is None:
        return
    job = Job.from_dict(json.loads(row["all_configs"]))
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, min_measured_seconds=seconds))
    print(f"power limits on {row['token_mixer']} {row['precision']} b{row['input_batch_size']}; predicted at the "
          f"default limit: {row['predicted_time'] or 0:.5f} s, {row['predicted_energy'] or 0:.3f} J per iteration")
    print(f"{'limit W':>8} {'median s':>9} {'t ratio':>8} {'J/iter':>9} {'J ratio':>8} {'W/dev':>7}  applied")
    for fraction in STEPS:
        found = run_at(job, default * fraction, timeout)
        power = found.get("power") or {}
        if found["status"] != SUCCEEDED:
            print(f"{default * fraction:8.0f} {found['status']}: {found['error']}")
            continue
        print(f"{default * fraction:8.0f} {found['median']:9.5f} {ratio(found['median'], row['predicted_time']):>8} "
              f"{found['energy_per_iter'] or 0:9.3f} {ratio(found['energy_per_iter'], row['predicted_energy']):>8} "
              f"{found['avg_power'] or 0:7.1f}  {power.get('applied')} {power.get('reason') or ''}")
        if not power.get("applied"):
            print("power limits cannot be set here: the other limits are not run")
            return


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-d", "--db", required=True)
    parser.add_argument("--limits", action="store_true", help="run the first succeeded job at 3 power limits")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per limit run")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per limit run")
    args = parser.parse_args(argv)
    if not os.path.exists(args.db):
        print(f"{args.db}: no such DB (part 3 makes it)")
        return 0
    rows = Store(args.db, read_only=True).attempts([SUCCEEDED])
    if not rows:
        print(f"{args.db}: no succeeded attempt")
        return 0
    energy_table(rows)
    if args.limits:
        limits_table(rows[0], args.seconds, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
