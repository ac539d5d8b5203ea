"""The transformer's Flax network (codesign.transformer.network) against its counts, and every
plan kind it trains under on virtual CPU devices against the single-device reference, as ZHEN's
plans are checked (tests/test_parallel_equivalence.py, tests/test_pipeline.py): dp, op (Megatron
tensor parallelism), dp x op, ZeRO-2, remat per layer, pp under 1F1B and GPipe, pp x dp x op."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from codesign import families
from codesign.config.types import ClusterSpec, Job, ParallelSpec, TrainingSpec, TransformerSpec
from codesign.engine import programs
from codesign.engine.options import engine_options
from codesign.transformer import counts, network
from tests.conftest import run_on_devices
from tests.reference import assert_matches

TINY = TransformerSpec(num_layers=4, hidden=32, heads=4, seq_len=16, vocab=128, ffn=64)
CPU = engine_options("cpu", "fp32")

# Megatron-LM's split dims, the "mlp" logical axis the plan's rules put on op
SHARDED = {"attention/qkv_kernel", "attention/qkv_bias", "attention/out_kernel", "mlp/fc1/kernel", "mlp/fc1/bias",
           "mlp/fc2/kernel", "token_embedding", "head"}

SCRIPT = """
import json, sys
from codesign.config.types import ClusterSpec, Job, ParallelSpec, TrainingSpec, TransformerSpec
from codesign.cost.plan import make_plan
from codesign.engine import programs
from tests.reference import differences, live_leaves, two_steps

model = TransformerSpec(num_layers=4, hidden=32, heads=4, seq_len=16, vocab=128, ffn=64)
ZERO2 = (("prefer_reduce_scatter", True),)

def job(devices, pp_dp_op, micro, options=(), remat=False, schedule="1F1B", groups=None):
    parallel = ParallelSpec("test", (micro,), groups or pp_dp_op[0], remat, pp_dp_op, None, options,
                            pipeline_schedule=schedule)
    return Job(model, ClusterSpec(1, devices, "NVLink", "cpu"), TrainingSpec(0, 2, global_batch_size=16),
               parallel, micro, "cpu")

def described(j):
    # the shardings the engine reports for each stage's parameters (all_configs), nothing compiled
    plan = make_plan(j)
    return [programs.describe_shardings(shardings, programs.gradient_shardings(plan, shardings, abstract))
            for stage in plan.stages
            for abstract, shardings in [programs.stage_parameters(j, plan, stage, programs.stage_mesh(stage))]]

reference = two_steps(job(1, (1, 1, 1), 1))
live = live_leaves(reference)
cases = {"dp2 mb2": job(2, (1, 2, 1), 2), "op2": job(2, (1, 1, 2), 1), "dp2xop2 mb2": job(4, (1, 2, 2), 2),
         "dp2xop2 mb2 zero2": job(4, (1, 2, 2), 2, ZERO2),
         "op2 mb2 remat per layer": job(2, (1, 1, 2), 2, remat=True, groups=4),
         "pp2 mb2 1F1B": job(2, (2, 1, 1), 2), "pp2 mb2 GPipe": job(2, (2, 1, 1), 2, schedule="GPipe"),
         "pp2 dp2xop2 mb2": job(8, (2, 2, 2), 2)}
result, params = {}, {}
for name, j in cases.items():
    run = two_steps(j)
    params[name] = run["params"]
    result[name] = differences(run, reference, live)
    print(name, result[name], file=sys.stderr, flush=True)
gpipe = max(float(abs(a - b).max()) for a, b in zip(params["pp2 mb2 GPipe"], params["pp2 mb2 1F1B"]))
shardings = {"op2": described(cases["op2"]), "dp2xop2 zero2": described(cases["dp2xop2 mb2 zero2"]),
             "pp2 dp2xop2": described(cases["pp2 dp2xop2 mb2"])}
print(json.dumps({"ref": reference["losses"], "live": sum(live), "leaves": len(live), "cases": result,
                  "gpipe_vs_1f1b": gpipe, "shardings": shardings}))
"""


def test_each_layer_has_the_parameters_its_counts_say():
    """Per layer, the Flax model's parameters are counts.layer_param_count (embeddings in layer 0,
    the final LayerNorm and the untied head in the last, a one-layer model holding both), and
    those on the "mlp" axis, which op splits, are the counts' sharded parameters."""
    for spec in (TINY, TransformerSpec(1, 48, 6, 8, 96), TransformerSpec(3, 32, 2, 12, 64, causal=False)):
        boxed = jax.eval_shape(lambda k, spec=spec: network.init_params(spec, k), jax.random.key(0))
        assert list(boxed) == [f"layer_{i}" for i in range(spec.num_layers)]
        for i in range(spec.num_layers):
            layer = boxed[f"layer_{i}"]
            sizes = [a.size for a in jax.tree.leaves(nn.meta.unbox(layer))]
            axes = jax.tree.leaves(nn.get_partition_spec(layer), is_leaf=lambda s: isinstance(s, PartitionSpec))
            assert sum(sizes) == counts.layer_param_count(spec, i), (spec, i)
            assert sum(n for n, a in zip(sizes, axes) if "mlp" in a) == counts.layer_work(spec, i).sharded_params
        assert sum(a.size for a in jax.tree.leaves(nn.meta.unbox(boxed))) == counts.param_count(spec)
    assert families.network(TINY) is network


def test_a_stage_initialises_its_layers_as_the_whole_model_does():
    whole = nn.meta.unbox(network.init_params(TINY, jax.random.key(3)))
    stage = nn.meta.unbox(network.init_params(TINY, jax.random.key(3), layers=(2, 3)))
    assert list(stage) == ["layer_2", "layer_3"]
    for a, b in zip(jax.tree.leaves(stage), jax.tree.leaves([whole["layer_2"], whole["layer_3"]])):
        assert jnp.array_equal(a, b)


def test_a_decoder_sees_no_later_token_and_an_encoder_sees_them_all():
    x = jax.random.randint(jax.random.key(1), (2, TINY.seq_len), 0, TINY.vocab)
    later = x.at[:, 10:].set((x[:, 10:] + 1) % TINY.vocab)  # other tokens from position 10 on
    for causal in (True, False):
        spec = TransformerSpec(2, 32, 4, 16, 128, 64, causal=causal)
        params = nn.meta.unbox(network.init_params(spec, jax.random.key(0)))
        a, b = (network.forward(spec, params, ids, CPU) for ids in (x, later))
        assert a.shape == (2, spec.seq_len, spec.vocab)
        assert bool(jnp.allclose(a[:, :10], b[:, :10], atol=1e-6)) == causal
        assert not jnp.allclose(a[:, 10:], b[:, 10:], atol=1e-6)


def test_the_batch_is_token_ids_and_the_loss_their_mean_cross_entropy():
    job = Job(TINY, ClusterSpec(1, 1, "NVLink", "cpu"), TrainingSpec(0, 2, global_batch_size=8, precision="bf16"),
              ParallelSpec("test", (2,), 1, False, (1, 1, 1)), 2, "cpu")
    x, y = programs.batch_shapes(job, 2)
    # token ids, int32 in any precision
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((2, 4, 16), jnp.int32, (2, 4, 16), jnp.int32)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    xs, ys = programs.synthetic_batch(job, 2, one, one)
    assert xs.dtype == ys.dtype == jnp.int32 and xs.shape == ys.shape == (2, 4, 16)
    assert 0 <= int(xs.min()) and int(xs.max()) < TINY.vocab and not jnp.array_equal(xs, ys)
    ids = xs[0]
    assert programs.input_carry(ids, jnp.bfloat16) == (ids, None)  # ids are not cast to the compute precision
    logits = jax.random.normal(jax.random.key(0), (4, 16, TINY.vocab), jnp.bfloat16)
    expected = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), ys[0][..., None], -1))
    assert programs.loss(job, logits, ys[0]).dtype == jnp.float32
    assert jnp.allclose(programs.loss(job, logits, ys[0]), expected, rtol=1e-6)


def test_in_bf16_the_loss_starts_near_uniform_and_the_gradients_are_fp32_and_finite():
    params = nn.meta.unbox(network.init_params(TINY, jax.random.key(0)))
    x = jax.random.randint(jax.random.key(1), (4, TINY.seq_len), 0, TINY.vocab)

    def loss(p):
        return network.loss(network.forward(TINY, p, x, CPU, dtype=jnp.bfloat16), x)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert abs(float(value) - float(jnp.log(TINY.vocab))) < 0.1  # near uniform at initialisation
    assert all(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_every_plan_kind_matches_the_single_device_reference():
    out = json.loads(run_on_devices(8, SCRIPT).stdout.strip().splitlines()[-1])
    assert out["ref"][1] < out["ref"][0]  # the reference itself trains
    assert out["live"] == out["leaves"]  # pre-LayerNorm: no bias is cancelled, every gradient counts
    assert len(out["cases"]) == 8
    print(json.dumps(out["cases"], indent=0))  # the measured differences, shown with pytest -s
    for name, diff in out["cases"].items():
        assert_matches(name, diff)
    assert out["gpipe_vs_1f1b"] == 0.0  # the schedule only orders the dispatch

    def sharded_on(described, axis):
        return {path.split("/", 1)[1] for path, spec in described["params"].items() if f"'{axis}'" in spec}

    (op2,) = out["shardings"]["op2"]
    assert sharded_on(op2, "op") == SHARDED  # Megatron's column- and row-parallel dims, the vocabulary's
    assert all("'" not in spec for path, spec in op2["params"].items() if path.split("/", 1)[1] not in SHARDED)
    assert op2["optimizer_state"] == "like params"
    (zero2,) = out["shardings"]["dp2xop2 zero2"]
    assert sharded_on(zero2, "op") == SHARDED and zero2["optimizer_state"] == "ZeRO-2: scattered over dp"
    assert zero2["gradients_and_moments"] and all("'dp'" in s for s in zero2["gradients_and_moments"].values())
    first, last = out["shardings"]["pp2 dp2xop2"]  # layers 0-1, then 2-3: the embeddings first, the head last
    assert {p.split("/")[0] for p in first["params"]} == {"layer_0", "layer_1"}
    assert "layer_0/token_embedding" in first["params"] and "layer_3/head" in last["params"]
    assert sharded_on(first, "op") == SHARDED - {"head"} and sharded_on(last, "op") == SHARDED - {"token_embedding"}
