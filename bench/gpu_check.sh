#!/usr/bin/env bash
# The one prepared GPU check (device tool), at most 6 minutes (parts 1-4: about 5), each part under its own timeout,
# the most important first so that a cut-short run still shows them:
#  1. the step bench on the seed model, batch 1024: project bf16 with its kernel table (a
#     jax.profiler trace) and its second compile from the persistent cache, then project fp32;
#     compile times (cold: the first compiles into an empty cache) and optimized-HLO op counts;
#  2. `codesign profile`: its wall time (90-104 s on an H200; target 60), matmul rates per precision, HBM
#     bandwidth, each mixer program's compile and how busy the cores were while they compiled, the
#     measured power model (watts idle, compute- and memory-bound); kept in the profile cache, so part 3 is priced by it;
#  3. bench/gpu_cost.toml (the seed model and a second model of other widths and mixers, one GPU)
#     through the real CLI at bf16 and fp32, batch 1024 and 4096, into one fresh DB;
#  4. the cost model's error on those results (bench/bench_cost_model.py; target: median <= 10%), and the
#     built-in profile's of this device kind on the same (the H200's is a measured one; the H100's its data sheet's);
# 11. (after part 4) the GEMMs the seed model's mixers run, timed on the GPU beside `codesign hardware gemm`
#     for its kind (bench/bench_gemms.py: the measured table's prediction against this device, bf16 and fp32);
# 10. (after part 4) the cost model learns (issue 49): bench/gpu_cost.toml again into a second DB, on the
#     same profile cache, so priced by the calibration part 3's attempts refitted (the versions are printed):
#     part 4's error on the second DB (target: median <= 5%);
# 12. (after part 11) transformers: bench/gpu_transformer.toml (GPT-3 small, one GPU, bf16) through the CLI
#     into its own DB, then the cost model's error on it (bench/bench_cost_model.py), priced by part 2's profile;
#  9. (after part 10) energy: part 3's joules per iteration against predicted_energy, per job (target: within 15%),
#     then, where NVML lets this user set the power limit, part 3's first job at three limits (default, 80%, 60%):
#     measured time and energy against predicted (bench/bench_power.py; without permission it says why, exit 0);
#  5. the step bench at batch 1024, bf16 then fp32: the plain reference (project/reference);
#  6. the step bench at batch 4096, bf16 then fp32: the reference (the project's step at 4096 is
#     part 3's seed job; `--rows project-leaves` is the per-leaf step: 12.40 ms against the flat 10.95 on H100s);
#  7. (only when named: GPU_CHECK_PARTS="7") the bf16 step's compile in two fresh processes with empty JAX caches sharing one XLA autotune cache
#     (--xla_gpu_per_fusion_autotune_cache_dir): the second's time is what a sweep's later jobs of
#     the same shapes would pay (on an H100 a second row in one process compiled in 8.5 s against 16.6).
#  8. (only when named: GPU_CHECK_PARTS="8") the bf16 step at batch b1 under each XLA flag set of
#     GPU_CHECK_XLA (sets separated by ";"), each in a fresh process and JAX cache: a cold compile,
#     a step time beside part 1's and a kernel table, e.g. GPU_CHECK_XLA="--xla_gpu_enable_triton_gemm=false";
#     then, where two or more changes beat part 1's bf16 step (flag sets, and part 1's project-whole-leaf row),
#     all of them together (bench/flag_winners.py), so one lease finds the combination to make the default.
# The whole check ends within GPU_CHECK_SECONDS (360 s) of its start: each part's timeout is cut to the time
# left, and a part with less than 15 s left is skipped.
# GPU_CHECK_PARTS="1 2 3 4" runs those parts alone (default: 1-6, 11, 12, 10 and 9), for a device lease too short for all;
# GPU_CHECK_ROWS="project-bias-add reference" adds bench_step rows to part 1 (a before/after in one run;
# project-one-vector: no leaf kept whole beside the flat vector, EngineOptions.whole_leaf; project-whole-leaf: the
# fp32 step's large leaves whole in bf16 too, so Adam updates the DOT kernel in a kernel of its own, traced too);
# CODESIGN_PROFILE_PAIR=0 has part 2 time ATTENTION's later width as one encoder, not as the encoder pair
# the engine runs (the default), and parts 3-4 price by it.
# Every part compiles through one persistent cache (JAX_COMPILATION_CACHE_DIR, empty at the start):
# part 1's first compiles are cold; the profile and the CLI's jobs share it, as a sweep's do.
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
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$work/cache" JAX_COMPILATION_CACHE_DIR="$work/jax"
exec > >(tee "$out/gpu_check.log") 2>&1
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  model=(--model tiny --steps 1) b1=8 b2=16 platform=cpu batches="8" precisions="fp32"
  export CODESIGN_PROFILE_LOOPS=small  # the profile's GPU path (loop-timed sections), at small sizes
  t_bench=300 t_profile=300 t_cli=900 t_cost=120 t_gemm=120 t_large=600 t_power=600 seconds=${GPU_CHECK_SECONDS:-3600}
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  model=(--model seed --steps 20) b1=1024 b2=4096 platform=gpu batches="1024 4096" precisions="bf16 fp32"
  t_bench=70 t_profile=150 t_cli=240 t_cost=20 t_gemm=40 t_large=100 t_power=90 seconds=${GPU_CHECK_SECONDS:-360}
fi
end=$(( $(date +%s) + seconds ))
within() { local left=$(( end - $(date +%s) )); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }  # a timeout, cut to the time left
"$py" -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

keep() {  # the files made so far, back in one archive (the JAX caches stay behind)
  tar czf "$out/gpu_check.tgz.part" -C "$work" --exclude=jax --exclude=jax_cache --exclude="jax_*" --exclude=autotune --exclude="*.xplane.pb" . && mv "$out/gpu_check.tgz.part" "$out/gpu_check.tgz"
}
bench_step() { timeout $(within $t_bench) "$py" bench/bench_step.py "${model[@]}" --cache "$JAX_COMPILATION_CACHE_DIR" "$@"; }

part() {  # a part named in GPU_CHECK_PARTS, with 15 s or more of the check's time left
  [[ " ${GPU_CHECK_PARTS:-1 2 3 4 11 12 10 9 5 6} " == *" ${1%.} "* ]] || return 1
  if (( end - $(date +%s) < 15 )); then echo "## $* skipped: the check's $seconds s are spent"; return 1; fi
  echo "## $*"
}

if part 1. step bench, batch $b1; then
rows=(project ${GPU_CHECK_ROWS:-})
t_bench=$(( t_bench * ${#rows[@]} )) bench_step --batch $b1 --precision bf16 --rows "${rows[@]}" --hlo --trace "$work/trace" --recompile \
  | tee "$work/step_bf16.txt"
t_bench=$(( t_bench * ${#rows[@]} )) bench_step --batch $b1 --precision fp32 --rows "${rows[@]}" --hlo
keep
fi

if part 2. codesign profile; then
start=$(date +%s%N)
timeout $(within $t_profile) "$py" -m codesign profile --platform $platform > "$work/profile.json" 2> "$work/profile.txt"
echo "codesign profile: exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "matmul|bandwidth|memory|power|dispatch|compiled|lowered in|measured in|bf16|fp32|all-reduce|all-gather|reduce-scatter|profiled|failed|timed out|Error" "$work/profile.txt" | cut -c1-1500
keep
fi

cost_pass() {  # bench/gpu_cost.toml through the CLI into DB $1, each precision and batch, within $2 s; then its rows
deadline=$(( $(date +%s) + $2 ))
for precision in $precisions; do
  for batch in $batches; do
    config="$work/gpu_cost_${precision}_${batch}.toml"
    sed -e "s/^precision = .*/precision = \"$precision\"/" -e "s/^avg_batch_size_per_device = .*/avg_batch_size_per_device = $batch/" \
        -e "s/^platform = .*/platform = \"$platform\"/" bench/gpu_cost.toml > "$config"
    left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 5 ] || { echo "out of time before $precision $batch"; break 2; }
    timeout $left "$py" -m codesign -c "$config" -d "$1" --manual-job-timeout 90 2>&1 | tail -n 4
  done
done
"$py" -m codesign export all -d "$1" -o "${1%.db}_results.csv"
"$py" - "${1%.db}_results.csv" <<'PY'
import sys, pandas as pd
frame = pd.read_csv(sys.argv[1])
print(frame[["status", "token_mixer", "precision", "input_batch_size", "median", "predicted_time", "throughput",
             "max_memory", "predicted_memory", "compile_time", "profile_id"]].to_string(index=False))
PY
}

if part 3. bench/gpu_cost.toml through the CLI: precisions $precisions, batches $batches; then
cost_pass "$work/gpu.db" $(within $t_cli)
keep
fi

if part 4. cost model error; then
timeout $(within $t_cost) "$py" bench/bench_cost_model.py -d "$work/gpu.db" -v
echo "# the same attempts priced by the built-in profile of this device kind (what prices it before a profile is measured):"
timeout $(within $t_cost) "$py" bench/bench_cost_model.py -d "$work/gpu.db" --builtin -v
keep
fi

if part 11. the seed model GEMMs timed, beside the hardware model; then
for precision in $precisions; do
  timeout $(within $t_gemm) "$py" bench/bench_gemms.py "${model[@]:0:2}" --batch $b1 --precision $precision
done
keep
fi

if part 12. transformers through the CLI: bench/gpu_transformer.toml, against the cost model; then
config="$work/gpu_transformer.toml"
sed -e "s/^platform = .*/platform = \"$platform\"/" bench/gpu_transformer.toml > "$config"
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then  # a model the CPU runs in seconds
  sed -i -e "s/^num_layers = .*/num_layers = 2/" -e "s/^hidden = .*/hidden = 32/" -e "s/^heads = .*/heads = 4/" \
    -e "s/^seq_len = .*/seq_len = 16/" -e "s/^vocab = .*/vocab = 128/" -e "s/^num_auto_layers = .*/num_auto_layers = 2/" \
    -e "s/^num_iters = .*/num_iters = 3/" -e "s/^precision = .*/precision = \"fp32\"/" "$config"
fi
timeout $(within $t_cli) "$py" -m codesign -c "$config" -d "$work/transformer.db" --manual-job-timeout 120 2>&1 | tail -n 5
timeout $(within $t_cost) "$py" bench/bench_cost_model.py -d "$work/transformer.db" -v
keep
fi

if part 10. the cost model learns: bench/gpu_cost.toml again, priced by the calibration part 3 fitted; then
"$py" -m codesign profile --platform $platform --calibrations
cost_pass "$work/gpu_again.db" $(within $t_cli)
timeout $(within $t_cost) "$py" bench/bench_cost_model.py -d "$work/gpu_again.db" -v
keep
fi

if part 9. energy measured against predicted, and at three power limits; then
timeout $(within $t_power) "$py" bench/bench_power.py -d "$work/gpu.db" --limits
keep
fi

if part 5. step bench, batch $b1: reference; then
t_bench=$t_large bench_step --batch $b1 --precision bf16 fp32 --rows reference --hlo
keep
fi

if part 6. step bench, batch $b2: reference; then
t_bench=$t_large bench_step --batch $b2 --precision bf16 fp32 --rows reference
keep
fi

if part 7. compile through a shared autotune cache; then
for run in first second; do  # each a fresh process and an empty JAX cache, one XLA autotune cache between them
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$work/autotune" timeout $(within $t_bench) "$py" bench/bench_step.py \
    --compile-only project "${model[@]:0:2}" --batch $b1 --precision bf16 --cache "$work/jax_$run" | tail -n 1 | sed "s/^/$run: /"
done
keep
fi

if part 8. the step under other XLA flags: ${GPU_CHECK_XLA:-none given}; then
IFS=';' read -ra flag_sets <<< "${GPU_CHECK_XLA:-}"
flag_step() {  # $1 row, $2 name, then XLA flags: the bf16 step at b1, its row and kernel table (trace and HLO in trace_flags_$2)
  local row=$1 name=$2; shift 2
  XLA_FLAGS="${XLA_FLAGS:-} $*" timeout $(within $t_bench) "$py" bench/bench_step.py "${model[@]}" --batch $b1 \
    --precision bf16 --rows $row --trace "$work/trace_flags_$name" --cache "$work/jax_flags_$name" | sed -n "/^ *$row /,\$p"
}
set_rows=()
for i in "${!flag_sets[@]}"; do
  { echo "# XLA_FLAGS +${flag_sets[$i]}"; flag_step project $i "${flag_sets[$i]}"; } | tee "$work/flags_$i.txt"
  set_rows+=("$work/flags_$i.txt")
done
together=$([ -f "$work/step_bf16.txt" ] && (( ${#set_rows[@]} )) && "$py" bench/flag_winners.py $b1 "$work/step_bf16.txt" "${set_rows[@]}")
if [ -n "$together" ] && part 8. together, each faster than the bf16 step of part 1: $together; then
  read -r row flags <<< "$together"
  flag_step "$row" together $flags
fi
keep
fi
