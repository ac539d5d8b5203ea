"""The transformer family in Flax: GPT-style decoders (causal) and BERT-style encoders.

The model is a chain of blocks `layer_i`, as ZHEN's is, so that a plan cuts it into contiguous
layer groups (pipeline stages, remat regions) without changing the parameter tree. Layer i is a
pre-LayerNorm self-attention block then a pre-LayerNorm MLP block (GELU), each added to the
residual stream; layer 0 first embeds the tokens and their positions (learned), and the last
layer ends with the final LayerNorm and the vocabulary's logits (an untied head, no bias). No
dropout. The structure, and so every layer's parameter count, is `counts`' (codesign.transformer.counts).

Parameters carry logical axis names; the plan's rules map "mlp" to the op mesh axis, which
gives Megatron-LM's tensor parallelism (Shoeybi et al., arXiv 1909.08053): the QKV projection
column-parallel (split by heads) and the attention's output projection row-parallel, the MLP's
first FC column-parallel and its second row-parallel, each block's output all-reduced over op
(forward, and its input gradient backward); the token embedding and the head split by the
vocabulary (the loss's softmax then reduces each token's maximum and sum over op).

The carry between layers is (hidden states, None); layer 0 takes (token ids, None), int32 of
(batch, seq_len), and the last layer hands on (None, logits): the engine reads a model's output
in the carry's second place, as it does ZHEN's.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from codesign.config.types import TransformerSpec
from codesign.engine.options import EngineOptions

Carry = tuple[jax.Array | None, jax.Array | None]
INIT_STD = 0.02  # GPT-2's and Megatron-LM's (init_method_std) for every kernel and embedding


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...],
           init=None) -> jax.Array:
    return module.param(name, nn.with_logical_partitioning(init or nn.initializers.normal(INIT_STD), axes), shape)


def _zeros(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> jax.Array:
    return _param(module, name, shape, axes, nn.initializers.zeros_init())


def _layer_norm(dtype, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(dtype=dtype, name=name,
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)))


class SelfAttention(nn.Module):
    """Multi-head self-attention: QKV (hidden -> 3 x heads x head_dim, with bias) split by heads
    over op (column-parallel), softmax in fp32, the output projection (heads x head_dim -> hidden,
    with bias) contracting the heads (row-parallel: XLA all-reduces its partial sums over op)."""

    spec: TransformerSpec
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        t = self.spec
        h, a, d = t.hidden, t.heads, t.head_dim
        qkv_kernel = _param(self, "qkv_kernel", (h, 3, a, d), ("embed", None, "mlp", None))
        qkv_bias = _zeros(self, "qkv_bias", (3, a, d), (None, "mlp", None))
        out_kernel = _param(self, "out_kernel", (a, d, h), ("mlp", None, "embed"))
        out_bias = _zeros(self, "out_bias", (h,), ("embed",))
        x = x.astype(self.dtype)
        qkv = jnp.einsum("bse,etnd->tbsnd", x, qkv_kernel.astype(self.dtype))
        qkv = qkv + qkv_bias.astype(self.dtype)[:, None, None]
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
        if t.causal:
            mask = jnp.tril(jnp.ones((t.seq_len, t.seq_len), bool))
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        context = jnp.einsum("bnqk,bknd->bqnd", probs, v)
        return jnp.einsum("bqnd,nde->bqe", context, out_kernel.astype(self.dtype)) + out_bias.astype(self.dtype)


class Mlp(nn.Module):
    """hidden -> ffn (GELU) -> hidden: the first FC column-parallel over op, the second row-parallel."""

    spec: TransformerSpec
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h, f = self.spec.hidden, self.spec.ffn_hidden
        fc1 = nn.Dense(f, dtype=self.dtype, name="fc1",
                       kernel_init=nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), ("embed", "mlp")),
                       bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",)))
        fc2 = nn.Dense(h, dtype=self.dtype, name="fc2",
                       kernel_init=nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), ("mlp", "embed")),
                       bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)))
        return fc2(nn.gelu(fc1(x)))


class TransformerBlock(nn.Module):
    """Layer i: (layer 0) the token and position embeddings; the attention and MLP blocks, each
    pre-LayerNorm and residual; (the last layer) the final LayerNorm and the logits."""

    spec: TransformerSpec
    index: int
    options: EngineOptions | None = None  # the engine's switches: none concerns this family yet
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, carry: Carry) -> Carry:
        t = self.spec
        x = carry[0]
        if self.index == 0:
            tokens = _param(self, "token_embedding", (t.vocab, t.hidden), ("mlp", "embed"))
            positions = _param(self, "position_embedding", (t.seq_len, t.hidden), (None, "embed"))
            x = (jnp.take(tokens, x, axis=0) + positions).astype(self.dtype)
        x = x + SelfAttention(t, self.dtype, name="attention")(_layer_norm(self.dtype, "norm1")(x))
        x = x + Mlp(t, self.dtype, name="mlp")(_layer_norm(self.dtype, "norm2")(x))
        if self.index < t.num_layers - 1:
            return x, None
        head = _param(self, "head", (t.hidden, t.vocab), ("embed", "mlp"))
        x = _layer_norm(self.dtype, "final_norm")(x)
        return None, x @ head.astype(self.dtype)


def init_params(spec: TransformerSpec, key: jax.Array, batch: int = 1, layers: Sequence[int] | None = None) -> dict:
    """Boxed (logically partitioned) parameters {layer_i: ...} of all layers, or of `layers` alone
    (a pipeline stage) with the same values; use under jax.eval_shape for shapes."""
    layers = range(spec.num_layers) if layers is None else layers
    return {f"layer_{i}": TransformerBlock(spec, i).init(jax.random.fold_in(key, i),
                                                         _input_carry(spec, i, batch))["params"]
            for i in layers}


def _input_carry(spec: TransformerSpec, i: int, batch: int) -> Carry:
    """Zeros shaped like layer i's input carry: token ids into layer 0, hidden states after it."""
    if i == 0:
        return jnp.zeros((batch, spec.seq_len), jnp.int32), None
    return jnp.zeros((batch, spec.seq_len, spec.hidden), jnp.float32), None


def apply_layers(spec: TransformerSpec, params: dict, carry: Carry, layers: Sequence[int],
                 options: EngineOptions, dtype=jnp.float32, fold_dot: bool = False) -> Carry:
    """carry through `layers` (fold_dot is ZHEN's: a transformer has no DOT mixer)."""
    for i in layers:
        carry = TransformerBlock(spec, i, options, dtype).apply({"params": params[f"layer_{i}"]}, carry)
    return carry


def forward(spec: TransformerSpec, params: dict, x: jax.Array, options: EngineOptions, dtype=jnp.float32,
            fold_dot: bool = False) -> jax.Array:
    """The logits (batch, seq_len, vocab) of token ids x (batch, seq_len)."""
    _, out = apply_layers(spec, params, (x, None), range(spec.num_layers), options, dtype, fold_dot)
    return out


def synthetic_inputs(spec: TransformerSpec, key: jax.Array, batch: int, dtype) -> jax.Array:
    """Random token ids in [0, vocab), (batch, seq_len) int32."""
    return jax.random.randint(key, (batch, spec.seq_len), 0, spec.vocab, jnp.int32)


def synthetic_targets(spec: TransformerSpec, key: jax.Array, batch: int) -> jax.Array:
    """Random target token ids in [0, vocab), (batch, seq_len) int32."""
    return jax.random.randint(key, (batch, spec.seq_len), 0, spec.vocab, jnp.int32)


def loss(out: jax.Array, y: jax.Array) -> jax.Array:
    """Mean token cross-entropy, in fp32, of logits out (batch, seq_len, vocab) against target
    ids y (batch, seq_len). The target's logit is picked by a one-hot product, not a gather: with
    the vocabulary split over op, every reduction here is one XLA all-reduces (a max, two sums)."""
    logits = out.astype(jnp.float32)
    picked = jnp.sum(logits * jax.nn.one_hot(y, logits.shape[-1], dtype=jnp.float32), axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
