"""The engine's platform switches, decided here once: how a step is built on CPU and on GPUs.

`engine_options` chooses the step's switches per platform and precision; the builders (step,
pipeline, the ZHEN modules) receive them, and benches vary them with `dataclasses.replace`.
`run_once_options` chooses the compiler options of programs run once. Pure: no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# Elements from which a leaf stays its own array beside the flat vector, per precision. In fp32
# XLA:GPU copies a vector slice that a matmul reads; one more array in the step's call costs the
# host less than that copy of a large kernel. In bf16 the cast reads the slice in place.
_WHOLE_LEAF = {"fp32": 2**23, "bf16": math.inf}


@dataclass(frozen=True)
class EngineOptions:
    """How the step is built; the model's function and parameters are the same under every value."""

    # Replicated parameters and Adam's state as flat vectors (step.FlatView): on a GPU the host's
    # call of ~450 arrays and ~400 small Adam fusions cost more than the vector; XLA:CPU copies its slices.
    flat_state: bool
    whole_leaf: float  # elements from which a leaf stays whole beside the flat vector
    # The encoder FFN's first bias added by its matmul (network.BiasInMatmulDense): XLA:GPU fuses
    # no bias into a batched cuBLASLt matmul; on CPU the plain Dense is faster.
    bias_in_matmul: bool
    batch_encoders: bool  # a layer's ATTENTION encoders as one vmapped encoder (False: one after another)
    # The convolution backward's sums as one variadic reduction (one XLA:CPU kernel), or one
    # reduction per term, as XLA:GPU ran the differentiated convolution's.
    one_reduction_sums: bool

    def to_dict(self) -> dict[str, Any]:
        """As an outcome records them (JSON: a whole_leaf of infinity, no leaf kept whole, as None)."""
        return {**dataclasses.asdict(self), "whole_leaf": None if math.isinf(self.whole_leaf) else self.whole_leaf}


def engine_options(platform: str, precision: str) -> EngineOptions:
    """The step's switches on `platform` (a JAX device's: "cpu", else a GPU's) in `precision`."""
    gpu = platform != "cpu"
    return EngineOptions(flat_state=gpu, whole_leaf=_WHOLE_LEAF[precision], bias_in_matmul=gpu,
                         batch_encoders=True, one_reduction_sums=not gpu)


def run_once_options(platform: str) -> dict[str, Any]:
    """Compiler options for a program run once or only analysed (initial values, synthetic data,
    a memory analysis): on XLA:CPU its backend's lowest optimisation level, about half the
    compile; on a GPU no autotuning of its matmuls (a default kernel serves one call, and
    buffers are assigned the same)."""
    return {"xla_backend_optimization_level": 0} if platform == "cpu" else {"xla_gpu_autotune_level": 0}
