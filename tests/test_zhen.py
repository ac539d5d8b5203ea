import dataclasses
import math
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from codesign.engine import programs
from codesign.engine.job import build_training
from codesign.engine.options import engine_options
from codesign.cost.plan import make_plan
from codesign.config.types import (
    MIXERS,
    ClusterSpec,
    Job,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
)
from codesign.zhen import counts, network
from tests.reference import built_param_count

SEED = ModelSpec(512, 160, 20, 4, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4)
CPU = engine_options("cpu", "fp32")  # the model as this machine's engine builds it


def matmul_flops(spec: ModelSpec, fold_dot: bool) -> int:
    """FLOPs of every dot_general and convolution tap in the forward jaxpr, per sample."""
    params = nn.meta.unbox(jax.eval_shape(lambda k: network.init_params(spec, k), jax.random.key(0)))
    x = jax.ShapeDtypeStruct((1, spec.emb_dim, spec.num_features), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda p, x: network.forward(spec, p, x, CPU, fold_dot=fold_dot))(params, x)
    total = 0

    def walk(jx):
        nonlocal total
        for eqn in jx.eqns:
            out = eqn.outvars[0].aval
            if eqn.primitive.name == "dot_general":
                (lhs_contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                total += 2 * out.size * math.prod(lhs[d] for d in lhs_contract)
            elif eqn.primitive.name == "mul" and min(v.aval.ndim for v in eqn.invars) == 0 and out.ndim == 3:
                total += 2 * out.size  # a convolution tap (network.SameConv): one multiply-add per output
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jaxpr.jaxpr)
    return total


def random_spec(rng: random.Random) -> ModelSpec:
    layers = rng.randint(1, 4)
    tokens = tuple(tuple(rng.choice(MIXERS) for _ in range(rng.randint(1, 4))) for _ in range(layers))
    return ModelSpec(rng.randint(2, 40), rng.randint(2, 24), rng.randint(1, 8), layers, tokens)


def test_seed_model_has_independent_mixer_parameters():
    assert counts.param_count(SEED) == 156_790_400
    assert built_param_count(SEED) == 156_790_400


@pytest.mark.parametrize("seed", range(12))
def test_analytical_counts_equal_the_built_model(seed):
    """The model's FLOPs as CPU builds it (its encoder FFNs as Dense layers, no bias in the matmul)."""
    spec = random_spec(random.Random(seed))
    assert counts.param_count(spec) == built_param_count(spec)
    assert counts.forward_flops_per_sample(spec) == matmul_flops(spec, fold_dot=False)
    assert counts.forward_flops_per_sample(spec, fold_dot=True) == matmul_flops(spec, fold_dot=True)


def test_every_mixer_and_heterogeneous_layers_run():
    spec = ModelSpec(12, 6, 3, 3, (("DOT", "CONVOLUTION"), ("ATTENTION", "DOT"), ("LINEAR", "CONVOLUTION", "LINEAR")))
    params = nn.meta.unbox(network.init_params(spec, jax.random.key(0)))
    out = network.forward(spec, params, jnp.ones((5, 6, 12)), CPU)
    assert out.shape == (5, counts.output_width(spec)) == (5, 6 * 3 * 3)
    assert {k.split("_", 2)[2] for k in params["layer_1"] if k.startswith("mixer")} == {"attention", "dot"}
    assert "skip" in params["layer_1"] and "skip" not in params["layer_2"]  # S: 12 -> F_in 6; then 6 -> 6
    assert set(params) == {"layer_0", "layer_1", "layer_2"}


def test_the_ffn_bias_added_in_its_matmul_is_a_dense_with_the_same_parameters_and_function():
    """bias_in_matmul (a GPU's option): the encoders' first FFN a BiasInMatmulDense, its bias riding
    in the matmul ([x, 1, 0..] @ [kernel; bias; 0..], padded to 8), with a Dense's parameter tree and
    initial values, as many dots, and its loss and gradients to rounding; without it (CPU's) a Dense."""
    spec = ModelSpec(12, 8, 3, 2, (("ATTENTION", "LINEAR", "ATTENTION", "DOT"), ("ATTENTION", "LINEAR")))
    x = jax.random.normal(jax.random.key(2), (4, 8, 12))
    params = nn.meta.unbox(network.init_params(spec, jax.random.key(1)))
    moved = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(5), p.shape), params)

    def run(in_matmul):
        options = dataclasses.replace(CPU, bias_in_matmul=in_matmul)
        grad = jax.jit(jax.value_and_grad(lambda p: jnp.mean(network.forward(spec, p, x, options) ** 2)))
        return grad(moved), grad.lower(moved).compile().as_text().count(" dot(")

    ((loss, grads), dots), ((plain_loss, plain_grads), plain_dots) = run(True), run(False)
    assert dots == plain_dots and abs(loss - plain_loss) <= 1e-6 * abs(plain_loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        assert jnp.allclose(a, b, rtol=1e-4, atol=1e-6)

    z, kernel, bias = (jax.random.normal(jax.random.key(k), shape) for k, shape in
                       ((6, (2, 5, 8)), (7, (8, 32)), (8, (32,))))
    assert jnp.allclose(network.bias_in_matmul(z, kernel, bias), z @ kernel + bias, rtol=1e-5, atol=1e-5)
    assert "x16xf32" in jax.jit(network.bias_in_matmul).lower(z, kernel, bias).as_text()  # 8 + the ones, padded
    layers = {name: network.EncoderLayer(options) for name, options in (("gpu", engine_options("gpu", "fp32")),
                                                                          ("cpu", CPU))}
    variables = layers["cpu"].init(jax.random.key(0), z)
    lowered = {name: jax.jit(layer.apply).lower(variables, z).as_text() for name, layer in layers.items()}
    assert "x16xf32" in lowered["gpu"] and "x16xf32" not in lowered["cpu"]


def test_repeated_mixers_have_their_own_weights():
    spec = ModelSpec(8, 4, 2, 1, (("LINEAR", "LINEAR"),))
    params = nn.meta.unbox(network.init_params(spec, jax.random.key(0)))["layer_0"]
    a, b = params["mixer_0_linear"]["fc"]["kernel"], params["mixer_1_linear"]["fc"]["kernel"]
    assert not jnp.allclose(a, b)


def test_a_layers_encoders_run_as_one_vmapped_encoder_with_the_same_function():
    """Three ATTENTION mixers between others: one batched encoder per layer (a third of the dots),
    the same loss and gradients as the encoders run one after another, and each mixer its own weights."""
    spec = ModelSpec(12, 8, 3, 2, (("ATTENTION", "LINEAR", "ATTENTION", "DOT", "ATTENTION"), ("ATTENTION", "LINEAR")))
    params = nn.meta.unbox(network.init_params(spec, jax.random.key(1)))
    x = jax.random.normal(jax.random.key(2), (4, 8, 12))

    def run(batched):
        options = dataclasses.replace(CPU, batch_encoders=batched)
        grad = jax.jit(jax.value_and_grad(lambda p: jnp.mean(network.forward(spec, p, x, options) ** 2)))
        dots = grad.lower(params).as_text().count("dot_general")
        return grad(params), dots

    ((batched, g_batched), dots_batched), ((serial, g_serial), dots_serial) = run(True), run(False)
    assert abs(batched - serial) < 1e-6 * abs(serial)
    # a leaf whose gradient is 0 but for rounding (1e-15) is held to the largest gradient's scale
    largest = max(jnp.max(jnp.abs(b)) for b in jax.tree.leaves(g_serial))
    for a, b in zip(jax.tree.leaves(g_batched), jax.tree.leaves(g_serial)):
        assert jnp.max(jnp.abs(a - b)) <= 1e-5 * jnp.max(jnp.abs(b)) + 1e-7 * largest
    encoder_dots = 18  # 6 forward dots (qkv, scores, values, out, ffn1, ffn2), 2 gradients each
    assert dots_serial - dots_batched == 2 * encoder_dots  # layer 0: 3 encoders -> 1; layer 1: 1 already
    enc = [params["layer_0"][f"mixer_{j}_attention"]["encoder"]["qkv"]["kernel"] for j in (0, 2, 4)]
    assert not jnp.allclose(enc[0], enc[1]) and not jnp.allclose(enc[1], enc[2])


@pytest.mark.parametrize("f_in, tokens", [(24, (("DOT", "LINEAR"), ("DOT", "DOT"))),  # 8 blocks of 3
                                           (7, (("DOT",),))])  # 7 blocks of 1: the exact triangle
@pytest.mark.slow
def test_folded_dot_is_the_same_function_with_fewer_flops(f_in, tokens):
    spec = ModelSpec(f_in, 8, 3, len(tokens), tokens)
    params = nn.meta.unbox(network.init_params(spec, jax.random.key(1)))
    x = jax.random.normal(jax.random.key(2), (4, 8, f_in))

    def loss(p, fold):
        return jnp.mean(network.forward(spec, p, x, CPU, fold_dot=fold) ** 2)

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (folded, g_folded), (plain, g_plain) = (grad(params, f) for f in (True, False))
    assert abs(folded - plain) < 1e-5 * abs(plain)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_plain))
    for a, b in zip(jax.tree.leaves(g_folded), jax.tree.leaves(g_plain)):
        assert jnp.max(jnp.abs(a - b)) <= 1e-5 * scale


def test_folded_dot_saves_the_gram_and_fc1_work_below_the_diagonal_blocks():
    saved = counts.forward_flops_per_sample(SEED) - counts.forward_flops_per_sample(SEED, fold_dot=True)
    below = [512 * 512 - 64 * 64 * 36, 80 * 80 - 10 * 10 * 36]  # 8 blocks: 36 of 64 kept
    assert saved == sum(2 * n * (SEED.emb_dim + counts.DOT_HIDDEN) for n in below[:1] + below[1:] * 3)


@pytest.mark.parametrize("fold", [False, True])
def test_compiled_step_has_no_gather_or_scatter(fold):
    spec = ModelSpec(16, 4, 2, 2, (("DOT", "LINEAR"), ("DOT",)))
    job = Job(spec, ClusterSpec(1, 1, "NVLink", "cpu"), TrainingSpec(4, 2, precision="bf16", fold_dot=fold),
              ParallelSpec("single device", (1,), 1, False, (1, 1, 1)), 1, "cpu")
    ops = programs.compiled_op_counts(build_training(job, make_plan(job)).compiled)
    assert ops["dot"] > 0 and ops["fusion"] > 0
    assert (ops["gather"], ops["scatter"]) == (0, 0), ops


def _avals(jaxpr) -> list:
    """Output avals of every equation, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        found += [v.aval for v in eqn.outvars]
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _avals(inner)
    return found


@pytest.mark.parametrize("fold", [False, True])
def test_bf16_keeps_no_fp32_copy_of_the_gram_matrix(fold):
    spec = ModelSpec(48, 8, 2, 1, (("DOT",),))
    params = nn.meta.unbox(jax.eval_shape(lambda k: network.init_params(spec, k), jax.random.key(0)))
    x = jax.ShapeDtypeStruct((4, 8, 48), jnp.bfloat16)

    def loss(p, x):
        return jnp.mean(network.forward(spec, p, x, CPU, dtype=jnp.bfloat16, fold_dot=fold).astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
    big = {48 * 48} | {6 * (48 - 6 * i) for i in range(8)}  # per-sample Gram entries: all, folded row blocks
    gram_like = [a for a in _avals(jaxpr.jaxpr) if a.ndim >= 2 and a.shape[0] == 4 and math.prod(a.shape[1:]) in big]
    assert gram_like and all(a.dtype == jnp.bfloat16 for a in gram_like), gram_like


@pytest.mark.parametrize("spec", [SEED, ModelSpec(16, 8, 4, 3, (("DOT", "CONVOLUTION"), ("ATTENTION",), ("LINEAR", "DOT")))])
def test_layer_work_matches_the_built_layers(spec):
    """The cost model's per-layer counts: parameters, parameter arrays (one ZeRO-2 all-gather
    each on CPU) and the "mlp"-sharded parameters, against the built model's own tree."""
    boxed = jax.eval_shape(lambda k: network.init_params(spec, k), jax.random.key(0))
    specs = nn.get_partition_spec(boxed)
    params = nn.meta.unbox(boxed)
    for i in range(spec.num_zhen_layers):
        work = counts.layer_work(spec, i)
        leaves = jax.tree.leaves(params[f"layer_{i}"])
        axes = jax.tree.leaves(specs[f"layer_{i}"], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        assert work.params == sum(leaf.size for leaf in leaves)
        assert work.tensors == len(leaves)
        assert work.sharded_params == sum(leaf.size for leaf, a in zip(leaves, axes) if "mlp" in tuple(a))


@pytest.mark.parametrize("kind, low, within", [("DOT", 1.0, 0.05), ("ATTENTION", 1.0, 0.1), ("LINEAR", 1.0, 0.25),
                                               ("CONVOLUTION", 1 - 1 / 50, 0.5)])
def test_the_first_layers_skipped_backward_is_the_input_gradient_xla_leaves_out(kind, low, within):
    """The step differentiates the parameters alone, so the first layer's backward never computes
    its input's gradient: XLA's own FLOP count of that gradient (compiled with it, less without)
    against counts' skipped_backward (element-wise ops, which XLA counts too, make the small
    mixers' ratio larger; the convolution's written-out backward makes 25 products and 24 sums
    of the 50 FLOPs per element counted)."""
    spec = ModelSpec(16, 8, 4, 1, ((kind,),))
    params = nn.meta.unbox(network.init_params(spec, jax.random.key(0)))
    x = jnp.ones((32, 8, 16))

    def flops(argnums) -> float:
        loss = jax.grad(lambda p, x: jnp.sum(network.forward(spec, p, x, CPU)), argnums=argnums)
        found = jax.jit(loss).lower(params, x).compile().cost_analysis()
        return (found[0] if isinstance(found, list) else found)["flops"]

    skipped = 32 * counts.mixer_work(kind, 16, 4, 8, first=True).skipped_backward
    assert low <= (flops((0, 1)) - flops(0)) / skipped <= 1.0 + within
    assert counts.mixer_work(kind, 16, 4, 8).skipped_backward == 0  # later layers compute it


def _conv_loss_and_grads(one_reduction_sums: bool):
    """The loss of SameConv against a random cotangent, and its gradients, as lax.conv's."""
    z = jax.random.normal(jax.random.key(1), (6, 7, 9))
    cotangent = jax.random.normal(jax.random.key(2), (6, 7, 9))
    conv = network.SameConv(one_reduction_sums)
    params = nn.meta.unbox(conv.init(jax.random.key(0), z)["params"])
    params = {"kernel": params["kernel"], "bias": params["bias"] + 0.3}

    def own(p, z):
        return jnp.sum(conv.apply({"params": p}, z) * cotangent)

    def reference(p, z):
        y = jax.lax.conv_general_dilated(z[..., None], p["kernel"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))[..., 0] + p["bias"]
        return jnp.sum(y * cotangent)

    return [jax.value_and_grad(f, argnums=(0, 1))(params, z) for f in (own, reference)]


@pytest.mark.parametrize("one_reduction_sums", [True, False])  # CPU's option, a GPU's
def test_the_convolutions_written_out_backward_is_lax_convs_gradient(one_reduction_sums):
    """network.shifted_conv's custom VJP: z's, the kernel's and the bias's gradients as JAX
    differentiates lax.conv (and the loss as its forward), its sums in one reduction or one by one."""
    (own, own_grads), (ref, ref_grads) = _conv_loss_and_grads(one_reduction_sums)
    assert jnp.allclose(own, ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(own_grads), jax.tree.leaves(ref_grads)):
        assert a.shape == b.shape and jnp.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_the_convolutions_gradient_inside_shard_map_sums_the_shards():
    """With the batch split over two devices by shard_map, the replicated kernel's and bias's
    gradients come out replicated, the sum over the shards as JAX differentiates a broadcast
    (the custom VJP's are as varying as its cotangent; programs.varying_like's cast makes the
    sum), equal to the unsharded ones."""
    from tests.conftest import run_on_devices

    out = run_on_devices(2, """
        import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        from codesign.zhen import network
        z = jax.random.normal(jax.random.key(1), (4, 7, 9))
        conv = network.SameConv(one_reduction_sums=True)  # CPU's option
        params = nn.meta.unbox(conv.init(jax.random.key(0), z)["params"])
        loss = lambda p, z: jnp.sum(conv.apply({"params": p}, z) ** 2)
        mesh = Mesh(np.array(jax.devices()), ("d",))
        sharded = jax.shard_map(jax.grad(loss), mesh=mesh,
                                in_specs=(P(), P("d")), out_specs=P())
        whole, split = jax.grad(loss)(params, z), jax.jit(sharded)(params, z)
        print(max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split))))
    """)
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-4


def test_the_convolutions_gradient_sums_are_the_same_on_every_platforms_branch():
    """shifted_conv's backward sums in one variadic reduction on CPU and one sum per term
    elsewhere (GPUs): the two branches agree, so the GPU's is checked here too."""
    terms = [jax.random.normal(jax.random.key(i), (3, 5, 7)) for i in range(4)]
    one, separate = network.sums_in_one_reduction(*terms), network.sums_one_by_one(*terms)
    assert one.shape == separate.shape == (4,)
    assert jnp.allclose(one, separate, rtol=1e-5, atol=1e-5)
    assert jnp.allclose(separate, jnp.array([float(t.sum()) for t in terms]), rtol=1e-5, atol=1e-5)
