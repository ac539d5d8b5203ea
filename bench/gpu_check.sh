#!/usr/bin/env bash
# The one prepared GPU check (device tool), 8-10 minutes, each part under its own timeout, the
# most important first so that a cut-short run still shows them:
#  0. `codesign profile`: its wall time (target <= 60 s), matmul rates per precision, HBM bandwidth;
#     kept in the profile cache, so parts 2 and 3 are priced by this measured profile;
#  1. the step bench on the seed model, batch 1024, bf16 then fp32: project, project-serial (the
#     encoders one after another) and project-flat (flat parameters and Adam state), both bf16
#     only, and the plain reference; compile times; HLO op counts;
#  2. bench/gpu_cost.toml (the seed model and a second model of other widths and mixers, one GPU)
#     through the real CLI at bf16 and fp32, batch 1024 and 4096, into one fresh DB;
#  3. the cost model's error on those results (bench/bench_cost_model.py; target: median <= 10%);
#  4. the kernel table of the bf16 batch-1024 step from a jax.profiler trace, and its second
#     compile from the persistent cache;
#  5. the project step with XLA's Triton GEMMs off (cuBLAS only): compile time and step, bf16;
#  6. the step bench at batch 4096: project and reference, bf16 then fp32.
# Runs with scripts/python.sh (the machine's own JAX where there is no .venv). What comes back:
# $OUT/gpu_check.log (everything printed) and $OUT/gpu_check.tgz (every part's files: profile, DB,
# CSV, kernel trace), rewritten after each part, so a run cut short still returns what it made.
# XDG_CACHE_HOME is a fresh directory: an empty profile cache. Run from the repository root.
# Reduced CPU form (a few minutes on a laptop, no GPU): GPU_CHECK_SMOKE=1 bench/gpu_check.sh
set -uo pipefail
out=${OUT:-gpu_check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
py=scripts/python.sh
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$work/cache"
exec > >(tee "$out/gpu_check.log") 2>&1
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  model=(--model small --steps 1) b1=8 b2=16 platform=cpu batches="8" precisions="fp32"
  t_profile=300 t_bench=600 t_cli=900 t_cost=120 t_kernels=300 t_triton=300 t_large=600
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  model=(--model seed --steps 20) b1=1024 b2=4096 platform=gpu batches="1024 4096" precisions="bf16 fp32"
  t_profile=75 t_bench=110 t_cli=190 t_cost=20 t_kernels=70 t_triton=35 t_large=80
fi
"$py" -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

keep() {  # the files made so far, back in one archive (the JAX caches stay behind)
  tar czf "$out/gpu_check.tgz.part" -C "$work" --exclude=jax --exclude=jax_cache --exclude="*.xplane.pb" . && mv "$out/gpu_check.tgz.part" "$out/gpu_check.tgz"
}

echo "## 0. codesign profile"
start=$(date +%s%N)
timeout $t_profile "$py" -m codesign profile --platform $platform > "$work/profile.json" 2> "$work/profile.txt"
echo "codesign profile: exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "matmul|bandwidth|memory|all-reduce|all-gather|reduce-scatter|took|failed|timed out" "$work/profile.txt"
keep

echo "## 1. step bench, batch $b1"
timeout $t_bench "$py" bench/bench_step.py "${model[@]}" --batch $b1 --precision bf16 --rows project project-serial project-flat reference --hlo
timeout $t_bench "$py" bench/bench_step.py "${model[@]}" --batch $b1 --precision fp32 --rows project reference --hlo

echo "## 2. bench/gpu_cost.toml through the CLI: precisions $precisions, batches $batches"
deadline=$(( $(date +%s) + t_cli ))
for precision in $precisions; do
  for batch in $batches; do
    config="$work/gpu_cost_${precision}_${batch}.toml"
    sed -e "s/^precision = .*/precision = \"$precision\"/" -e "s/^avg_batch_size_per_device = .*/avg_batch_size_per_device = $batch/" \
        -e "s/^platform = .*/platform = \"$platform\"/" bench/gpu_cost.toml > "$config"
    left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 5 ] || { echo "part 2 out of time before $precision $batch"; break 2; }
    timeout $left "$py" -m codesign -c "$config" -d "$work/gpu.db" --manual-job-timeout 90 2>&1 | tail -n 4
  done
done
"$py" -m codesign export all -d "$work/gpu.db" -o "$work/gpu_results.csv"
"$py" - "$work/gpu_results.csv" <<'PY'
import sys, pandas as pd
frame = pd.read_csv(sys.argv[1])
print(frame[["status", "token_mixer", "precision", "input_batch_size", "median", "predicted_time", "throughput",
             "max_memory", "predicted_memory", "compile_time", "profile_id"]].to_string(index=False))
PY
keep

echo "## 3. cost model error"
timeout $t_cost "$py" bench/bench_cost_model.py -d "$work/gpu.db" -v
keep

echo "## 4. kernel table (jax.profiler trace) and second compile from the persistent cache, bf16 batch $b1"
timeout $t_kernels "$py" bench/bench_step.py "${model[@]}" --batch $b1 --precision bf16 --rows project \
  --trace "$work/trace" --recompile
keep

echo "## 5. project step with Triton GEMMs off (cuBLAS only), bf16 batch $b1"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" timeout $t_triton "$py" bench/bench_step.py \
  "${model[@]}" --batch $b1 --precision bf16 --rows project --hlo

echo "## 6. step bench, batch $b2"
timeout $t_large "$py" bench/bench_step.py "${model[@]}" --batch $b2 --precision bf16 fp32 --rows project reference
keep
