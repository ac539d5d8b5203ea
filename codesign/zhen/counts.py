"""ZHEN's analytical counts: parameters, FLOPs and widths, from the spec alone.

No arrays are built, so the model search prices millions of candidates and the planner
prices plans without JAX; tests check every figure against the built Flax model.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from codesign.config.types import ModelSpec
from codesign.families.work import Gemm, Work

DOT_HIDDEN = 512
FFN_HIDDEN = 2048
CONV_KERNEL = 5
FOLD_BLOCKS = 8  # at most this many feature blocks in the folded DOT mixer


def feature_widths(num_features: int, out: int, mixers_per_layer: Sequence[int], i: int) -> tuple[int, int]:
    """(F_in(i), S(i)) of layer i when layer j holds mixers_per_layer[j] mixers."""
    f_in = num_features if i == 0 else mixers_per_layer[i - 1] * out
    skip = num_features if i <= 1 else mixers_per_layer[i - 2] * out
    return f_in, skip


def layer_widths(spec: ModelSpec, i: int) -> tuple[int, int]:
    """(F_in(i), S(i)): the layer's input feature width and its skip input width."""
    return feature_widths(spec.num_features, spec.output_per_emb, [len(t) for t in spec.tokens], i)


def output_width(spec: ModelSpec) -> int:
    return spec.emb_dim * len(spec.tokens[-1]) * spec.output_per_emb


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


def layer_shared_params(i: int, f_in: int, skip: int, emb: int) -> int:
    """Layer i's parameters outside its mixers: the skip projection (when widths differ), LayerNorm."""
    proj = skip * f_in + f_in if (i > 0 and skip != f_in) else 0
    return proj + 2 * emb


def layer_param_count(spec: ModelSpec, i: int) -> int:
    f_in, skip = layer_widths(spec, i)
    o, d = spec.output_per_emb, spec.emb_dim
    return layer_shared_params(i, f_in, skip, d) + sum(mixer_params(m, f_in, o, d) for m in spec.tokens[i])


def param_count(spec: ModelSpec) -> int:
    return sum(layer_param_count(spec, i) for i in range(spec.num_zhen_layers))


def fold_blocks(f_in: int) -> int:
    """k, the blocks the folded DOT mixer splits F_in into: the largest k <= FOLD_BLOCKS dividing F_in."""
    return max(k for k in range(1, FOLD_BLOCKS + 1) if f_in % k == 0)


def folded_pairs(f_in: int) -> int:
    """Gram entries the folded DOT mixer computes: its k(k+1)/2 blocks on and above the diagonal."""
    k = fold_blocks(f_in)
    return (f_in // k) ** 2 * k * (k + 1) // 2


def mixer_flops(kind: str, f_in: int, out: int, emb: int, fold_dot: bool = False) -> int:
    """Forward matmul and convolution FLOPs (2 per multiply-add) of one mixer, per sample.

    By default the model's own FLOPs (the DOT mixer's Gram and FC over all F_in^2 pairs), what
    throughput figures are quoted in; fold_dot=True counts what the folded DOT executes.
    """
    fc = 2 * emb * f_in * out
    if kind == "DOT":
        pairs = folded_pairs(f_in) if fold_dot else f_in * f_in
        return 2 * emb * pairs + 2 * pairs * DOT_HIDDEN + 2 * DOT_HIDDEN * out * emb
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


def op_reduced(out: int, emb: int) -> int:
    """Elements per sample that op's all-reduce of one sharded mixer carries: its output, O x D."""
    return out * emb


def mixer_work(kind: str, f_in: int, out: int, emb: int, fold_dot: bool = False, first: bool = False) -> Work:
    """Per-sample work of one mixer as the engine runs it (fold_dot: the DOT over the Gram's
    upper blocks). Activations: DOT keeps its Gram matrix (the upper blocks when folded), its
    hidden layer and its output; attention its tokens, q/k/v, scores and softmax, the FFN's
    hidden layer and the norms' inputs and outputs; convolution its input and output planes.
    In the first layer (`first`) the backward skips the input's gradient, as the step
    differentiates the parameters alone and that input is the data: the DOT's Gram gradient
    and z's, the feature FC's or the convolution's input gradient."""
    work = _mixer_work(kind, f_in, out, emb, fold_dot)
    return replace(work, skipped_backward=input_gradient_flops(kind, f_in, out, emb, fold_dot)) if first else work


def input_gradient_flops(kind: str, f_in: int, out: int, emb: int, fold_dot: bool = False) -> int:
    """Backward FLOPs per sample that only the mixer's input gradient needs: the DOT's Gram
    gradient and then z's; the convolution's taps, transposed; else the feature FC's."""
    if kind == "DOT":
        pairs = folded_pairs(f_in) if fold_dot else f_in * f_in
        return 2 * pairs * DOT_HIDDEN + 2 * emb * pairs
    if kind == "CONVOLUTION":
        return 2 * CONV_KERNEL * CONV_KERNEL * emb * f_in
    return 2 * emb * f_in * out


def layer_mixers(spec: ModelSpec, i: int, fold_dot: bool = False) -> tuple[tuple[str, Work], ...]:
    """Layer i's mixers, (kind, work) each, the first layer's without its input gradients."""
    f_in, _ = layer_widths(spec, i)
    return tuple((m, mixer_work(m, f_in, spec.output_per_emb, spec.emb_dim, fold_dot, i == 0))
                 for m in spec.tokens[i])


def _mixer_work(kind: str, f_in: int, out: int, emb: int, fold_dot: bool) -> Work:
    flops, params, od = mixer_flops(kind, f_in, out, emb, fold_dot), mixer_params(kind, f_in, out, emb), out * emb
    if kind == "DOT":
        pairs = folded_pairs(f_in) if fold_dot else f_in * f_in
        sharded = 2 * pairs * DOT_HIDDEN + 2 * DOT_HIDDEN * od
        return Work(flops, sharded, params, f_in * f_in * DOT_HIDDEN + DOT_HIDDEN + DOT_HIDDEN * od,
                    pairs + DOT_HIDDEN + od, DOT_HIDDEN, 4,
                    f_in * f_in * DOT_HIDDEN if fold_dot else 0, pairs * DOT_HIDDEN if fold_dot else 0, DOT_HIDDEN,
                    reduced=op_reduced(out, emb))
    if kind == "ATTENTION":
        ffn = 2 * 2 * od * FFN_HIDDEN
        return Work(flops, ffn, params, 2 * emb * FFN_HIDDEN + FFN_HIDDEN,
                    12 * od + 2 * out * out + out * FFN_HIDDEN, out * FFN_HIDDEN, 13, relu=out * FFN_HIDDEN,
                    reduced=op_reduced(out, emb))
    if kind == "CONVOLUTION":
        return Work(flops, 0, params, 0, 2 * emb * f_in + od, 0, 4)
    return Work(flops, 0, params, 0, od, 0, 2)


def layer_own_work(spec: ModelSpec, i: int) -> Work:
    """Layer i's work outside its mixers: the skip projection, the token concat and LayerNorm."""
    f_in, skip = layer_widths(spec, i)
    o, d, n = spec.output_per_emb, spec.emb_dim, len(spec.tokens[i])
    proj = i > 0 and skip != f_in
    return Work(flops=2 * d * skip * f_in if proj else 0, params=layer_shared_params(i, f_in, skip, d),
                activations=(d * f_in if i > 0 else 0) + (d * f_in if proj else 0) + 2 * n * o * d,
                tensors=4 if proj else 2)


def layer_work(spec: ModelSpec, i: int, fold_dot: bool = False) -> Work:
    """Layer i: its mixers and its own work."""
    return sum((work for _, work in layer_mixers(spec, i, fold_dot)), layer_own_work(spec, i))


def carry_width(spec: ModelSpec, i: int) -> int:
    """Elements per sample of the carry layer i hands on: (its input z, its output)."""
    f_in, _ = layer_widths(spec, i)
    return spec.emb_dim * (f_in + len(spec.tokens[i]) * spec.output_per_emb)


def input_width(spec: ModelSpec) -> int:
    return spec.emb_dim * spec.num_features


def mixer_gemms(kind: str, f_in: int, out: int, emb: int, fold_dot: bool = False) -> tuple[Gemm, ...]:
    """A mixer's matmuls, as the engine runs them (their FLOPs sum to mixer_flops; a convolution's
    taps are not a matmul: its FLOPs outside these)."""
    fc = Gemm(emb, out, f_in, input_facing=True)  # the feature FC: [b*D, F_in] @ [F_in, O]
    if kind == "DOT":
        k = fold_blocks(f_in) if fold_dot else 1
        pairs = folded_pairs(f_in) if fold_dot else f_in * f_in
        gram = Gemm(k * (k + 1) // 2 * (f_in // k), f_in // k, emb, input_facing=True)  # z z^T, by blocks
        return (gram, Gemm(1, DOT_HIDDEN, pairs, "n", True), Gemm(1, out * emb, DOT_HIDDEN, "k"))
    if kind == "ATTENTION":
        return (fc, Gemm(out, 3 * emb, emb), Gemm(out, out, emb), Gemm(out, emb, out), Gemm(out, emb, emb),
                Gemm(out, FFN_HIDDEN, emb, "n"), Gemm(out, emb, FFN_HIDDEN, "k"))
    if kind == "CONVOLUTION":  # its taps read the input: the FC after them is not input-facing
        return (Gemm(emb, out, f_in),)
    return (fc,)


def layer_gemms(spec: ModelSpec, i: int, fold_dot: bool = False) -> tuple[tuple[Gemm, ...], ...]:
    """Layer i's mixers' matmuls, in layer_mixers' order."""
    f_in, _ = layer_widths(spec, i)
    return tuple(mixer_gemms(m, f_in, spec.output_per_emb, spec.emb_dim, fold_dot) for m in spec.tokens[i])


def layer_own_gemms(spec: ModelSpec, i: int) -> tuple[Gemm, ...]:
    """Layer i's own matmul: the skip projection, where the widths differ."""
    f_in, skip = layer_widths(spec, i)
    return (Gemm(spec.emb_dim, f_in, skip),) if i > 0 and skip != f_in else ()


def op_widths(spec: ModelSpec) -> int:
    """What op shards (the DOT and FFN hidden widths): op must divide it evenly."""
    return math.gcd(DOT_HIDDEN, FFN_HIDDEN)
