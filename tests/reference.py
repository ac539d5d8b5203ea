"""Two training steps of a plan, compared with the single-device reference.

Imported by the scripts that run in subprocesses with many virtual devices, and by the tests
that check what those scripts print.
"""

import flax.linen as nn
import jax
import numpy as np

from codesign.engine.job import build_training, train_steps
from codesign.cost.plan import make_plan
from codesign.config.types import ModelSpec
from codesign.zhen import network

ADAM_B1 = 0.9  # optax.adam's default, which the engine uses
LOSS_TOL = 1e-5  # absolute, on losses near 1-2
GRAD_TOL = 1e-4  # largest difference relative to the leaf's largest reference gradient, first step
UPDATE_TOL = 1e-3  # per leaf: |params moved - reference moved| / |reference moved|, two Adam steps


def built_param_count(spec: ModelSpec) -> int:
    """Parameters of the Flax model, from an abstract initialisation (nothing allocated)."""
    shapes = nn.meta.unbox(jax.eval_shape(lambda k: network.init_params(spec, k), jax.random.key(0)))
    return sum(x.size for x in jax.tree.leaves(shapes))


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def two_steps(job, plan=None, options=None) -> dict:
    """Losses of two steps, first-step gradients, initial and final parameters, under the plan
    given (else the job's manual plan), built with the engine options given (else the platform's).
    The gradients are those the step itself applied, read from Adam's first moment after it (from
    zero, it moves to (1 - b1) x the gradients)."""
    training = build_training(job, plan or make_plan(job), options=options)
    initial = leaves(training.params())
    losses, _ = train_steps(training, 1)
    grads = [m / np.float32(1 - ADAM_B1) for m in leaves(training.first_moments())]
    losses += train_steps(training, 1)[0]
    return {"losses": losses, "grads": grads, "initial": initial, "params": leaves(training.params())}


def live_leaves(reference: dict) -> list[bool]:
    """LayerNorm cancels some biases exactly (a per-token constant over D): their true gradient
    is 0, and Adam turns the rounding noise there into +-lr steps, so only their gradients count."""
    return [float(np.max(np.abs(g))) > 1e-6 for g in reference["grads"]]


def differences(run: dict, reference: dict, live: list[bool]) -> dict:
    updates = [p - p0 for p, p0 in zip(run["params"], run["initial"])]
    ref_updates = [p - p0 for p, p0 in zip(reference["params"], reference["initial"])]
    return {
        "initial": max(float(np.max(np.abs(a - b))) for a, b in zip(run["initial"], reference["initial"])),
        "loss": float(np.max(np.abs(np.array(run["losses"]) - reference["losses"]))),
        "grad": max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                    for a, b, ok in zip(run["grads"], reference["grads"], live) if ok),
        "update": max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
                      for a, b, ok in zip(updates, ref_updates, live) if ok),
    }


def assert_matches(name: str, diff: dict) -> None:
    assert diff["initial"] == 0.0, (name, diff)  # every plan starts from the same weights
    assert diff["loss"] < LOSS_TOL, (name, diff)
    assert diff["grad"] < GRAD_TOL, (name, diff)
    assert diff["update"] < UPDATE_TOL, (name, diff)
