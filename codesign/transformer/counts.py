"""The transformer family's analytical counts: parameters, FLOPs, GEMM shapes and activations.

Layer i is a pre-LayerNorm block of self-attention then an MLP, each a "mixer" in the cost
model's terms: op shards it Megatron-style (column-parallel QKV and first FC, row-parallel
output projection and second FC, attention by heads), and all-reduces its output over op once
forward and once backward. Layer 0 also embeds the tokens (vocabulary-parallel) and positions;
the last layer adds the final LayerNorm and the vocabulary's logits (an untied head,
vocabulary-parallel). Activations follow Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (arXiv 2205.05198), section 4.1, less dropout, which the engine does not run.
"""

from __future__ import annotations

import math

from codesign.config.types import TransformerSpec
from codesign.families.work import Gemm, Work

ATTENTION, MLP, HEAD = "SELF_ATTENTION", "MLP", "LM_HEAD"  # the engine's calls, as the cost model prices them


def attention_work(t: TransformerSpec) -> Work:
    """Per sequence: LayerNorm, QKV, scores, softmax, context, output projection. Kept for the
    backward (Korthikanti's 11sbh + 5as^2b bytes in 16-bit, without the dropouts' 1sbh + 3as^2b):
    the LayerNorm's and QKV's inputs, Q, K, V, the softmax output and the projection's input."""
    s, h, a = t.seq_len, t.hidden, t.heads
    flops = sum(g.flops for g in attention_gemms(t))
    return Work(flops=flops, sharded_flops=flops, params=4 * h * h + 4 * h + 2 * h, sharded_params=4 * h * h + 3 * h,
                activations=6 * s * h + a * s * s, sharded_activations=4 * s * h + a * s * s, tensors=6,
                reduced=s * h)


def mlp_work(t: TransformerSpec) -> Work:
    """Per sequence: LayerNorm, FC, GELU, FC. Kept: the LayerNorm's and first FC's inputs, the
    GELU's input and output (Korthikanti's 19sbh bytes, less the dropout mask's sbh)."""
    s, h, f = t.seq_len, t.hidden, t.ffn_hidden
    flops = sum(g.flops for g in mlp_gemms(t))
    return Work(flops=flops, sharded_flops=flops, params=2 * h * f + f + h + 2 * h, sharded_params=2 * h * f + f,
                activations=2 * s * h + 2 * s * f, sharded_activations=2 * s * f, tensors=6, reduced=s * h)


def head_work(t: TransformerSpec) -> Work:
    """The logits over the vocabulary (sharded by it), kept for the loss's backward; op
    all-reduces only each token's maximum and sum for the softmax."""
    s, h, v = t.seq_len, t.hidden, t.vocab
    flops = 2 * s * h * v
    return Work(flops=flops, sharded_flops=flops, params=v * h, sharded_params=v * h,
                activations=s * h + s * v, sharded_activations=s * v, tensors=1, reduced=2 * s)


def attention_gemms(t: TransformerSpec) -> tuple[Gemm, ...]:
    s, h, a, d = t.seq_len, t.hidden, t.heads, t.head_dim
    return (Gemm(s, 3 * h, h, "n"), Gemm(a * s, s, d, "m"), Gemm(a * s, d, s, "m"), Gemm(s, h, h, "k"))


def mlp_gemms(t: TransformerSpec) -> tuple[Gemm, ...]:
    s, h, f = t.seq_len, t.hidden, t.ffn_hidden
    return (Gemm(s, f, h, "n"), Gemm(s, h, f, "k"))


def _last(t: TransformerSpec, i: int) -> bool:
    return i == t.num_layers - 1


def layer_mixers(t: TransformerSpec, i: int, fold_dot: bool = False) -> tuple[tuple[str, Work], ...]:
    mixers = ((ATTENTION, attention_work(t)), (MLP, mlp_work(t)))
    return mixers + (((HEAD, head_work(t)),) if _last(t, i) else ())


def layer_gemms(t: TransformerSpec, i: int, fold_dot: bool = False) -> tuple[tuple[Gemm, ...], ...]:
    gemms = (attention_gemms(t), mlp_gemms(t))
    return gemms + (((Gemm(t.seq_len, t.vocab, t.hidden, "n"),),) if _last(t, i) else ())


def layer_own_work(t: TransformerSpec, i: int) -> Work:
    """Layer 0's embeddings (tokens sharded by vocabulary, positions whole); the last layer's
    final LayerNorm; and every layer's two residual sums, outside its mixers."""
    s, h = t.seq_len, t.hidden
    own = Work()
    if i == 0:
        own += Work(params=t.vocab * h + s * h, sharded_params=t.vocab * h, activations=s * h, tensors=2)
    if _last(t, i):
        own += Work(params=2 * h, activations=s * h, tensors=2)
    return own


def layer_own_gemms(t: TransformerSpec, i: int) -> tuple[Gemm, ...]:
    return ()


def layer_work(t: TransformerSpec, i: int, fold_dot: bool = False) -> Work:
    return sum((work for _, work in layer_mixers(t, i)), layer_own_work(t, i))


def layer_flops(t: TransformerSpec, i: int, fold_dot: bool = False) -> int:
    return layer_work(t, i).flops


def forward_flops_per_sample(t: TransformerSpec, fold_dot: bool = False) -> int:
    return sum(layer_flops(t, i) for i in range(t.num_layers))


def train_flops_per_sample(t: TransformerSpec) -> int:
    """Forward plus backward (twice the forward), per sequence."""
    return 3 * forward_flops_per_sample(t)


def layer_param_count(t: TransformerSpec, i: int) -> int:
    return layer_work(t, i).params


def param_count(t: TransformerSpec) -> int:
    return sum(layer_param_count(t, i) for i in range(t.num_layers))


def megatron_flops_per_sample(t: TransformerSpec, recompute: bool = True) -> float:
    """The FLOPs per sequence that Megatron-LM quotes throughput in (Narayanan et al., SC'21,
    arXiv 2104.04473, section 5.1): 96 s l h^2 (1 + s / 6h + V / 16lh) with full activation
    recomputation (four passes of the blocks) and a 4h MLP; without it, three passes, as NVIDIA's
    NeMo benchmarks count them (72 s l h^2 (1 + s / 6h) + 6 s V h)."""
    s, l, h, v = t.seq_len, t.num_layers, t.hidden, t.vocab
    return (4 if recompute else 3) * 24 * s * l * h * h * (1 + s / (6 * h)) + 6 * s * v * h


def carry_width(t: TransformerSpec, i: int) -> int:
    """Elements per sequence that layer i hands on: its hidden states."""
    return t.seq_len * t.hidden


def input_width(t: TransformerSpec) -> int:
    """Per sequence: its token ids (int32)."""
    return t.seq_len


def output_width(t: TransformerSpec) -> int:
    """Per sequence: its target token ids (int32)."""
    return t.seq_len


def op_widths(t: TransformerSpec) -> int:
    """What op shards (heads, the MLP's width, the vocabulary): op must divide it evenly."""
    return math.gcd(t.heads, t.ffn_hidden, t.vocab)
