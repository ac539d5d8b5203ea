"""A plain ZHEN training step, written from DESIGN.md's model definition alone: jax.numpy
functions over the parameter dict, optax.adam, one jit. No Flax, no fold, no trick.

bench_step.py times it beside the project's step at the same batch and precision (bf16:
bf16 compute, fp32 parameters and Adam state), so a project step slower than this naive
one shows. It reads the project's parameter tree as a plain dict ({layer_i: {mixer_j_kind:
{fc: {kernel, bias}}, ...}}), so both start from the same values.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from codesign.config.types import ModelSpec
from codesign.zhen.counts import layer_widths

Params = dict[str, Any]
EPS = 1e-6  # LayerNorm epsilon


def dense(p: Params, x: jax.Array, dtype) -> jax.Array:
    """x @ kernel + bias over the last axis, in dtype."""
    y = x @ p["kernel"].astype(dtype)
    return y + p["bias"].astype(dtype) if "bias" in p else y


def layer_norm(p: Params, x: jax.Array, dtype) -> jax.Array:
    """Over the last axis, statistics in fp32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + EPS) * p["scale"] + p["bias"]).astype(dtype)


def encoder(p: Params, x: jax.Array, dtype) -> jax.Array:
    """Post-norm Transformer encoder layer over tokens x (B x T x D): one head, ReLU FFN."""
    q, k, v = jnp.split(dense(p["qkv"], x, dtype), 3, axis=-1)
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(x.shape[-1])
    x = layer_norm(p["norm1"], x + dense(p["out"], jax.nn.softmax(scores, axis=-1) @ v, dtype), dtype)
    ff = dense(p["ffn2"], jax.nn.relu(dense(p["ffn1"], x, dtype)), dtype)
    return layer_norm(p["norm2"], x + ff, dtype)


def mixer(kind: str, p: Params, z: jax.Array, spec: ModelSpec, dtype) -> jax.Array:
    """z (B x D x F_in) -> B x O x D."""
    b = z.shape[0]
    if kind == "DOT":
        t = (z.transpose(0, 2, 1) @ z).reshape(b, -1)  # z^T z, flattened to F_in^2
        y = dense(p["fc2"], jax.nn.relu(dense(p["fc1"], t, dtype)), dtype)
        return y.reshape(b, spec.output_per_emb, spec.emb_dim)
    if kind == "CONVOLUTION":
        conv = p["conv"]
        z = jax.lax.conv_general_dilated(z[..., None], conv["kernel"].astype(dtype), (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))[..., 0]
        z = z + conv["bias"].astype(dtype)
    tokens = dense(p["fc"], z, dtype).transpose(0, 2, 1)
    return encoder(p["encoder"], tokens, dtype) if kind == "ATTENTION" else tokens


def forward(spec: ModelSpec, params: Params, x: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The model output, B x (D * n_last * O)."""
    prev_in, prev_out = x, None
    for i, kinds in enumerate(spec.tokens):
        p = params[f"layer_{i}"]
        z = prev_in
        if i > 0:
            f_in, skip = layer_widths(spec, i)
            z = prev_out + (dense(p["skip"], prev_in, dtype) if skip != f_in else prev_in)
        tokens = [mixer(kind, p[f"mixer_{j}_{kind.lower()}"], z, spec, dtype) for j, kind in enumerate(kinds)]
        prev_in, prev_out = z, layer_norm(p["norm"], jnp.concatenate(tokens, axis=1), dtype).transpose(0, 2, 1)
    return prev_out.reshape(x.shape[0], -1)


def loss(spec: ModelSpec, params: Params, x: jax.Array, y: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Mean squared error; inputs cast to dtype, the error taken in fp32."""
    out = forward(spec, params, x.astype(dtype), dtype).astype(jnp.float32)
    return jnp.mean((out - y) ** 2)


def make_step(spec: ModelSpec, learning_rate: float, dtype) -> tuple[optax.GradientTransformation, Callable]:
    """(optimizer, step): step(params, opt_state, x, y) -> (params, opt_state, loss), jitted with
    parameters and optimizer state donated."""
    optimizer = optax.adam(learning_rate)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(lambda p: loss(spec, p, x, y, dtype))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return optimizer, jax.jit(step, donate_argnums=(0, 1))
