"""One ZHEN training step on one device, the project's against a plain reference step.

    python bench/bench_step.py                                  # small model on whatever JAX finds (CPU here)
    python bench/bench_step.py --model seed --batch 1024 4096   # the seed model (a GPU job)
    python bench/bench_step.py --model small --batch 8 --steps 1 --precision fp32   # smoke run
    python bench/bench_step.py --model seed --batch 1024 --precision bf16 --trace DIR --recompile

Rows per precision and batch (--rows, in this order): `project` (the step codesign runs, built
with the platform's engine.options.engine_options; each other project row changes one of them),
`project-bias-add` (the encoders' first FFN bias added after its matmul, as a Dense does, instead of
inside it: bias_in_matmul; on CPU the two rows are one program), `project-serial` (its ATTENTION
encoders one after another instead of one vmapped encoder per layer: batch_encoders),
`project-flat` and `project-leaves` (parameters and Adam's state as flat vectors, engine.step.FlatView,
or one array per leaf: flat_state, by default flat on a GPU, per leaf on CPU), `project-one-vector`
(flat, with no leaf kept whole beside the vector: whole_leaf), `project-whole-leaf` (fp32's
large leaves kept whole in every precision: in bf16 its Adam update over the DOT kernel a kernel of
its own), `project-fold` (with fold_dot, the DOT mixer over the Gram's upper blocks) and `reference`
(reference_step.py: jax.numpy from DESIGN.md, optax.adam, one jit), then project/reference.
`step ms` is the median of synchronised steps (what a sweep records); `loop ms` the mean of steps
dispatched back to back with one sync at the end (a training loop's pace). TFLOP/s are model
FLOPs (3x the analytical forward, DOT over all F_in^2 pairs); peak memory
and compile time (lowering and XLA compilation) come from the compiled program. --hlo adds the
optimized HLO's op counts (fusions, gathers, transposes, copies, dots). --trace DIR traces a few
more steps of each row with jax.profiler into DIR/<row>_<precision>_<batch> and prints its kernel
table (kernel_table.py); the row's optimized HLO goes beside the trace (optimized_hlo.txt), so
its kernels can be found by name, and on an H100 or H200 each fusion is given against its roofline
(hlo_kernels.rooflines). --recompile compiles each row's step again in a fresh process reading the
same persistent compilation cache (--cache, or a fresh temporary one, so the first compile is
cold) and prints that compile's time and the cache's hits. --target h100 compiles each row for an
H100 on a machine without one (XLA's deviceless compile; the CUDA build of JAX, `.[gpu]`) and
prints its kernels, the optimized HLO's traffic and matmul FLOPs by kind and a roofline time
(hlo_kernels.py), --save-hlo DIR keeps
the HLO: the step's structure on a GPU, checkable where no GPU is (its matmuls are not autotuned).
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import flax.linen as nn
import hlo_kernels
import jax
import jax.numpy as jnp
import kernel_table
import numpy as np
import reference_step
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from codesign.engine import programs
from codesign.engine import step as single_stage
from codesign.engine.job import build_training, configure_jax
from codesign.engine.options import EngineOptions, engine_options
from codesign.engine.probe.compiles import cores_busy, cpu_seconds
from codesign.cost.plan import MESH_AXES, make_plan
from codesign.hardware.profiles import builtin_kind
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.zhen import counts, network

MODELS = {
    "seed": ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4),
    "small": ModelSpec(128, 32, 8, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4),
    "tiny": ModelSpec(64, 16, 4, 2, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 2),  # gpu_check.sh's CPU smoke form
}
WARMUP = 2
TRACE_STEPS = 5  # at most, after the timed ones: enough to see every kernel, few enough to read the trace
STEP_NAME = "bench_step"  # the StepTraceAnnotation that marks a traced step
ROWS = ("project", "project-bias-add", "project-serial", "project-flat", "project-leaves", "project-one-vector",
        "project-whole-leaf", "project-fold", "reference")
# GPUs --target compiles for without one: XLA's description of the device (GpuTargetConfigProto,
# text), data-sheet figures; its memory_bandwidth prices the HLO's traffic table.
TARGETS = {"h100": Path(__file__).with_name("h100_target.txtpb")}


def _job(model: ModelSpec, batch: int, precision: str, fold: bool, platform: str | None = None) -> Job:
    """A one-device job of the model (its num_iters is not read: this script runs its own steps)."""
    platform = platform or jax.devices()[0].platform
    return Job(model, ClusterSpec(1, 1, "NVLink", platform),
               TrainingSpec(batch, WARMUP, precision=precision, fold_dot=fold),
               ParallelSpec("single device", (1,), 1, False, (1, 1, 1)), 1, platform)


def _median_step(run: Callable[[], None], steps: int) -> float:
    """Median wall time of `steps` synchronised steps after the warm-up ones."""
    times = []
    for _ in range(WARMUP + steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times[WARMUP:]))


def _looped_step(dispatch: Callable[[], None], sync: Callable[[], None], steps: int) -> float:
    """Mean wall time of `steps` steps dispatched back to back, one sync after the last: a training
    loop's pace, the host's call of each step hidden behind the device's work on the one before."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        dispatch()
    sync()
    return (time.perf_counter() - start) / steps


def _timings(dispatch: Callable[[], None], sync: Callable[[], None], steps: int) -> dict:
    def run() -> None:
        dispatch()
        sync()

    return {"step_s": _median_step(run, steps), "loop_s": _looped_step(dispatch, sync, steps), "run": run}


def project_variant(row: str, model: ModelSpec, batch: int, precision: str) -> programs.Training:
    """The project's step as the row names it, built for the device at hand."""
    job = _job(model, batch, precision, row == "project-fold")
    return build_training(job, make_plan(job), options=row_options(row, job.platform, precision))


def row_options(row: str, platform: str, precision: str) -> EngineOptions:
    """The step's options as the row names them: the platform's own with one switch changed."""
    changed = {"project-bias-add": {"bias_in_matmul": False}, "project-serial": {"batch_encoders": False},
               "project-flat": {"flat_state": True}, "project-leaves": {"flat_state": False},
               "project-one-vector": {"flat_state": True, "whole_leaf": math.inf},
               "project-whole-leaf": {"whole_leaf": engine_options(platform, "fp32").whole_leaf}}
    return replace(engine_options(platform, precision), **changed.get(row, {}))


def bench_project(row: str, model: ModelSpec, batch: int, precision: str, steps: int) -> dict:
    training = project_variant(row, model, batch, precision)
    return _timings(training.step, training.synchronize, steps) | {
        "compile_s": training.compile_time, "peak": training.memory.get("peak"), "compiled": training.compiled}


def reference_program(model: ModelSpec, batch: int, precision: str) -> tuple[Callable, list, float]:
    """The reference step compiled, its (params, opt_state, x, y), and its compile time."""
    optimizer, step = reference_step.make_step(model, 1e-3, programs.DTYPES[precision])
    params = jax.jit(lambda k: nn.meta.unbox(network.init_params(model, k)))(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (batch, model.emb_dim, model.num_features), jnp.float32)
    y = jax.random.normal(ky, (batch, counts.output_width(model)), jnp.float32)
    args = [params, optimizer.init(params), x, y]
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled, args, time.perf_counter() - start


def bench_reference(model: ModelSpec, batch: int, precision: str, steps: int) -> dict:
    compiled, args, compile_s = reference_program(model, batch, precision)

    def dispatch() -> None:
        args[0], args[1], _ = compiled(*args)

    return _timings(dispatch, lambda: jax.block_until_ready(args[0]), steps) | {
        "compile_s": compile_s, "peak": programs.compiled_memory(compiled).get("peak"), "compiled": compiled}


def bench_row(row: str, model: ModelSpec, batch: int, precision: str, steps: int) -> dict:
    if row == "reference":
        return bench_reference(model, batch, precision, steps)
    return bench_project(row, model, batch, precision, steps)


def compile_seconds(row: str, model: ModelSpec, batch: int, precision: str) -> float:
    """Lowering and compiling one row's step (what the row's `compile s` column measures)."""
    if row == "reference":
        return reference_program(model, batch, precision)[2]
    return project_variant(row, model, batch, precision).compile_time


def compile_only(row: str, model_name: str, batch: int, precision: str, cache_dir: str) -> dict:
    """The --compile-only child: one compile through the persistent cache, what the cache did, and
    how busy the cores were while the row was built (part 7 of gpu_check.sh: a cold GPU compile
    that keeps every core busy is the CPU's; one that does not waits on autotuning's GPU runs)."""
    configure_jax(cache_dir)
    events: Counter = Counter()
    jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
    cpu, start = cpu_seconds(), time.perf_counter()
    seconds = compile_seconds(row, MODELS[model_name], batch, precision)
    return {"compile_s": seconds, "cache_hits": events["/jax/compilation_cache/cache_hits"],
            "cache_requests": events["/jax/compilation_cache/compile_requests_use_cache"],
            "build": cores_busy(cpu_seconds() - cpu, time.perf_counter() - start)}


def recompile(row: str, model_name: str, batch: int, precision: str, cache_dir: str) -> dict:
    """The row's step compiled again in a fresh process on the same persistent cache."""
    command = [sys.executable, str(Path(__file__).resolve()), "--compile-only", row, "--model", model_name,
               "--batch", str(batch), "--precision", precision, "--cache", cache_dir]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the second compile of {row} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def batches(args: argparse.Namespace) -> list[int]:
    return args.batch or [1024 if args.model == "seed" else 256]


def target_value(name: str, field: str) -> int:
    """A field of the described GPU's target config (memory_bandwidth: B/s; device_memory_size: bytes)."""
    return int(re.search(rf"{field}: (\d+)", TARGETS[name].read_text()).group(1))


def target_bandwidth(name: str) -> float:
    """The described GPU's HBM bandwidth, B/s, as its target config gives it."""
    return float(target_value(name, "memory_bandwidth"))


def target_devices(name: str, hosts: int = 1, per_host: int = 1) -> list[jax.Device]:
    """The devices of described GPUs, host-major (XLA's deviceless compile: the CUDA build of JAX, no GPU)."""
    from jax.experimental.topologies import get_topology_desc

    jax.config.update("jax_platforms", "cpu")  # nothing attached is initialised: programs are only compiled
    try:
        topology = get_topology_desc(name, "cuda", target_config=TARGETS[name].read_text(),
                                     topology=f"1x{hosts}x{per_host}")
    except Exception as err:  # noqa: BLE001 - whatever JAX raises without its CUDA plugin
        print(f"{Path(sys.argv[0]).name}: --target {name} needs the CUDA build of JAX (pip install -e '.[gpu]'; "
              f"no GPU needed): {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return list(topology.devices)


def target_compile(row: str, model: ModelSpec, batch: int, precision: str, device: jax.Device) -> tuple[Any, float]:
    """The row's step compiled for a described GPU, and its compile time (no autotuning: XLA
    picks its matmul kernels by heuristics)."""
    mesh = Mesh(np.array([device]).reshape(1, 1), MESH_AXES)
    if row == "reference":
        optimizer, step = reference_step.make_step(model, 1e-3, programs.DTYPES[precision])
        replicated = NamedSharding(mesh, P())

        def placed(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), tree)

        params = placed(jax.eval_shape(lambda k: nn.meta.unbox(network.init_params(model, k)), jax.random.key(0)))
        x = jax.ShapeDtypeStruct((batch, model.emb_dim, model.num_features), jnp.float32, sharding=replicated)
        y = jax.ShapeDtypeStruct((batch, counts.output_width(model)), jnp.float32, sharding=replicated)
        start = time.perf_counter()
        compiled = step.lower(params, placed(jax.eval_shape(optimizer.init, params)), x, y).compile()
        return compiled, time.perf_counter() - start

    job = _job(model, batch, precision, row == "project-fold", "gpu")
    built = single_stage.compile_single_stage(job, make_plan(job), mesh, row_options(row, "gpu", precision))
    return built.compiled, built.compile_time


def report_target(args: argparse.Namespace) -> None:
    """Each row compiled for the described GPU: compile time, op counts and the HLO's traffic."""
    device, model = target_devices(args.target)[0], MODELS[args.model]
    print(f"# {args.model}: {model.summary()}, compiled for {device.device_kind} ({args.target}, no device "
          f"attached: no autotuning), jax {jax.__version__}")
    for precision in args.precision:
        for batch in batches(args):
            for row in [r for r in ROWS if r in args.rows]:
                try:
                    compiled, seconds = target_compile(row, model, batch, precision, device)
                except Exception as err:  # noqa: BLE001 - e.g. a GEMM XLA cannot tile without autotuning
                    failed(row, precision, batch, err)
                    continue
                hlo = compiled.as_text()
                kernels = hlo_kernels.entry_kernels(hlo)
                ops = programs.compiled_op_counts(compiled)
                print(f"{row} {precision} batch {batch}: compile {seconds:.2f} s, {len(kernels)} kernels, "
                      + " ".join(f"{k}={v}" for k, v in ops.items()), flush=True)
                print(hlo_kernels.format_traffic(kernels, f"{row} {precision} batch {batch}",
                                                 target_bandwidth(args.target), hlo_kernels.HOPPER_MATMUL),
                      flush=True)
                if args.save_hlo:
                    path = Path(args.save_hlo) / f"{row}_{precision}_{batch}.hlo.txt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(hlo)


def trace_table(run: Callable[[], None], log_dir: Path, steps: int) -> kernel_table.KernelTable:
    """Trace `steps` annotated steps into log_dir and read the kernel table back from the trace."""
    with jax.profiler.trace(str(log_dir)):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                run()
    return kernel_table.build_table(kernel_table.load_trace(log_dir), STEP_NAME)


def _row(name: str, model: ModelSpec, precision: str, batch: int, r: dict, hlo: bool) -> str:
    step = r["step_s"]
    text = (f"{name:>12} {precision:>9} {batch:>6} {step * 1e3:>9.2f} {batch / step:>11,.0f} "
            f"{counts.train_flops_per_sample(model) * batch / step / 1e12:>8.3f} "
            f"{(r['peak'] or 0) / 2**20:>9.1f} {r['compile_s']:>9.2f} {r['loop_s'] * 1e3:>9.2f}")
    ops = programs.compiled_op_counts(r["compiled"]) if hlo else {}
    return text + ("  " + " ".join(f"{k}={v}" for k, v in ops.items()) if hlo else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--batch", type=int, nargs="+", help="samples per step (default 1024 seed, 256 small)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=["project", "reference"],
                        help="the steps to time (default: project reference)")
    parser.add_argument("--hlo", action="store_true", help="print the optimized HLO's op counts")
    parser.add_argument("--trace", metavar="DIR", help=f"trace up to {TRACE_STEPS} more steps of each row into "
                        "DIR and print their kernel table")
    parser.add_argument("--recompile", action="store_true",
                        help="compile each row again in a fresh process from the persistent cache")
    parser.add_argument("--cache", metavar="DIR", help="persistent compilation cache (default with --recompile: "
                        "a fresh temporary directory)")
    parser.add_argument("--target", choices=sorted(TARGETS), help="compile each row for this GPU without one "
                        "(needs the CUDA build of JAX) and print its kernels and the HLO's traffic; times nothing")
    parser.add_argument("--save-hlo", metavar="DIR", help="with --target: write each row's optimized HLO into DIR")
    parser.add_argument("--compile-only", choices=ROWS, help=argparse.SUPPRESS)
    return parser


def report_row(row: str, args: argparse.Namespace, batch: int, precision: str, cache_dir: str | None) -> float:
    """Bench one row and print it, its second compile and its kernel table; its step seconds.
    Nothing of the row outlives the call: the next row compiles and runs on a free device."""
    model = MODELS[args.model]
    r = bench_row(row, model, batch, precision, args.steps)
    print(_row(row, model, precision, batch, r, args.hlo), flush=True)
    if args.trace:
        log_dir = Path(args.trace) / f"{row}_{precision}_{batch}"
        table = trace_table(r["run"], log_dir, min(args.steps, TRACE_STEPS))
        hlo = r["compiled"].as_text()
        (log_dir / "optimized_hlo.txt").write_text(hlo)  # the kernels' fusions, by name
        rooflines = hlo_kernels.gpu_rooflines(hlo, builtin_kind(jax.devices()[0].device_kind))  # None off H100/H200
        print(kernel_table.format_table(table, f"{row} {precision} batch {batch}", rooflines=rooflines), flush=True)
    if args.recompile:  # after the trace: a GPU run cut short by its timeout still printed the table
        again = recompile(row, args.model, batch, precision, cache_dir)
        print(f"# {row} {precision} batch {batch}: compile {r['compile_s']:.2f} s, again in a fresh process "
              f"from the persistent cache {again['compile_s']:.2f} s ({again['cache_hits']} cache hits of "
              f"{again['cache_requests']} requests)", flush=True)
    return r["step_s"]


def failed(row: str, precision: str, batch: int, err: Exception) -> None:
    """One line on stdout for a row that failed, its traceback on stderr: the other rows still run
    (on a GPU, a row whose kernel this JAX cannot build must not cost the rest of the check)."""
    traceback.print_exc()
    print(f"{row} {precision} batch {batch}: failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}",
          flush=True)


def bench(args: argparse.Namespace, cache_dir: str | None) -> None:
    rows = [r for r in ROWS if r in args.rows]
    for precision in args.precision:
        for batch in batches(args):
            step_s = {}
            for row in rows:
                try:
                    step_s[row] = report_row(row, args, batch, precision, cache_dir)
                except Exception as err:  # noqa: BLE001 - reported, and the next row runs
                    failed(row, precision, batch, err)
            for row in [r for r in step_s if r != "reference"] if "reference" in step_s else []:
                print(f"# {precision} batch {batch}: {row}/reference {step_s['reference'] / step_s[row]:.2f}x "
                      f"in samples/s", flush=True)


def main() -> None:
    args = _parser().parse_args()
    if args.target:
        report_target(args)
        return
    if args.compile_only:
        print(json.dumps(compile_only(args.compile_only, args.model, args.batch[0], args.precision[0], args.cache)))
        return
    cache_dir = args.cache or (tempfile.mkdtemp(prefix="bench-step-jax-cache-") if args.recompile else None)
    configure_jax(cache_dir)  # before the first compile: JAX decides once per process whether to use the cache
    model = MODELS[args.model]
    device = jax.devices()[0]
    print(f"# {args.model}: {model.summary()}, {counts.param_count(model):,} parameters, "
          f"{counts.train_flops_per_sample(model) / 1e9:.3f} GFLOP per sample; "
          f"{device.platform} {device.device_kind}, jax {jax.__version__}"
          + (f"; persistent compilation cache {cache_dir}" if cache_dir else ""))
    print(f"{'step':>12} {'precision':>9} {'batch':>6} {'step ms':>9} {'samples/s':>11} {'TFLOP/s':>8} "
          f"{'peak MiB':>9} {'compile s':>9} {'loop ms':>9}")
    bench(args, cache_dir)


if __name__ == "__main__":
    main()
