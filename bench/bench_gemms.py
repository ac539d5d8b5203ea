"""The GEMMs the seed model's mixers run, timed on this machine's device beside what the hardware
model prices them at (bench/gpu_check.sh part 11; `codesign hardware gemm` for that device kind).

    python bench/bench_gemms.py                          # the seed model, batch 1024, bf16
    python bench/bench_gemms.py --batch 4096 --precision fp32
    python bench/bench_gemms.py --model tiny --batch 8   # on CPU, in seconds

Each distinct (m, n, k) of the forward and of both gradients, for the first layer and a later one,
is timed as a jitted matmul repeated inside one compiled loop (one sync per loop, as the profile
times work on a GPU). The predicted column is hardware.gemm's for the device's kind (a table, or
its data sheet; "-" where it has neither, e.g. a CPU).
"""

from __future__ import annotations

import argparse
import time

from codesign.config.types import ModelSpec
from codesign.zhen import counts

MODELS = {"seed": ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4),
          "tiny": ModelSpec(32, 16, 4, 2, (("ATTENTION", "LINEAR", "DOT"),) * 2)}


def shapes(model: ModelSpec, batch: int) -> list[tuple[str, int, int, int]]:
    """(what, m, n, k) of every distinct GEMM of the model's first and second layer."""
    found = {}
    for i in range(min(2, model.num_zhen_layers)):
        for kind, gemms in zip(model.tokens[i], counts.layer_gemms(model, i)):
            for j, g in enumerate(gemms):
                m = batch * g.rows
                for role, shape in (("fwd", (m, g.n, g.k)), ("dW", (g.k, g.n, m)), ("dX", (m, g.k, g.n))):
                    found.setdefault(shape, f"L{i} {kind}[{j}] {role}")
    return [(what, *shape) for shape, what in found.items()]


def timed(m: int, n: int, k: int, precision: str, repeats: int) -> float:
    """Seconds of one (m x k) @ (k x n) on the default device, the median of three loops."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)

    @jax.jit
    def loop(a, b):
        def body(_, carry):  # the carry feeds the next product, so no iteration is dropped
            return carry + (a @ b)[0, 0].astype(dtype)
        return jax.lax.fori_loop(0, repeats, body, jnp.zeros((), dtype))

    loop(a, b).block_until_ready()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        loop(a, b).block_until_ready()
        runs.append((time.perf_counter() - start) / repeats)
    return sorted(runs)[1]


def predicted(kind: str, precision: str, m: int, n: int, k: int) -> tuple[float | None, str]:
    from codesign.hardware.gemm import gemm_seconds

    try:
        return gemm_seconds(kind, precision, m, n, k)
    except KeyError:
        return None, "no table or data sheet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="seed")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=50, help="Matmuls per timed loop.")
    args = parser.parse_args()
    import jax

    kind = jax.devices()[0].device_kind
    print(f"# {kind}, {args.model} model, batch {args.batch}, {args.precision}")
    print(f"{'gemm':<26} {'m':>8} {'n':>6} {'k':>8} {'measured us':>12} {'predicted us':>13} {'pred/meas':>9}  source")
    for what, m, n, k in shapes(MODELS[args.model], args.batch):
        seconds = timed(m, n, k, args.precision, args.repeats)
        guess, source = predicted(kind, args.precision, m, n, k)
        ratio = f"{guess / seconds:9.2f}" if guess else f"{'-':>9}"
        print(f"{what:<26} {m:>8} {n:>6} {k:>8} {seconds * 1e6:12.1f} "
              f"{guess * 1e6 if guess else float('nan'):13.1f} {ratio}  {source}")


if __name__ == "__main__":
    main()
