"""The ZHEN model of DESIGN.md, in Flax, with analytical parameter and FLOP counts.

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

from codesign.specs import ModelSpec

DOT_HIDDEN = 512
FFN_HIDDEN = 2048
CONV_KERNEL = 5

Carry = tuple[jax.Array, jax.Array | None]


def layer_widths(spec: ModelSpec, i: int) -> tuple[int, int]:
    """(F_in(i), S(i)): the layer's input feature width and its skip input width."""
    o = spec.output_per_emb
    f_in = spec.num_features if i == 0 else len(spec.tokens[i - 1]) * o
    skip = spec.num_features if i <= 1 else len(spec.tokens[i - 2]) * o
    return f_in, skip


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


def _mixer(kind: str, spec: ModelSpec, dtype, name: str, fold_dot: bool) -> nn.Module:
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
        tokens = [_mixer(kind, self.spec, self.dtype, f"mixer_{j}_{kind.lower()}", self.fold_dot)(z)
                  for j, kind in enumerate(self.spec.tokens[self.index])]
        out = nn.LayerNorm(dtype=self.dtype, name="norm")(jnp.concatenate(tokens, axis=1))
        return z, out.transpose(0, 2, 1)


def blocks(spec: ModelSpec, dtype=jnp.float32) -> list[ZhenBlock]:
    return [ZhenBlock(spec, i, dtype) for i in range(spec.num_zhen_layers)]


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


def output_width(spec: ModelSpec) -> int:
    return spec.emb_dim * len(spec.tokens[-1]) * spec.output_per_emb


# Analytical counts: no arrays, so the model search can price millions of candidates.

def mixer_params(kind: str, f_in: int, out: int, emb: int) -> int:
    fc = f_in * out + out
    if kind == "DOT":
        return f_in * f_in * DOT_HIDDEN + DOT_HIDDEN + DOT_HIDDEN * out * emb + out * emb
    if kind == "LINEAR":
        return fc
    if kind == "ATTENTION":
        return fc + encoder_params(emb)
    return fc + CONV_KERNEL * CONV_KERNEL + 1


def encoder_params(emb: int) -> int:
    return 3 * emb * emb + emb * emb + emb + 2 * emb * FFN_HIDDEN + FFN_HIDDEN + emb + 4 * emb


def layer_param_count(spec: ModelSpec, i: int) -> int:
    f_in, skip = layer_widths(spec, i)
    o, d = spec.output_per_emb, spec.emb_dim
    proj = skip * f_in + f_in if (i > 0 and skip != f_in) else 0
    return proj + sum(mixer_params(m, f_in, o, d) for m in spec.tokens[i]) + 2 * d


def param_count(spec: ModelSpec) -> int:
    return sum(layer_param_count(spec, i) for i in range(spec.num_zhen_layers))


def mixer_flops(kind: str, f_in: int, out: int, emb: int, fold_dot: bool = False) -> int:
    """Forward matmul and convolution FLOPs (2 per multiply-add) of one mixer, per sample.

    By default the model's own FLOPs (the DOT mixer's FC over all F_in^2 pairs), what
    throughput figures are quoted in; fold_dot=True counts what the folded DOT executes.
    """
    fc = 2 * emb * f_in * out
    if kind == "DOT":
        pairs = f_in * (f_in + 1) // 2 if fold_dot else f_in * f_in
        return 2 * emb * f_in * f_in + 2 * pairs * DOT_HIDDEN + 2 * DOT_HIDDEN * out * emb
    if kind == "LINEAR":
        return fc
    if kind == "ATTENTION":
        attention = 2 * out * emb * 3 * emb + 2 * 2 * out * out * emb + 2 * out * emb * emb
        return fc + attention + 2 * 2 * out * emb * FFN_HIDDEN
    return fc + 2 * CONV_KERNEL * CONV_KERNEL * emb * f_in


def layer_flops(spec: ModelSpec, i: int, fold_dot: bool = False) -> int:
    f_in, skip = layer_widths(spec, i)
    o, d = spec.output_per_emb, spec.emb_dim
    proj = 2 * d * skip * f_in if (i > 0 and skip != f_in) else 0
    return proj + sum(mixer_flops(m, f_in, o, d, fold_dot) for m in spec.tokens[i])


def forward_flops_per_sample(spec: ModelSpec, fold_dot: bool = False) -> int:
    return sum(layer_flops(spec, i, fold_dot) for i in range(spec.num_zhen_layers))


def train_flops_per_sample(spec: ModelSpec) -> int:
    """Forward plus backward (twice the forward), the usual 3x estimate."""
    return 3 * forward_flops_per_sample(spec)
