"""One ZHEN training step on one device, the project's against a plain reference step.

    python bench/bench_step.py                                  # small model on whatever JAX finds (CPU here)
    python bench/bench_step.py --model seed --batch 1024 4096   # the seed model (a GPU job)
    python bench/bench_step.py --model small --batch 8 --steps 1 --precision fp32   # smoke run

Rows per precision and batch: `project` (the step codesign runs), `project-fold` (with
fold_dot, the DOT mixer over the Gram's upper blocks; --fold) and `reference`
(reference_step.py: jax.numpy from DESIGN.md, optax.adam, one jit), then project/reference.
TFLOP/s are model FLOPs (3x the analytical forward, DOT over all F_in^2 pairs); peak memory
and compile time come from the compiled program. --hlo adds the optimized HLO's op counts
(fusions, gathers, transposes, copies, dots). Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import reference_step

from codesign.engine import programs
from codesign.engine.job import build_training, train_steps
from codesign.planner.plan import make_plan
from codesign.spec.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.zhen import counts, network

MODELS = {
    "seed": ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4),
    "small": ModelSpec(128, 32, 8, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4),
}
WARMUP = 2


def _job(model: ModelSpec, batch: int, precision: str, steps: int, fold: bool) -> Job:
    platform = jax.devices()[0].platform
    return Job(model, ClusterSpec(1, 1, "NVLink", platform),
               TrainingSpec(batch, steps + WARMUP, precision=precision, fold_dot=fold),
               ParallelSpec("single device", (1,), 1, False, (1, 1, 1)), 1, platform)


def bench_project(model: ModelSpec, batch: int, precision: str, steps: int, fold: bool) -> dict:
    job = _job(model, batch, precision, steps, fold)
    training = build_training(job, make_plan(job))
    train_steps(training, WARMUP)
    _, times = train_steps(training, steps)
    return {"step_s": float(np.median(times)), "compile_s": training.compile_time,
            "peak": training.memory.get("peak"), "ops": programs.compiled_op_counts(training.compiled)}


def bench_reference(model: ModelSpec, batch: int, precision: str, steps: int) -> dict:
    dtype = programs.DTYPES[precision]
    optimizer, step = reference_step.make_step(model, 1e-3, dtype)
    params = jax.jit(lambda k: nn.meta.unbox(network.init_params(model, k)))(jax.random.key(0))
    opt_state = optimizer.init(params)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (batch, model.emb_dim, model.num_features), jnp.float32)
    y = jax.random.normal(ky, (batch, counts.output_width(model)), jnp.float32)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, x, y).compile()
    compile_s = time.perf_counter() - start
    times = []
    for i in range(WARMUP + steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, x, y)
        jax.block_until_ready((params, loss))
        times.append(time.perf_counter() - start)
    return {"step_s": float(np.median(times[WARMUP:])), "compile_s": compile_s,
            "peak": programs.compiled_memory(compiled).get("peak"), "ops": programs.compiled_op_counts(compiled)}


def _row(name: str, model: ModelSpec, precision: str, batch: int, r: dict, hlo: bool) -> str:
    step = r["step_s"]
    text = (f"{name:>12} {precision:>9} {batch:>6} {step * 1e3:>9.2f} {batch / step:>11,.0f} "
            f"{counts.train_flops_per_sample(model) * batch / step / 1e12:>8.3f} "
            f"{(r['peak'] or 0) / 2**20:>9.1f} {r['compile_s']:>9.2f}")
    return text + ("  " + " ".join(f"{k}={v}" for k, v in r["ops"].items()) if hlo else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--batch", type=int, nargs="+", help="samples per step (default 1024 seed, 256 small)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--fold", action="store_true", help="also time the project step with fold_dot")
    parser.add_argument("--hlo", action="store_true", help="print the optimized HLO's op counts")
    args = parser.parse_args()
    model = MODELS[args.model]
    device = jax.devices()[0]
    print(f"# {args.model}: {model.summary()}, {counts.param_count(model):,} parameters, "
          f"{counts.train_flops_per_sample(model) / 1e9:.3f} GFLOP per sample; "
          f"{device.platform} {device.device_kind}, jax {jax.__version__}")
    print(f"{'step':>12} {'precision':>9} {'batch':>6} {'step ms':>9} {'samples/s':>11} {'TFLOP/s':>8} "
          f"{'peak MiB':>9} {'compile s':>9}")
    for precision in args.precision:
        for batch in args.batch or [1024 if args.model == "seed" else 256]:
            project = bench_project(model, batch, precision, args.steps, False)
            print(_row("project", model, precision, batch, project, args.hlo), flush=True)
            if args.fold:
                print(_row("project-fold", model, precision, batch,
                           bench_project(model, batch, precision, args.steps, True), args.hlo), flush=True)
            reference = bench_reference(model, batch, precision, args.steps)
            print(_row("reference", model, precision, batch, reference, args.hlo), flush=True)
            print(f"# {precision} batch {batch}: project/reference {reference['step_s'] / project['step_s']:.2f}x "
                  f"in samples/s", flush=True)


if __name__ == "__main__":
    main()
