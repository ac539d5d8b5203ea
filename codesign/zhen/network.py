"""The ZHEN model of DESIGN.md, in Flax (its analytical counts live apart, in `counts`).

The model is a chain of blocks `layer_i`, each carrying (layer input, layer output)
forward, so a plan can cut it into contiguous layer groups (pipeline stages, remat
regions) without changing the parameter tree. Parameters carry logical axis names;
the plan maps them to mesh axes.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from codesign.config.types import ModelSpec
from codesign.engine.options import EngineOptions, engine_options
from codesign.engine.programs import varying_like
from codesign.zhen import counts
from codesign.zhen.counts import CONV_KERNEL, DOT_HIDDEN, FFN_HIDDEN, layer_widths

Carry = tuple[jax.Array, jax.Array | None]


def _dense(features: int, axes: tuple[str | None, str | None], dtype, name: str,
           use_bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, name=name,
                    kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]))


def _later_block(f: int, k: int) -> np.ndarray:
    """[a, c]: feature c lies in a later one of the k blocks than feature a."""
    block = np.arange(f) // (f // k)
    return block[None, :] > block[:, None]


def _fold_rows(kernel: jax.Array, k: int, dtype) -> list[jax.Array]:
    """Per row block i: kernel rows (a in block i, c >= block i), mirrored rows (c, a) added off the diagonal blocks."""
    f, h = math.isqrt(kernel.shape[0]), kernel.shape[1]
    w = kernel.reshape(f, f, h)
    folded = (w + jnp.where(_later_block(f, k)[:, :, None], w.transpose(1, 0, 2), 0)).astype(dtype)
    s = f // k
    return [folded[i * s:(i + 1) * s, i * s:] for i in range(k)]


def _gram_rows(z: jax.Array, k: int) -> list[jax.Array]:
    """Per row block i: z^T z rows of block i from column block i on, B x s x (F - i s)."""
    s = z.shape[2] // k
    return [jnp.einsum("bdu,bdc->buc", z[:, :, i * s:(i + 1) * s], z[:, :, i * s:]) for i in range(k)]


def _upper(pieces: list[jax.Array], axis: int) -> jax.Array:
    """The row blocks of an upper block trapezoid (each from its diagonal block on) as one
    zero-filled square array: one concatenation, where autodiff would add k padded copies."""
    f = pieces[0].shape[axis]
    rows = [jnp.concatenate([jnp.zeros(p.shape[:axis] + (f - p.shape[axis],) + p.shape[axis + 1:], p.dtype), p],
                            axis=axis) for p in pieces]
    return jnp.concatenate(rows, axis=axis - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def folded_pairs(z: jax.Array, kernel: jax.Array, k: int, dtype) -> jax.Array:
    """sum over a, c of t_ac kernel[a F + c] for t = z^T z, over the Gram's k(k+1)/2 upper blocks."""
    return _folded_pairs_fwd(z, kernel, k, dtype)[0]


def _folded_pairs_fwd(z, kernel, k, dtype):
    grams, rows = _gram_rows(z, k), _fold_rows(kernel, k, dtype)
    h = sum(g.reshape(g.shape[0], -1) @ r.reshape(-1, r.shape[-1]) for g, r in zip(grams, rows))
    return h, (z, grams, rows)


def _folded_pairs_bwd(k, dtype, residuals, dh):
    z, grams, rows = residuals
    f = z.shape[2]
    d_grams = [jnp.einsum("bh,uch->buc", dh, r) for r in rows]
    d_rows = [jnp.einsum("buc,bh->uch", g, dh) for g in grams]
    d_gram = _upper(d_grams, 2)  # B x F x F
    dz = jnp.einsum("bdg,bfg->bdf", z, d_gram + d_gram.transpose(0, 2, 1))
    d_fold = _upper(d_rows, 1).astype(jnp.float32)  # F x F x H
    d_kernel = d_fold + jnp.where(_later_block(f, k)[:, :, None], d_fold, 0).transpose(1, 0, 2)
    return dz, d_kernel.reshape(f * f, -1)


folded_pairs.defvjp(_folded_pairs_fwd, _folded_pairs_bwd)


class FoldedPairsDense(nn.Module):
    """The DOT mixer's z^T z and first FC over only the Gram blocks on and above the diagonal.

    t = z^T z is symmetric, so t_ac W_ac + t_ca W_ca = t_ac (W_ac + W_ca). F_in is split into
    k blocks (counts.fold_blocks); row block i of t is computed from column block i on and meets
    the matching kernel rows, the mirrored rows added off the diagonal blocks. Static slices and
    concatenations only, forward and backward (a gather of the triangle made the step slower on
    GPU). The kernel keeps its F_in^2 rows: same parameters, count and initialisation as a Dense.
    """

    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        f = z.shape[-1]
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                   ("pairs", "mlp")), (f * f, self.features))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",)),
                          (self.features,))
        return folded_pairs(z, kernel, counts.fold_blocks(f), self.dtype) + bias.astype(self.dtype)


class DotMixer(nn.Module):
    out: int
    emb: int
    dtype: jnp.dtype = jnp.float32
    fold: bool = False

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        b = z.shape[0]
        if self.fold:
            h = FoldedPairsDense(DOT_HIDDEN, self.dtype, name="fc1")(z)
        else:
            gram = jnp.einsum("bdf,bdg->bfg", z, z)
            h = _dense(DOT_HIDDEN, ("pairs", "mlp"), self.dtype, "fc1")(gram.reshape(b, -1))
        y = _dense(self.out * self.emb, ("mlp", None), self.dtype, "fc2")(nn.relu(h))
        return y.reshape(b, self.out, self.emb)


class FeatureFc(nn.Module):
    """A Dense's kernel and bias over the feature axis, read by the layer rather than applied:
    the LINEAR and ATTENTION mixers of a layer share their input z, so ZhenBlock runs all their
    FCs as one matmul (z read once, one transpose to tokens) with parameters unchanged."""

    f_in: int
    out: int

    def setup(self):
        self.kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                        ("features", None)), (self.f_in, self.out))
        self.bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
                               (self.out,))


class LinearMixer(nn.Module):
    """FC over the feature axis F_in -> O, transposed to O x D tokens: all of it run by ZhenBlock."""

    f_in: int
    out: int

    def setup(self):
        self.fc = FeatureFc(self.f_in, self.out)


def bias_in_matmul(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """x @ kernel + bias as one matmul, [x, 1, 0..] @ [kernel; bias; 0..], the inner dimension
    padded to a multiple of 8 (tensor cores' alignment)."""
    pad = -(x.shape[-1] + 1) % 8
    x = jnp.concatenate([x, jnp.ones((*x.shape[:-1], 1), x.dtype), jnp.zeros((*x.shape[:-1], pad), x.dtype)], axis=-1)
    return x @ jnp.concatenate([kernel, bias[None], jnp.zeros((pad, kernel.shape[1]), kernel.dtype)])


class BiasInMatmulDense(nn.Module):
    """A Dense whose bias is added by its matmul (bias_in_matmul), where EngineOptions.bias_in_matmul
    asks: XLA:GPU does not fuse a bias into a batched cuBLASLt matmul (the vmapped encoders' FFN),
    so it wrote the product and read it back to add the bias; here the product is the biased
    pre-activation and the bias gradient a row of the kernel's. Same parameters (names, shapes,
    initialisation) and function as a Dense."""

    features: int
    axes: tuple[str | None, str | None]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.lecun_normal(), self.axes),
                            (x.shape[-1], self.features))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), self.axes[1:]),
                          (self.features,))
        operands = (x.astype(self.dtype), kernel.astype(self.dtype), bias.astype(self.dtype))
        return bias_in_matmul(*operands)


class EncoderLayer(nn.Module):
    """Post-norm Transformer encoder layer: one head, ReLU FFN, qkv without bias."""

    options: EngineOptions
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        qkv = _dense(3 * d, ("embed", "qkv"), self.dtype, "qkv", use_bias=False)(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(d)
        attn = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)
        x = nn.LayerNorm(dtype=self.dtype, name="norm1")(x + _dense(d, ("qkv", "embed"), self.dtype, "out")(attn))
        ffn1 = (BiasInMatmulDense(FFN_HIDDEN, ("embed", "mlp"), self.dtype, name="ffn1") if self.options.bias_in_matmul
                else _dense(FFN_HIDDEN, ("embed", "mlp"), self.dtype, "ffn1"))
        ff = ffn1(x)
        ff = _dense(d, ("mlp", "embed"), self.dtype, "ffn2")(nn.relu(ff))
        return nn.LayerNorm(dtype=self.dtype, name="norm2")(x + ff)


class AttentionMixer(nn.Module):
    """FC over the feature axis F_in -> O (run by ZhenBlock), then a Transformer encoder layer."""

    f_in: int
    out: int
    options: EngineOptions
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.fc = FeatureFc(self.f_in, self.out)
        self.encoder = EncoderLayer(self.options, self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.encoder(tokens)


class SameConv(nn.Module):
    """A k x k single-channel convolution over (B, D, F), zero-padded to the same size: nn.Conv's
    parameters (kernel k x k x 1 x 1, bias 1), computed as k^2 shifted multiply-adds accumulated in
    fp32 (`shifted_conv`). XLA:CPU ran nn.Conv's one-channel convolution 2.6-4.2x slower; on an
    H100 the model with it ran 30x slower at batch 4096 than at 1024."""

    one_reduction_sums: bool  # EngineOptions.one_reduction_sums: the backward's sums in one reduction
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        k = CONV_KERNEL
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                   (None, None, None, None)), (k, k, 1, 1))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)), (1,))
        z = z.astype(self.dtype).astype(jnp.float32)
        taps = varying_like(kernel.reshape(k, k).astype(self.dtype).astype(jnp.float32), z)
        bias = varying_like(bias.astype(self.dtype).astype(jnp.float32), z)
        return shifted_conv(bias, z, taps, self.one_reduction_sums).astype(self.dtype)


def _windows(z: jax.Array, k: int) -> list[jax.Array]:
    """The k^2 shifted windows of z (B, H, W) zero-padded to the same size, tap (i, j) at i * k + j."""
    h, w, pad = z.shape[1], z.shape[2], k // 2
    padded = jnp.pad(z, ((0, 0), (pad, pad), (pad, pad)))
    return [padded[:, i:i + h, j:j + w] for i, j in itertools.product(range(k), range(k))]


def _shifted_sum(y: jax.Array, z: jax.Array, taps: jax.Array) -> jax.Array:
    """y + the same-size correlation of z (B, H, W) with taps (k, k): one element-wise fusion."""
    for tap, window in zip(taps.reshape(-1), _windows(z, taps.shape[0])):
        y = y + tap * window
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def shifted_conv(bias: jax.Array, z: jax.Array, taps: jax.Array, one_reduction_sums: bool) -> jax.Array:
    """bias + z correlated with taps, fp32. Its backward is written out: differentiated, the k^2
    shifted slices became k^2 pads and k^2 reductions, many kernels a large share of XLA:CPU's compile."""
    return _shifted_sum(bias, z, taps)


def _shifted_conv_forward(bias, z, taps, one_reduction_sums):
    return _shifted_sum(bias, z, taps), (bias, z, taps)


def _shifted_conv_backward(one_reduction_sums, residuals, cotangent):
    """z's gradient: the cotangent correlated with the flipped taps (one fusion, as forward); the
    taps' and the bias's: sums of products, in one variadic reduction where one_reduction_sums
    (XLA:CPU makes k^2 kernels of separate sums)."""
    bias, z, taps = residuals
    terms = [window * cotangent for window in _windows(z, taps.shape[0])] + [cotangent]
    sums = (sums_in_one_reduction if one_reduction_sums else sums_one_by_one)(*terms)
    dz = _shifted_sum(jnp.zeros((), jnp.float32), cotangent, taps[::-1, ::-1])
    return sums[-1:].reshape(bias.shape), dz, sums[:-1].reshape(taps.shape)


def sums_in_one_reduction(*terms: jax.Array) -> jax.Array:
    """Each term's sum, as one variadic reduction (one XLA:CPU kernel)."""
    return jnp.stack(jax.lax.reduce(terms, (jnp.float32(0),) * len(terms),
                                    lambda xs, ys: tuple(x + y for x, y in zip(xs, ys)), tuple(range(terms[0].ndim))))


def sums_one_by_one(*terms: jax.Array) -> jax.Array:
    """Each term's sum, one reduction each (as XLA:GPU ran the differentiated convolution's)."""
    return jnp.stack([jnp.sum(t) for t in terms])


shifted_conv.defvjp(_shifted_conv_forward, _shifted_conv_backward)


class ConvolutionMixer(nn.Module):
    out: int
    options: EngineOptions
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        y = SameConv(self.options.one_reduction_sums, self.dtype, name="conv")(z)
        return _dense(self.out, ("features", None), self.dtype, "fc")(y).transpose(0, 2, 1)


def _mixer(kind: str, spec: ModelSpec, f_in: int, dtype, name: str, fold_dot: bool,
           options: EngineOptions) -> nn.Module:
    o, d = spec.output_per_emb, spec.emb_dim
    if kind == "DOT":
        return DotMixer(o, d, dtype, fold_dot, name=name)
    if kind == "LINEAR":
        return LinearMixer(f_in, o, name=name)
    if kind == "ATTENTION":
        return AttentionMixer(f_in, o, options, dtype, name=name)
    return ConvolutionMixer(o, options, dtype, name=name)


_PROJECTING = (LinearMixer, AttentionMixer)  # mixers whose feature FC ZhenBlock runs


def _feature_tokens(mixers: list[nn.Module], z: jax.Array, dtype) -> jax.Array:
    """The feature-axis FCs of the mixers that have one (FeatureFc), as one matmul over z:
    B x D x F_in -> B x (sum of O) x D tokens, the mixers' tokens side by side in their order."""
    fcs = [m.fc for m in mixers]
    kernel = jnp.concatenate([fc.kernel for fc in fcs], axis=1).astype(dtype)
    bias = jnp.concatenate([fc.bias for fc in fcs]).astype(dtype)
    return (z @ kernel + bias).transpose(0, 2, 1)


class ZhenBlock(nn.Module):
    """Layer i: the skip projection, its own mixers, the token concat and LayerNorm."""

    spec: ModelSpec
    index: int
    options: EngineOptions
    dtype: jnp.dtype = jnp.float32
    fold_dot: bool = False  # True: the DOT mixer over the Gram's upper blocks (FoldedPairsDense)

    @nn.compact
    def __call__(self, carry: Carry) -> Carry:
        prev_in, prev_out = carry
        f_in, skip = layer_widths(self.spec, self.index)
        if self.index == 0:
            z = prev_in
        else:
            if skip != f_in:
                prev_in = _dense(f_in, ("features", None), self.dtype, "skip")(prev_in)
            z = prev_out + prev_in
        mixers = [_mixer(kind, self.spec, f_in, self.dtype, f"mixer_{j}_{kind.lower()}", self.fold_dot, self.options)
                  for j, kind in enumerate(self.spec.tokens[self.index])]
        out = {m.name: m(z) for m in mixers if not isinstance(m, _PROJECTING)}
        attention = [m for m in mixers if isinstance(m, AttentionMixer)]
        linear = [m for m in mixers if isinstance(m, LinearMixer)]
        if attention or linear:
            tokens = _feature_tokens(attention + linear, z, self.dtype)
            n = len(attention) * self.spec.output_per_emb
            if linear:
                out.update(zip((m.name for m in linear), jnp.split(tokens[:, n:], len(linear), axis=1)))
            if attention:
                out.update(zip((m.name for m in attention), self._encoded(attention, tokens[:, :n])))
        normed = nn.LayerNorm(dtype=self.dtype, name="norm")(jnp.concatenate([out[m.name] for m in mixers], axis=1))
        return z, normed.transpose(0, 2, 1)

    def _encoded(self, attention: list[AttentionMixer], tokens: jax.Array) -> list[jax.Array]:
        """The ATTENTION mixers' encoders over their tokens (B x (k O) x D), as one encoder vmapped
        over the k mixers' parameters: every kernel of the encoder runs once per layer, not k times.
        Same parameters (each mixer keeps its own) and function."""
        k = len(attention)
        if k == 1 or not self.options.batch_encoders or self.is_initializing():
            return [m(t) for m, t in zip(attention, jnp.split(tokens, k, axis=1))]
        params = [nn.meta.unbox(self.variables["params"][m.name]["encoder"]) for m in attention]
        stacked = jax.tree.map(lambda *p: jnp.stack(p), *params)
        encode = jax.vmap(lambda p, t: EncoderLayer(self.options, self.dtype).apply({"params": p}, t),
                          in_axes=(0, 1), out_axes=1)
        b, _, d = tokens.shape
        encoded = encode(stacked, tokens.reshape(b, k, -1, d))
        return jnp.split(encoded.reshape(b, -1, d), k, axis=1)


def init_params(spec: ModelSpec, key: jax.Array, batch: int = 1, layers: Sequence[int] | None = None) -> dict:
    """Boxed (logically partitioned) parameters {layer_i: ...} of all layers, or of `layers` alone
    (a pipeline stage) with the same values; use under jax.eval_shape for shapes. The parameters
    are the same under every EngineOptions: the default backend's serve."""
    layers = range(spec.num_zhen_layers) if layers is None else layers
    options = engine_options(jax.default_backend(), "fp32")
    return {f"layer_{i}": ZhenBlock(spec, i, options).init(jax.random.fold_in(key, i),
                                                           _input_carry(spec, i, batch))["params"]
            for i in layers}


def _input_carry(spec: ModelSpec, i: int, batch: int) -> Carry:
    """Zeros shaped like layer i's input carry: (previous layer input, previous layer output)."""
    f_in, skip = layer_widths(spec, i)
    if i == 0:
        return jnp.zeros((batch, spec.emb_dim, f_in), jnp.float32), None
    return (jnp.zeros((batch, spec.emb_dim, skip), jnp.float32),
            jnp.zeros((batch, spec.emb_dim, f_in), jnp.float32))


def apply_layers(spec: ModelSpec, params: dict, carry: Carry, layers: Sequence[int], options: EngineOptions,
                 dtype=jnp.float32, fold_dot: bool = False) -> Carry:
    for i in layers:
        carry = ZhenBlock(spec, i, options, dtype, fold_dot).apply({"params": params[f"layer_{i}"]}, carry)
    return carry


def forward(spec: ModelSpec, params: dict, x: jax.Array, options: EngineOptions, dtype=jnp.float32,
            fold_dot: bool = False) -> jax.Array:
    _, out = apply_layers(spec, params, (x, None), range(spec.num_zhen_layers), options, dtype, fold_dot)
    return out.reshape(out.shape[0], -1)


def synthetic_inputs(spec: ModelSpec, key: jax.Array, batch: int, dtype) -> jax.Array:
    """Random normal inputs (batch, D, F), drawn in fp32 and given in the compute precision."""
    return jax.random.normal(key, (batch, spec.emb_dim, spec.num_features), jnp.float32).astype(dtype)


def synthetic_targets(spec: ModelSpec, key: jax.Array, batch: int) -> jax.Array:
    """Random normal targets (batch, the model's output width), fp32."""
    return jax.random.normal(key, (batch, counts.output_width(spec)), jnp.float32)


def loss(out: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error, in fp32, of the last layer's output against the targets."""
    out = out.astype(jnp.float32)
    return jnp.mean((out.reshape(out.shape[0], -1) - y) ** 2)
