import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from bench import reference_step
from codesign.config.types import ModelSpec
from codesign.engine.options import engine_options
from codesign.zhen import counts, network

SPEC = ModelSpec(12, 6, 3, 3, (("DOT", "CONVOLUTION"), ("ATTENTION", "DOT"), ("LINEAR", "ATTENTION", "LINEAR")))


@pytest.mark.slow
@pytest.mark.scripts
def test_reference_step_has_the_project_loss_and_gradients_at_init():
    params = nn.meta.unbox(network.init_params(SPEC, jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (5, 6, 12))
    y = jax.random.normal(jax.random.key(2), (5, counts.output_width(SPEC)))

    def project(p):
        return network.loss(network.forward(SPEC, p, x, engine_options("cpu", "fp32")), y)

    (ref, g_ref), (own, g_own) = (jax.jit(jax.value_and_grad(f))(params)
                                  for f in (lambda p: reference_step.loss(SPEC, p, x, y), project))
    assert abs(float(ref) - float(own)) < 1e-6 * float(own) and float(own) > 0.5
    assert jax.tree.structure(g_ref) == jax.tree.structure(g_own)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_own))  # LayerNorm zeroes some exactly
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_own)):
        assert jnp.max(jnp.abs(a - b)) <= 1e-5 * scale
