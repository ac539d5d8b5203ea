"""One ZHEN training step on one device: samples/s, achieved TFLOP/s, peak memory, compile time.

    python bench/bench_step.py                       # small model on whatever JAX finds (CPU here)
    python bench/bench_step.py --model seed          # the seed model, batch 1024 (a GPU job)

TFLOP/s are quoted in model FLOPs (3x the analytical forward, DOT fc1 over all F_in^2 pairs);
"executed" counts what the folded DOT mixer really multiplies. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from codesign.engine.job import build_training, peak_memory, train_steps
from codesign.planner.plan import make_plan
from codesign.spec.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.zhen import counts

MODELS = {
    "seed": ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4),
    "small": ModelSpec(128, 32, 8, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4),
}


def bench(model: ModelSpec, batch: int, precision: str, steps: int) -> dict:
    platform = jax.devices()[0].platform
    job = Job(model, ClusterSpec(1, 1, "NVLink", platform), TrainingSpec(batch, steps + 2, precision=precision),
              ParallelSpec("single device", (1,), 1, False, (1, 1, 1)), 1, platform)
    training = build_training(job, make_plan(job))
    train_steps(training, 2)
    _, times = train_steps(training, steps)
    step = float(np.median(times))
    per_sample = counts.train_flops_per_sample(model)
    executed = 3 * counts.forward_flops_per_sample(model, fold_dot=True)
    return {"precision": precision, "batch": batch, "step_ms": step * 1e3, "samples_per_s": batch / step,
            "model_tflops": per_sample * batch / step / 1e12, "executed_tflops": executed * batch / step / 1e12,
            "peak_mib": (peak_memory(training, jax.devices()[:1]) or 0) / 2**20,
            "compile_s": training.compile_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--batch", type=int, help="samples per step (default 1024 seed, 256 small)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model = MODELS[args.model]
    batch = args.batch or (1024 if args.model == "seed" else 256)
    device = jax.devices()[0]
    print(f"# {args.model}: {model.summary()}, {counts.param_count(model):,} parameters, "
          f"{counts.train_flops_per_sample(model) * batch / 1e12:.3f} TFLOP per step; "
          f"{device.platform} {device.device_kind}, jax {jax.__version__}")
    print(f"{'precision':>9} {'batch':>6} {'step ms':>9} {'samples/s':>11} {'TFLOP/s':>8} "
          f"{'executed':>8} {'peak MiB':>9} {'compile s':>9}")
    for precision in args.precision:
        r = bench(model, batch, precision, args.steps)
        print(f"{r['precision']:>9} {r['batch']:>6} {r['step_ms']:>9.2f} {r['samples_per_s']:>11,.0f} "
              f"{r['model_tflops']:>8.3f} {r['executed_tflops']:>8.3f} {r['peak_mib']:>9.1f} {r['compile_s']:>9.2f}",
              flush=True)


if __name__ == "__main__":
    main()
