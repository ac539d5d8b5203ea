"""op, dp with micro-batches (per leaf, and with a GPU's engine options: flat, also with a leaf
whole beside the vector), the batch on op, ZeRO-2 and a pipeline of dp x op stages against the
single-device reference (the fixture's dp and dp x op plans, and its pipelines, are test_pipeline.py's);
and one plan at XLA's default flags, as users' jobs compile."""

import json

import pytest

from tests.conftest import run_on_devices
from tests.reference import assert_matches

SETUP = """
import dataclasses, json
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.engine.options import engine_options
from tests.reference import differences, live_leaves, two_steps

model = ModelSpec(16, 8, 4, 2, (("ATTENTION", "LINEAR", "DOT", "CONVOLUTION"), ("DOT", "ATTENTION")))
def job(devices, pp_dp_op, micro, options=(), per_device=None):
    training = TrainingSpec(per_device or 32 // devices, 4)
    parallel = ParallelSpec("test", (micro,), pp_dp_op[0], False, pp_dp_op, None, options)
    return Job(model, ClusterSpec(1, devices, "NVLink", "cpu"), training, parallel, micro, "cpu")

reference = two_steps(job(1, (1, 1, 1), 1))
live = live_leaves(reference)
"""

SCRIPT = SETUP + """
# dp alone and dp x op (with micro-batches) are the fixture's own plans in test_pipeline.py
cases = {"op4": job(4, (1, 1, 4), 1), "dp4 mb4": job(4, (1, 4, 1), 4),
         "batch on op": job(4, (1, 2, 2), 1, (("force_batch_dim_to_mesh_dim", 1),)),
         "dp2xop2 mb2 zero2": job(4, (1, 2, 2), 2, (("prefer_reduce_scatter", True),)),
         "single mb2": job(1, (1, 1, 1), 2, per_device=32), "pp2 dp2xop2 mb2": job(8, (2, 2, 2), 2)}
result = {name: differences(two_steps(j), reference, live) for name, j in cases.items()}
gpu = engine_options("gpu", "fp32")  # flat state, one gradient all-reduce, bias in the matmul, sums one by one
result["dp4 mb4 gpu options"] = differences(two_steps(job(4, (1, 4, 1), 4), options=gpu), reference, live)
whole = dataclasses.replace(gpu, whole_leaf=16 * 16 * 512)  # layer 0's DOT kernel beside the vector
result["dp4 mb4 gpu options, a leaf whole"] = differences(two_steps(job(4, (1, 4, 1), 4), options=whole),
                                                          reference, live)
print(json.dumps({"ref": reference["losses"], "live": sum(live), "leaves": len(live), "cases": result}))
"""

DEFAULT_FLAGS_SCRIPT = SETUP + """
print(json.dumps(differences(two_steps(job(4, (1, 2, 2), 2)), reference, live)))
"""


@pytest.mark.slow
def test_parallel_plans_match_single_device_reference():
    out = json.loads(run_on_devices(8, SCRIPT).stdout.strip().splitlines()[-1])
    assert out["ref"][1] < out["ref"][0]  # the reference itself trains
    assert out["live"] >= out["leaves"] - 6
    assert len(out["cases"]) == 8
    for name, diff in out["cases"].items():
        assert_matches(name, diff)


@pytest.mark.slow
def test_a_dp_x_op_plan_matches_the_reference_at_xlas_default_flags():
    """The suite compiles with little optimisation (FAST_XLA); a user's job compiles at XLA's
    defaults, whose fusions and layouts differ: dp 2 x op 2 (parameters sharded over op, two
    micro-batches accumulated) against the single-device reference, both compiled there."""
    diff = json.loads(run_on_devices(4, DEFAULT_FLAGS_SCRIPT, xla_flags="").stdout.strip().splitlines()[-1])
    assert_matches("dp2xop2 mb2 at default flags", diff)
