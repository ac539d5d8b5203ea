#!/usr/bin/env bash
# The one prepared GPU check (device tool), 6-9 minutes, each part under its own timeout, the
# most important first so that a cut-short run still shows them:
#  0. `codesign profile`: its wall time (target <= 60 s), matmul rates per precision, HBM bandwidth;
#     kept in the profile cache, so parts 3 and 4 are priced by this measured profile;
#  1. the step bench on the seed model: project, project with fold_dot, plain reference;
#     bf16 and fp32, batch 1024 and 4096; compile times; optimized-HLO op counts;
#     1b. the kernel table of the bf16 batch-1024 step from a jax.profiler trace, and its second
#     compile from the persistent cache;
#  3. bench/gpu_cost.toml (the seed model and a second model of other widths and mixers, one GPU)
#     through the real CLI at bf16 and fp32, batch 1024 and 4096, into one fresh DB;
#  4. the cost model's error on those results (bench/bench_cost_model.py; target: median <= 10%).
# Runs with scripts/python.sh (the machine's own JAX where there is no .venv); writes under $OUT
# (or ./gpu_check), the profile cache included (XDG_CACHE_HOME=$OUT/cache: fresh every run).
# Run from the repository root.
# Reduced CPU form (a few minutes on a laptop, no GPU): GPU_CHECK_SMOKE=1 bench/gpu_check.sh
set -uo pipefail
out=${OUT:-gpu_check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=scripts/python.sh
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$out/cache"
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  bench=(--model small --batch 8 --steps 1 --precision fp32)
  platform=cpu batches="8" precisions="fp32"
  t_profile=300 t_bench=900 t_kernels=300 t_cli=900 t_cost=120
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  bench=(--model seed --batch 1024 4096 --precision bf16 fp32 --steps 20 --fold --hlo)
  platform=gpu batches="1024 4096" precisions="bf16 fp32"
  t_profile=90 t_bench=160 t_kernels=120 t_cli=150 t_cost=20
fi

echo "## 0. codesign profile"
start=$(date +%s%N)
timeout $t_profile "$py" -m codesign profile --platform $platform > "$out/profile.json" 2> "$out/profile.txt"
echo "codesign profile: exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "matmul|bandwidth|memory|all-reduce|all-gather|reduce-scatter|took|failed|timed out" "$out/profile.txt"

echo "## 1. step bench"
timeout $t_bench "$py" bench/bench_step.py "${bench[@]}" 2>&1 | tee "$out/bench_step.txt"
echo "## 1b. kernel table (jax.profiler trace, 5 steps) and second compile from the persistent cache, bf16 batch 1024"
kernels=(--model seed --batch 1024 --precision bf16 --steps 10)
[ -n "${GPU_CHECK_SMOKE:-}" ] && kernels=(--model small --batch 8 --precision bf16 --steps 2)
trace=$(mktemp -d)  # outside $OUT: its files lie too deep to come back; the project's trace JSON is copied
timeout $t_kernels "$py" bench/bench_step.py "${kernels[@]}" --trace "$trace" --recompile 2>&1 | tee "$out/kernels_bf16_1024.txt"
cp "$trace"/project_*/plugins/profile/*/*.trace.json.gz "$out/kernels_bf16_1024.trace.json.gz"

echo "## 3. bench/gpu_cost.toml through the CLI: precisions $precisions, batches $batches"
deadline=$(( $(date +%s) + t_cli ))
for precision in $precisions; do
  for batch in $batches; do
    config="$out/gpu_cost_${precision}_${batch}.toml"
    sed -e "s/^precision = .*/precision = \"$precision\"/" -e "s/^avg_batch_size_per_device = .*/avg_batch_size_per_device = $batch/" \
        -e "s/^platform = .*/platform = \"$platform\"/" bench/gpu_cost.toml > "$config"
    left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 5 ] || { echo "part 3 out of time before $precision $batch"; break 2; }
    timeout $left "$py" -m codesign -c "$config" -d "$out/gpu.db" --manual-job-timeout 90 2>&1 | tail -n 8 | tee -a "$out/cli.txt"
  done
done
"$py" -m codesign export all -d "$out/gpu.db" -o "$out/gpu_results.csv"
"$py" - "$out/gpu_results.csv" <<'PY'
import sys, pandas as pd
frame = pd.read_csv(sys.argv[1])
print(frame[["status", "token_mixer", "precision", "input_batch_size", "median", "predicted_time", "throughput",
             "max_memory", "predicted_memory", "compile_time", "profile_id", "energy_per_iter"]].to_string(index=False))
PY

echo "## 4. cost model error"
timeout $t_cost "$py" bench/bench_cost_model.py -d "$out/gpu.db" -v 2>&1 | tee "$out/cost_model.txt"
