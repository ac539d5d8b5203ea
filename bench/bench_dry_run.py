"""`codesign --dry-run` on a config of many jobs: enumeration, keys, plan checks and the table.

Goal (issue 9): 100,000 jobs in under 10 s on 2 cores. The command runs as a user runs it, in a
fresh interpreter, so imports count too. Prints figures; asserts nothing.

    python bench/bench_dry_run.py                 # 100,000 jobs
    python bench/bench_dry_run.py --jobs 2000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MICRO_BATCHES = list(range(1, 11))
PLANS = [(pp, dp, 8 // (pp * dp)) for pp in (1, 2, 4, 8) for dp in (1, 2, 4, 8) if 8 % (pp * dp) == 0]


def config_text(jobs: int) -> str:
    """One 8-device CPU cluster; models x 100 parallel specs x 10 micro-batch values."""
    parts = ["[training_spec]\navg_batch_size_per_device = 8\nnum_iters = 3\n",
             '[[cluster_spec]]\nnum_hosts = 1\nnum_devices_per_host = 8\ntransport = "NVLink"\nplatform = "cpu"\n']
    for i in range(max(1, jobs // (100 * len(MICRO_BATCHES)))):
        parts.append(f"[[model]]\nnum_features = {16 + i}\nemb_dim = 8\noutput_per_emb = 2\n"
                     f'num_zhen_layers = 4\ntokens = ["DOT", "LINEAR"]\n')
    for i in range(100):
        pp, dp, op = PLANS[i % len(PLANS)]
        parts.append(f'[[parallel_spec]]\ndescription = "plan {i}"\nnum_micro_batches = {MICRO_BATCHES}\n'
                     f'num_auto_layers = {max(pp, 1 + i % 4) if 4 % pp == 0 else pp}\n'
                     f'"(pp, dp, op)" = [{pp}, {dp}, {op}]\nremat_layer = {str(i % 2 == 0).lower()}\n')
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="Jobs in the generated config.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "many.toml"
        config.write_text(config_text(args.jobs))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "codesign", "--dry-run", "-c", str(config),
                               "-d", str(Path(tmp) / "none.db")], capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"dry run failed ({proc.returncode}): {proc.stderr.strip()}")
    counts = proc.stdout.strip().splitlines()[-1]
    print(f"dry run: {counts}")
    print(f"{'jobs':>10}{'seconds':>10}{'jobs/s':>12}")
    listed = int(counts.split()[0])
    print(f"{listed:>10,}{seconds:>10.2f}{listed / seconds:>12,.0f}")


if __name__ == "__main__":
    main()
