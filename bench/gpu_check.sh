#!/usr/bin/env bash
# The one prepared GPU check (device tool): the step bench on the seed model, then
# codesign/models/zhen_gpu.toml through the real CLI (which profiles the GPU first for the cost
# model), then the cost model's errors on those attempts. Uses the machine's own JAX; writes
# the DB and CSV under $OUT (or ./gpu_check). Run from the repository root.
set -euo pipefail
out=${OUT:-gpu_check}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 bench/bench_step.py --model seed --steps 20 2>&1 | tee "$out/bench_step.txt"
python3 -m codesign -v -c codesign/models/zhen_gpu.toml -d "$out/gpu.db" 2>&1 | tail -n 30 | tee "$out/cli.txt"
python3 -m codesign.store.export all -d "$out/gpu.db" -o "$out/gpu_results.csv"
python3 - "$out/gpu_results.csv" <<'PY'
import sys, pandas as pd
frame = pd.read_csv(sys.argv[1])
print(frame[["status", "description", "num_micro_batches", "precision", "median", "predicted_time",
             "throughput", "max_memory", "predicted_memory", "compiled_memory", "compile_time",
             "energy_per_iter"]].to_string(index=False))
PY
python3 bench/bench_cost_model.py -d "$out/gpu.db" -v 2>&1 | tee "$out/cost_model.txt"
