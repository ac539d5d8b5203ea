"""The module a profile times for each kind of mixer: the model's own code path."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from codesign.config.types import ModelSpec
from codesign.engine.options import EngineOptions, engine_options
from codesign.engine.programs import DTYPES
from codesign.hardware.profiles import ENCODER_PAIR, LAYER
from codesign.zhen import counts, network


def mixer_module(kind: str, f_in: int, out: int, emb: int, precision: str) -> tuple[nn.Module, float]:
    """The module timed for a kind, and its FLOPs per sample: a one-mixer ZHEN layer (for
    ENCODER_PAIR a layer of two ATTENTION mixers) built as the engine builds it here, or for LAYER
    the layer's own (skip projection) work."""
    dtype = DTYPES[precision]
    if kind == LAYER:
        return nn.Dense(f_in, dtype=dtype), 2 * emb * f_in * f_in
    options = engine_options(jax.default_backend(), precision)
    if kind == ENCODER_PAIR:
        return (OneMixerLayer(("ATTENTION", "ATTENTION"), f_in, out, emb, options, dtype),
                2 * counts.mixer_work("ATTENTION", f_in, out, emb).flops)
    return OneMixerLayer((kind,), f_in, out, emb, options, dtype), counts.mixer_work(kind, f_in, out, emb).flops


class OneMixerLayer(nn.Module):
    """ZHEN's first layer holding these mixers (one, or an encoder pair): what the profile times
    for a kind (the model's own code path: a LINEAR or ATTENTION mixer's feature FC runs in the layer)."""

    kinds: tuple[str, ...]
    f_in: int
    out: int
    emb: int
    options: EngineOptions
    dtype: Any

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        spec = ModelSpec(self.f_in, self.emb, self.out, 1, (self.kinds,))
        return network.ZhenBlock(spec, 0, self.options, self.dtype)((z, None))[1]
