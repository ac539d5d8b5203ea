"""What a family's counts describe a layer by: its work per sample and its matmuls, in terms the
cost model prices without knowing the family."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """What one layer (or mixer) costs per sample, split into the part operator parallelism
    shards (the "mlp" logical axis) and the rest, which every op device repeats. FLOPs are the
    forward's; activations are the elements the backward keeps (residuals), inputs excluded.
    `reduced` is what op's all-reduce of the sharded part's output carries, in elements per
    sample (once forward, once backward). The block-folded DOT (ZHEN's fold_dot) also works on
    its kernel once per call, whatever the batch: `fold_kernel` is the kernel it reads to fold
    and its gradient unfolds into, `fold_rows` the folded rows it keeps for the backward."""

    flops: int = 0
    sharded_flops: int = 0
    params: int = 0
    sharded_params: int = 0
    activations: int = 0
    sharded_activations: int = 0
    tensors: int = 0  # parameter arrays: each is its own gradient collective unless XLA combines them
    fold_kernel: int = 0  # per call: the block fold's kernel elements (fp32), read to fold, written unfolding
    fold_rows: int = 0  # per call: the folded kernel rows (compute precision), a residual of the call
    relu: int = 0  # ReLU outputs (sharded), residuals only of a program that hands them out
    skipped_backward: int = 0  # backward FLOPs the step never runs: the first layer's input gradient
    reduced: int = 0  # elements per sample op's all-reduce carries (forward, and again backward)

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, ...]:
        return (self.flops, self.sharded_flops, self.params, self.sharded_params,
                self.activations, self.sharded_activations, self.tensors, self.fold_kernel, self.fold_rows,
                self.relu, self.skipped_backward, self.reduced)


@dataclass(frozen=True)
class Gemm:
    """One matmul of a layer, per sample: the GEMM's m is samples x `rows` (batched einsums as
    one GEMM of their stacked rows), then n and k. `split`: the dimension op shards ("m", "n",
    "k", or "" where every op device repeats it); `input_facing`: its input gradient is one the
    first layer's backward skips, as the step differentiates the parameters alone."""

    rows: int
    n: int
    k: int
    split: str = ""
    input_facing: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.n * self.k
