"""bench/hlo_kernels.py, the HLO's traffic table, and bench_step.py --target, which prints it for a
GPU compiled for without one."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import REPO

HAND_WRITTEN = """HloModule step

%fused_cast (param_0: f32[1000]) -> bf16[10,10] {
  %param_0 = f32[1000]{0} parameter(0)
  %convert.1 = bf16[1000]{0} convert(%param_0)
  %slice.1 = bf16[100]{0} slice(%convert.1), slice={[0:100]}
  ROOT %bitcast.1 = bf16[10,10]{1,0} bitcast(%slice.1)
}

%fused_gemm (param_0.2: bf16[100,10], param_1.2: bf16[10,10]) -> bf16[100,10] {
  %param_0.2 = bf16[100,10]{1,0} parameter(0)
  %param_1.2 = bf16[10,10]{1,0} parameter(1)
  ROOT %dot.1 = bf16[100,10]{1,0} dot(%param_0.2, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_adam (param_0.1: f32[1000], param_1.1: f32[1000], param_2.1: bf16[1000]) -> (f32[1000], f32[1000]) {
  %param_0.1 = f32[1000]{0} parameter(0)
  %param_1.1 = f32[1000]{0} parameter(1)
  %param_2.1 = bf16[1000]{0} parameter(2)
  %convert.2 = f32[1000]{0} convert(%param_2.1)
  %add.1 = f32[1000]{0} add(%param_0.1, %convert.2)
  ROOT %tuple.1 = (f32[1000]{0}, f32[1000]{0}) tuple(%add.1, %param_1.1)
}

ENTRY %main (params: f32[1000], mu: f32[1000], grads: bf16[1000], acts: bf16[100,10], wide: f32[100,10]) -> (f32[1000], f32[1000], bf16[100,10], f32[100,100]) {
  %params = f32[1000]{0} parameter(0), metadata={op_name="params"}
  %mu = f32[1000]{0} parameter(1), metadata={op_name="mu"}
  %grads = bf16[1000]{0} parameter(2), metadata={op_name="grads"}
  %acts = bf16[100,10]{1,0} parameter(3)
  %wide = f32[100,10]{1,0} parameter(4)
  %loop_slice_fusion = bf16[10,10]{1,0} fusion(%params), kind=kLoop, calls=%fused_cast, metadata={op_name="jit(step)/slice"}
  %gemm_fusion_dot = bf16[100,10]{1,0} fusion(%acts, %loop_slice_fusion), kind=kCustom, calls=%fused_gemm
  %loop_add_fusion = (f32[1000]{0}, f32[1000]{0}) fusion(%params, %mu, /*index=2*/%grads), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(step)/add"}
  %cublas-gemm.1 = (f32[100,100]{1,0}, s8[64]{0}) custom-call(%wide, %wide), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %get-tuple-element.3 = f32[100,100]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %get-tuple-element.1 = f32[1000]{0} get-tuple-element(%loop_add_fusion), index=0
  %get-tuple-element.2 = f32[1000]{0} get-tuple-element(%loop_add_fusion), index=1
  ROOT %tuple = (f32[1000]{0}, f32[1000]{0}, bf16[100,10]{1,0}, f32[100,100]{1,0}) tuple(%get-tuple-element.1, %get-tuple-element.2, %gemm_fusion_dot, %get-tuple-element.3)
}
"""


@pytest.fixture(scope="module")
def hlo_kernels():
    sys.path.insert(0, str(REPO / "bench"))  # it imports its sibling kernel_table, as the scripts do
    try:
        yield importlib.import_module("hlo_kernels")
    finally:
        sys.path.remove(str(REPO / "bench"))


def cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def test_kernels_bytes_flops_and_kinds_of_a_hand_written_module(hlo_kernels):
    """A fusion that only slices an operand (through a convert) reads the slice, in the operand's
    dtype; operands after an /*index=N*/ comment count; tuples and views are not kernels; a GEMM
    fusion's and a cuBLAS call's FLOPs come from their dots' shapes, each priced at its dtype's rate."""
    kernels = {k.name: k for k in hlo_kernels.entry_kernels(HAND_WRITTEN)}
    assert list(kernels) == ["loop_slice_fusion", "gemm_fusion_dot", "loop_add_fusion", "cublas-gemm.1"]
    cast, gemm, adam, cublas = kernels.values()
    assert (cast.kind, cast.read, cast.written, cast.op_name, cast.flops) == ("fusion", 100 * 4, 100 * 2,
                                                                             "jit(step)/slice", 0)
    assert (gemm.kind, gemm.read, gemm.written, gemm.flops, gemm.operand_dtype) == (
        "matmul", 1000 * 2 + 100 * 2, 1000 * 2, 2 * 100 * 10 * 10, "bf16")
    assert (adam.read, adam.written, adam.moved) == (1000 * (4 + 4 + 2), 1000 * 8, 18000)
    assert (cublas.kind, cublas.read, cublas.written, cublas.flops, cublas.operand_dtype) == (
        "matmul", 2 * 1000 * 4, 10000 * 4 + 64, 2 * 100 * 100 * 10, "f32")  # x x^T: 100 x 100
    rates = {"bf16": 1e6, "f32": 2e6}  # FLOP/s
    assert gemm.roofline(1e9, rates) == 0.02 and cublas.roofline(1e9, rates) == 0.1
    assert adam.roofline(1e9, rates) == 18000 / 1e9 and adam.roofline(1e9, {}) == 18000 / 1e9
    text = hlo_kernels.format_traffic(list(kernels.values()), "hand-written", 1e9, rates, top=2)
    moved = sum(k.moved for k in kernels.values())
    assert text.splitlines()[0].startswith(f"# HLO traffic, hand-written: 4 kernels move {moved / 1e9:.3f} GB "
                                           f"({moved / 1e9 * 1e3:.2f} ms at 1e+09 B/s) and do 0.000 TFLOP of "
                                           f"matmuls; roofline {(0.12 + (cast.moved + adam.moved) / 1e9) * 1e3:.2f} ms")
    assert text.splitlines()[2].split()[:2] == ["matmul", "2"]  # the kinds by roofline time, the matmuls first
    assert [line.split()[-2] for line in text.splitlines()[-2:]] == ["cublas-gemm.1", "gemm_fusion_dot"]


def test_kernels_of_a_compiled_program_read_only_the_slice_they_use(hlo_kernels):
    """XLA:CPU's own HLO: the kernel taking tanh of x's first 64 elements reads 256 bytes of x's 4000."""
    compiled = jax.jit(lambda x, w: (jnp.tanh(x[:64].reshape(8, 8)) @ w, x * 2)).lower(
        jnp.ones(1000), jnp.ones((8, 8))).compile()
    kernels = hlo_kernels.entry_kernels(compiled.as_text())
    by_op = {k.op_name.rsplit("/", 1)[-1]: k for k in kernels}
    assert (by_op["tanh"].read, by_op["tanh"].written) == (64 * 4, 64 * 4)
    assert (by_op["mul"].read, by_op["mul"].written) == (4000, 4000)
    assert by_op["dot_general"].kind == "matmul" and by_op["dot_general"].read == 2 * 64 * 4


def test_bench_step_target_compiles_for_a_described_gpu_or_says_what_it_needs():
    """With JAX's CUDA plugin (no GPU needed) it prints each row's kernels and traffic; without it,
    one line naming what to install, exit code 2."""
    done = subprocess.run([sys.executable, "bench/bench_step.py", "--target", "h100", "--model", "small",
                           "--batch", "8", "--precision", "fp32", "--rows", "project", "reference"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    if not cuda_plugin():
        assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
        assert "--target h100 needs the CUDA build of JAX (pip install -e '.[gpu]'; no GPU needed)" in done.stderr
        pytest.skip("no CUDA build of JAX here: checked the message naming what to install, not the GPU compile")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled for NVIDIA H100 80GB HBM3" in done.stdout
    for row in ("project", "reference"):
        assert f"{row} fp32 batch 8: compile" in done.stdout and f"# HLO traffic, {row} fp32 batch 8:" in done.stdout


def test_a_bench_step_row_that_fails_is_one_line_and_the_other_rows_still_run(hlo_kernels, monkeypatch, capsys):
    """On a GPU run, a row whose kernel this JAX cannot build must not cost the rows after it."""
    import bench_step

    def report_row(row, args, batch, precision, cache_dir):
        if row == "project-bias-add":
            raise RuntimeError("no Triton lowering for this\nsecond line")
        print(f"{row} ran")
        return {"project": 0.010, "reference": 0.013}[row]

    monkeypatch.setattr(bench_step, "report_row", report_row)
    args = bench_step._parser().parse_args(["--rows", "project", "project-bias-add", "reference", "--precision",
                                            "bf16", "--batch", "8"])
    bench_step.bench(args, None)
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "project ran",
        "project-bias-add bf16 batch 8: failed: RuntimeError: no Triton lowering for this",
        "reference ran",
        "# bf16 batch 8: project/reference 1.30x in samples/s"]
    assert "Traceback" in err and "second line" in err


def test_each_project_row_changes_one_of_the_platforms_engine_options(hlo_kernels):
    """`project` and `project-fold` build with the platform's own options; `project-whole-leaf`
    keeps fp32's large leaves whole in bf16 too, `project-one-vector` none, flat on CPU too."""
    import bench_step

    from codesign.engine.options import engine_options

    for platform in ("cpu", "gpu"):
        for precision in ("fp32", "bf16"):
            own = engine_options(platform, precision)
            assert bench_step.row_options("project", platform, precision) == own
            assert bench_step.row_options("project-fold", platform, precision) == own
            assert bench_step.row_options("project-whole-leaf", platform, precision) == dataclasses.replace(
                own, whole_leaf=2**23)
            assert bench_step.row_options("project-one-vector", platform, precision) == dataclasses.replace(
                own, flat_state=True, whole_leaf=math.inf)
    assert not bench_step.row_options("project-bias-add", "gpu", "bf16").bias_in_matmul
    assert not bench_step.row_options("project-serial", "gpu", "bf16").batch_encoders
    assert bench_step.row_options("project-leaves", "gpu", "bf16") == dataclasses.replace(
        engine_options("gpu", "bf16"), flat_state=False)
