"""The transformer family's co-design space: every shape of about the base's parameter count.

A shape is layers x hidden x heads at a head dimension from a short list (64, 80, 96, 128: the
widths "The Case for Co-Designing Model Architectures with Hardware", arXiv 2401.14489, finds
throughput turns on), with the base's sequence, vocabulary, causality and a 4 x hidden MLP.
Pure: `codesign search --rank` prices each shape's plans (planner.ranking).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

import numpy as np

from codesign.config.types import TransformerSpec
from codesign.transformer import counts

HEAD_DIMS = (64, 80, 96, 128)
MAX_HIDDEN_RATIO = 4  # widths up to 4x the base's
HEADS_STEP = 8  # heads in multiples of a host's 8 GPUs, so that any op inside a host divides them


def shapes(base: TransformerSpec, tolerance: float, head_dims: tuple[int, ...] = HEAD_DIMS) -> list[TransformerSpec]:
    """Every shape whose parameters are within `tolerance` of the base's (|p - b| / max(p, b)),
    from half the base's layers to twice them, by layers, then head dimension, then heads (a
    multiple of HEADS_STEP); the base first."""
    target = counts.param_count(base)
    found = [base]
    for layers in range(max(1, base.num_layers // 2), 2 * base.num_layers + 1):
        for head_dim in head_dims:
            for heads in range(HEADS_STEP, MAX_HIDDEN_RATIO * base.hidden // head_dim + 1, HEADS_STEP):
                shape = dataclasses.replace(base, num_layers=layers, hidden=heads * head_dim, heads=heads, ffn=0)
                params = counts.param_count(shape)
                if abs(params - target) / max(params, target) < tolerance and shape not in found:
                    found.append(shape)
    return found


def gemms(model: TransformerSpec) -> str:
    """The first layer's matmuls per sequence, m x n x k, as the hardware tables price them (every
    layer's but the last, which adds the logits')."""
    return " ".join(f"{g.rows}x{g.n}x{g.k}" for block in counts.layer_gemms(model, 0) for g in block)


@dataclass(frozen=True)
class Shapes:
    """The candidates of a transformer ranking, in shapes' order (planner.ranking reads them as
    it reads ZHEN's Candidates)."""

    base: TransformerSpec
    models: tuple[TransformerSpec, ...]

    @functools.cached_property  # the CSV reads it per candidate and target
    def params(self) -> np.ndarray:
        return np.array([counts.param_count(m) for m in self.models])

    def __len__(self) -> int:
        return len(self.models)

    def model(self, c: int) -> TransformerSpec:
        return self.models[c]

    def label(self, c: int) -> tuple[str, int, str, str]:
        """(summary, layers, its [[model]] table as JSON, its GEMM shapes): the CSV's model cells."""
        m = self.models[c]
        return m.summary(), m.num_layers, json.dumps(m.to_toml()), gemms(m)

    def toml(self, c: int, base_params: int) -> str:
        m = self.models[c]
        params = counts.param_count(m)
        lines = [f"# {m.summary()}: {params:,} parameters ({(params - base_params) / base_params:+.1%} vs the base)",
                 "[[model]]", *(f"{k} = {json.dumps(v)}" for k, v in m.to_toml().items()), ""]
        return "\n".join(lines) + "\n"
