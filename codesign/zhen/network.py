"""The ZHEN model of DESIGN.md, in Flax (its analytical counts live apart, in `counts`).

The model is a chain of blocks `layer_i`, each carrying (layer input, layer output)
forward, so a plan can cut it into contiguous layer groups (pipeline stages, remat
regions) without changing the parameter tree. Parameters carry logical axis names;
the plan maps them to mesh axes.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from codesign.spec.types import ModelSpec
from codesign.zhen.counts import CONV_KERNEL, DOT_HIDDEN, FFN_HIDDEN, layer_widths

Carry = tuple[jax.Array, jax.Array | None]


def _dense(features: int, axes: tuple[str | None, str | None], dtype, name: str,
           use_bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, name=name,
                    kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]))


class SymmetricPairsDense(nn.Module):
    """The DOT mixer's first FC, over only the upper triangle of the symmetric z^T z.

    t_ij W_ij + t_ji W_ji = t_ij (W_ij + W_ji) when t is symmetric, so folding the kernel's
    mirrored rows gives the same function with about half the multiply-adds. The kernel keeps
    its full F_in^2 rows (same parameters, same count, same initialisation as a plain Dense).
    """

    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, gram: jax.Array) -> jax.Array:
        f = gram.shape[-1]
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                   ("pairs", "mlp")), (f * f, self.features))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",)),
                          (self.features,))
        rows, cols = np.triu_indices(f)
        upper, lower = rows * f + cols, cols * f + rows
        mirrored = jnp.where((rows != cols)[:, None], kernel[lower], 0.0)
        folded = (kernel[upper] + mirrored).astype(self.dtype)
        pairs = gram.reshape(gram.shape[0], -1)[:, upper]
        return pairs @ folded + bias.astype(self.dtype)


class DotMixer(nn.Module):
    out: int
    emb: int
    dtype: jnp.dtype = jnp.float32
    fold_symmetric: bool = True

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        b = z.shape[0]
        gram = jnp.einsum("bdf,bdg->bfg", z, z)
        if self.fold_symmetric:
            h = SymmetricPairsDense(DOT_HIDDEN, self.dtype, name="fc1")(gram)
        else:
            h = _dense(DOT_HIDDEN, ("pairs", "mlp"), self.dtype, "fc1")(gram.reshape(b, -1))
        y = _dense(self.out * self.emb, ("mlp", None), self.dtype, "fc2")(nn.relu(h))
        return y.reshape(b, self.out, self.emb)


class LinearMixer(nn.Module):
    out: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        return _dense(self.out, ("features", None), self.dtype, "fc")(z).transpose(0, 2, 1)


class EncoderLayer(nn.Module):
    """Post-norm Transformer encoder layer: one head, ReLU FFN, qkv without bias."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        qkv = _dense(3 * d, ("embed", "qkv"), self.dtype, "qkv", use_bias=False)(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(d)
        attn = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)
        x = nn.LayerNorm(dtype=self.dtype, name="norm1")(x + _dense(d, ("qkv", "embed"), self.dtype, "out")(attn))
        ff = _dense(FFN_HIDDEN, ("embed", "mlp"), self.dtype, "ffn1")(x)
        ff = _dense(d, ("mlp", "embed"), self.dtype, "ffn2")(nn.relu(ff))
        return nn.LayerNorm(dtype=self.dtype, name="norm2")(x + ff)


class AttentionMixer(nn.Module):
    out: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        tokens = _dense(self.out, ("features", None), self.dtype, "fc")(z).transpose(0, 2, 1)
        return EncoderLayer(self.dtype, name="encoder")(tokens)


class ConvolutionMixer(nn.Module):
    out: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        k = CONV_KERNEL
        conv = nn.Conv(1, (k, k), padding=k // 2, dtype=self.dtype, name="conv",
                       kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                (None, None, None, None)),
                       bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)))
        y = conv(z[..., None])[..., 0]
        return _dense(self.out, ("features", None), self.dtype, "fc")(y).transpose(0, 2, 1)


def mixer(kind: str, spec: ModelSpec, dtype, name: str, fold_dot: bool) -> nn.Module:
    o, d = spec.output_per_emb, spec.emb_dim
    if kind == "DOT":
        return DotMixer(o, d, dtype, fold_dot, name=name)
    if kind == "LINEAR":
        return LinearMixer(o, dtype, name=name)
    if kind == "ATTENTION":
        return AttentionMixer(o, dtype, name=name)
    return ConvolutionMixer(o, dtype, name=name)


class ZhenBlock(nn.Module):
    """Layer i: the skip projection, its own mixers, the token concat and LayerNorm."""

    spec: ModelSpec
    index: int
    dtype: jnp.dtype = jnp.float32
    fold_dot: bool = True  # False: the DOT mixer's FC over the full F_in^2 Gram matrix, as defined

    @nn.compact
    def __call__(self, carry: Carry) -> Carry:
        prev_in, prev_out = carry
        if self.index == 0:
            z = prev_in
        else:
            f_in, skip = layer_widths(self.spec, self.index)
            if skip != f_in:
                prev_in = _dense(f_in, ("features", None), self.dtype, "skip")(prev_in)
            z = prev_out + prev_in
        tokens = [mixer(kind, self.spec, self.dtype, f"mixer_{j}_{kind.lower()}", self.fold_dot)(z)
                  for j, kind in enumerate(self.spec.tokens[self.index])]
        out = nn.LayerNorm(dtype=self.dtype, name="norm")(jnp.concatenate(tokens, axis=1))
        return z, out.transpose(0, 2, 1)


def init_params(spec: ModelSpec, key: jax.Array, batch: int = 1, layers: Sequence[int] | None = None) -> dict:
    """Boxed (logically partitioned) parameters {layer_i: ...} of all layers, or of `layers` alone
    (a pipeline stage) with the same values; use under jax.eval_shape for shapes."""
    layers = range(spec.num_zhen_layers) if layers is None else layers
    return {f"layer_{i}": ZhenBlock(spec, i).init(jax.random.fold_in(key, i), _input_carry(spec, i, batch))["params"]
            for i in layers}


def _input_carry(spec: ModelSpec, i: int, batch: int) -> Carry:
    """Zeros shaped like layer i's input carry: (previous layer input, previous layer output)."""
    f_in, skip = layer_widths(spec, i)
    if i == 0:
        return jnp.zeros((batch, spec.emb_dim, f_in), jnp.float32), None
    return (jnp.zeros((batch, spec.emb_dim, skip), jnp.float32),
            jnp.zeros((batch, spec.emb_dim, f_in), jnp.float32))


def apply_layers(spec: ModelSpec, params: dict, carry: Carry, layers: Sequence[int],
                 dtype=jnp.float32, fold_dot: bool = True) -> Carry:
    for i in layers:
        carry = ZhenBlock(spec, i, dtype, fold_dot).apply({"params": params[f"layer_{i}"]}, carry)
    return carry


def forward(spec: ModelSpec, params: dict, x: jax.Array, dtype=jnp.float32,
            fold_dot: bool = True) -> jax.Array:
    _, out = apply_layers(spec, params, (x, None), range(spec.num_zhen_layers), dtype, fold_dot)
    return out.reshape(out.shape[0], -1)
