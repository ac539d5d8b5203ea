#!/usr/bin/env bash
# The one prepared GPU check (device tool), about 6 minutes, each part under its own timeout:
#  1. the step bench on the seed model: project, project with fold_dot, plain reference;
#     fp32 and bf16, batch 1024 and 4096; compile times; optimized-HLO op counts;
#  2. A/B of XLA flags on the bf16 batch-1024 step (command buffers: fewer launch gaps);
#  3. codesign/models/zhen_gpu.toml through the real CLI, its results;
#  4. the cost model's error on those results (bench/bench_cost_model.py).
#  Part 3 profiles the GPU first (the sweep does, for the cost model).
# Runs with scripts/python.sh (the machine's own JAX where there is no .venv); writes under $OUT
# (or ./gpu_check). Run from the repository root.
# Reduced CPU form (a few minutes on a laptop, no GPU): GPU_CHECK_SMOKE=1 bench/gpu_check.sh
set -uo pipefail
out=${OUT:-gpu_check}
mkdir -p "$out"
py=scripts/python.sh
export PYTHONUNBUFFERED=1
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  bench=(--model small --batch 8 --steps 1 --precision fp32)
  ab=(--model small --batch 8 --steps 1 --precision fp32)
  config=tests/data/results_v0.1.0.toml
  t_bench=900 t_ab=600 t_cli=600 t_cost=120
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  bench=(--model seed --batch 1024 4096 --precision bf16 fp32 --steps 20 --fold --hlo)
  ab=(--model seed --batch 1024 --steps 10 --precision bf16)
  config=codesign/models/zhen_gpu.toml
  t_bench=160 t_ab=40 t_cli=90 t_cost=20
fi

echo "## 1. step bench"
timeout $t_bench "$py" bench/bench_step.py "${bench[@]}" 2>&1 | tee "$out/bench_step.txt"

echo "## 2. XLA flags A/B (bf16, batch 1024; the baseline is the first row of part 1)"
for flags in "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
             "--xla_gpu_enable_command_buffer="; do
  echo "# XLA_FLAGS=$flags"
  XLA_FLAGS="$flags" timeout $t_ab "$py" bench/bench_step.py "${ab[@]}" 2>&1 | tee -a "$out/xla_flags.txt"
done

echo "## 3. $config through the CLI"
timeout $t_cli "$py" -m codesign -v -c "$config" -d "$out/gpu.db" 2>&1 | tail -n 30 | tee "$out/cli.txt"
"$py" -m codesign.store.export all -d "$out/gpu.db" -o "$out/gpu_results.csv"
"$py" - "$out/gpu_results.csv" <<'PY'
import sys, pandas as pd
frame = pd.read_csv(sys.argv[1])
print(frame[["status", "description", "num_micro_batches", "precision", "median", "predicted_time",
             "throughput", "max_memory", "predicted_memory", "compiled_memory", "compile_time",
             "energy_per_iter"]].to_string(index=False))
PY

echo "## 4. cost model error"
timeout $t_cost "$py" bench/bench_cost_model.py -d "$out/gpu.db" -v 2>&1 | tee "$out/cost_model.txt"
