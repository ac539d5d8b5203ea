"""The kernel table of bench/bench_step.py --trace: classification and aggregation on hand-written
traces in the Chrome trace format (the GPU path without a GPU), and a real CPU trace of the small
model's step, with its second compile from the persistent cache."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kernel_table

REPO = Path(__file__).resolve().parents[1]
STEP = "bench_step"


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_128x256_32x3_tn_align2>(...)", "matmul"),
    ("gemm_fusion_dot_314", "matmul"),
    ("ynn_fusion.153", "matmul"),
    ("dot.132", "matmul"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collectives"),
    ("all-reduce-start.3", "collectives"),
    ("input_reduce_select_fusion_1", "reduction"),
    ("multiply_reduce_fusion.4", "reduction"),
    ("input_transpose_fusion_12", "copy/transpose"),
    ("wrapped_transpose_5", "copy/transpose"),
    ("copy.695", "copy/transpose"),
    ("MemcpyD2D", "copy/transpose"),
    ("loop_gather_fusion_3", "gather/scatter"),
    ("loop_add_fusion_1", "fusion"),
    ("wrapped_convert", "fusion"),
    ("multiply_add_fusion.324", "fusion"),
    ("concatenate.3", "fusion"),
    ("custom-call.7", "other"),
])
def test_classify_by_kernel_name(name, kind):
    assert kernel_table.classify(name) == kind


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def gpu_trace() -> dict:
    """Two annotated 100 us steps on one GPU, kernels on two streams; the device's derived XLA Ops
    line and the host's thunk events must not be counted again, nor a kernel outside the steps."""
    events = [_meta(1, "/host:CPU"), _meta(1, "python", 10), _meta(2, "/device:GPU:0"),
              _meta(2, "Stream #13(Compute)", 13), _meta(2, "Stream #14(Compute)", 14), _meta(2, "XLA Ops", 99)]
    for step, t0 in enumerate((0.0, 100.0)):
        events += [_x(1, 10, STEP, t0, 100.0, step_num=str(step)),
                   _x(1, 10, "loop_add_fusion", t0 + 1, 2.0, hlo_op="loop_add_fusion"),  # host launch
                   _x(1, 10, "PjitFunction(step)", t0 + 2, 60.0),  # the host's call: 8 us before the first kernel
                   _x(2, 13, "nvjet_sm90_tst_128x160", t0 + 10, 40.0, hlo_op="custom-call.1"),
                   _x(2, 14, "ncclDevKernel_AllReduce_Sum_f32", t0 + 30, 30.0),  # overlaps the matmul
                   _x(2, 13, "loop_add_fusion_1", t0 + 70, 10.0),
                   _x(2, 13, "input_reduce_fusion", t0 + 85, 10.0),
                   _x(2, 99, "fusion.1", t0 + 10, 80.0)]
    events.append(_x(2, 13, "loop_add_fusion_1", 500.0, 10.0))
    return {"displayTimeUnit": "ns", "traceEvents": events}


def test_gpu_trace_table_from_device_streams():
    table = kernel_table.build_table(gpu_trace(), STEP)
    assert table.source == "device streams" and table.steps == 2
    assert table.kernels["loop_add_fusion_1"] == (20.0, 2)  # the one after the steps is left out
    kinds = table.by_kind()
    assert kinds["matmul"] == (80.0, 2) and kinds["collectives"] == (60.0, 2)
    assert kinds["fusion"] == (20.0, 2) and kinds["reduction"] == (20.0, 2) and kinds["other"] == (0.0, 0)
    assert table.device_us == 180.0
    assert table.busy_us == 2 * (50.0 + 10.0 + 10.0)  # 10..60 covered once although two streams overlap
    assert (table.span_us, table.wall_us) == (2 * 85.0, 200.0)  # first kernel at +10, last ends at +95
    text = kernel_table.format_table(table, "hand-written")
    assert "launches per step 4;" in text and "idle between kernels 0.015 ms" in text
    assert "before the first and after the last kernel 0.015 ms" in text
    assert re.search(r"^matmul\s+0\.040\s+44\.4%\s+1\.0$", text, re.MULTILINE)
    assert table.host_before == {"PjitFunction(step)": 16.0}  # the annotation and thunks left out
    assert "host events before the first kernel, us per step (nested events each counted): PjitFunction(step) 8" in text
    assert table.first_kernel == [kernel_table.HostAtFirst(10.0, "PjitFunction(step)", 2.0, 60.0)] * 2
    assert ("the median step's first kernel starts 10 us in, while the host is in PjitFunction(step) "
            "(from +2 us, 60 us long); its last kernel ends 5 us before the step does") in text


def test_the_host_event_at_the_first_kernel_is_the_innermost_open_one():
    """A graph launch nested in the call it serves is named, not the call; an event that ended
    before the kernel, or starts after it, is not; with none open the line says so."""
    host = [_x(1, 10, "PjitFunction(step)", 0.0, 900.0), _x(1, 10, "Execute", 80.0, 800.0),
            _x(1, 10, "cuGraphLaunch", 350.0, 2000.0), _x(1, 10, "Thunks::Initialize", 300.0, 40.0),
            _x(1, 11, "BUFFER_FLUSH", 800.0, 20.0)]
    assert kernel_table.host_at(host, 750.0, 0.0) == kernel_table.HostAtFirst(750.0, "cuGraphLaunch", 350.0, 2000.0)
    assert kernel_table.host_at(host, 3000.0, 1000.0) == kernel_table.HostAtFirst(2000.0)
    table = kernel_table.KernelTable("device streams", {"k": (10.0, 1)}, {}, [(1000.0, 10.0, 10.0)],
                                     [kernel_table.HostAtFirst(2000.0)])
    assert "the median step's first kernel starts 2000 us in, no host event open" in kernel_table.format_table(table, "t")


def test_the_split_is_the_median_steps_one_a_step_waiting_on_the_tracer_aside():
    table = kernel_table.build_table(gpu_trace(), STEP)
    assert table.step_splits == [(100.0, 70.0, 85.0)] * 2 and table.median_step() == (100.0, 70.0, 85.0)
    slow = kernel_table.KernelTable("device streams", {}, {},
                                    [(11100.0, 9900.0, 10100.0), (16400.0, 9900.0, 11700.0), (11400.0, 9900.0, 10100.0)])
    assert slow.median_step() == (11400.0, 9900.0, 10100.0) and slow.median_index() == 2
    text = kernel_table.format_table(slow, "one slow step")
    assert "first kernel starts" not in text  # no step annotations read: nothing to say
    assert "the median step: wall 11.400 ms = kernels busy 9.900 ms + idle between kernels 0.200 ms" in text


def test_kernels_against_their_roofline_and_the_table_of_a_fetched_trace(tmp_path, capsys):
    """Kernels found in the roofline map (by trace name) get us a call, roofline and ratio; the
    summary says how much of the time was found and which kernels lost most to their roofline.
    `kernel_table.py DIR --device` reads a trace directory and the HLO beside it."""
    import gzip
    import json

    table = kernel_table.build_table(gpu_trace(), STEP)
    text = kernel_table.format_table(table, "hand-written", rooflines={"loop_add_fusion_1": 4e-6,
                                                                        "input_reduce_fusion": 10e-6})
    assert ("against the optimized HLO's roofline: 2 of 4 kernels found by name (XLA's fusions; library GEMMs "
            "are not), 0.020 ms a step against 0.014 ms (1.43x); most time past it: loop_add_fusion_1 0.006 ms, "
            "input_reduce_fusion 0.000 ms") in text
    line = next(line for line in text.splitlines() if line.startswith("loop_add_fusion_1"))
    assert line.split()[-3:] == ["10.0", "4.0", "2.50x"] and line.index("10.0") > kernel_table.ROOF_COLUMN
    assert next(line for line in text.splitlines() if line.startswith("nvjet")).split()[-1] == "matmul"
    assert "x roof" not in kernel_table.format_table(table, "hand-written")

    run = tmp_path / "row" / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump(gpu_trace(), f)
    (tmp_path / "row" / "optimized_hlo.txt").write_text(HLO)
    sys.path.insert(0, str(REPO / "bench"))  # kernel_table's main imports its sibling hlo_kernels
    try:
        assert kernel_table.main([str(tmp_path / "row"), "--device", "H100"]) == 0
    finally:
        sys.path.remove(str(REPO / "bench"))
    printed = capsys.readouterr().out
    adds = next(line for line in printed.splitlines() if line.startswith("loop_add_fusion_1"))
    roof = 3 * 1024 * 4 / 3.35e12 * 1e6  # two f32[1024] read, one written, at the H100's 3.35e12 B/s
    assert adds.split()[-2:] == [f"{roof:.1f}", f"{10.0 / roof:.2f}x"] and "1 of 4 kernels found" in printed


HLO = """HloModule step

%fused_add (p0: f32[1024], p1: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  ROOT %add.1 = f32[1024]{0} add(%p0, %p1)
}

ENTRY %main (a: f32[1024], b: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  ROOT %loop_add_fusion.1 = f32[1024]{0} fusion(%a, %b), kind=kLoop, calls=%fused_add
}
"""


def test_cpu_trace_table_from_thunks_without_step_annotations():
    events = [_meta(1, "/host:CPU"), _meta(1, "tf_XLAEigen/1", 3),
              _x(1, 3, "dot.1", 0.0, 6.0, hlo_op="dot.1"), _x(1, 3, "end: dot.1", 6.0, 0.1),
              _x(1, 3, "copy.2", 8.0, 2.0, hlo_op="copy.2")]
    table = kernel_table.build_table({"traceEvents": events}, STEP)
    assert table.source == kernel_table.HOST and table.steps == 1
    assert table.kernels == {"dot.1": (6.0, 1), "copy.2": (2.0, 1)}
    assert (table.busy_us, table.span_us, table.wall_us) == (8.0, 10.0, 10.0)


def _kind_shares(text: str) -> dict[str, float]:
    kinds = "|".join(re.escape(k) for k, _ in kernel_table.KINDS) + "|" + kernel_table.OTHER
    row = re.compile(rf"^({kinds})\s+[\d.]+\s+([\d.]+)%\s+[\d.]+$", re.MULTILINE)
    return {m[1]: float(m[2]) for m in row.finditer(text)}


@pytest.mark.slow
@pytest.mark.scripts
def test_bench_step_trace_and_cached_compile_on_cpu(tmp_path):
    """Two traced steps of the small model's project row: a kernel table whose shares add up, and a
    second compile in a fresh process that hits the persistent cache and is faster (the reference
    row runs the same code; test_reference_step checks its step)."""
    done = subprocess.run([sys.executable, "bench/bench_step.py", "--model", "small", "--batch", "4", "--steps", "2",
                           "--precision", "fp32", "--rows", "project", "--trace", str(tmp_path / "trace"), "--recompile",
                           "--cache", str(tmp_path / "cache")],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-4000:]
    tables = done.stdout.split("## kernels: ")[1:]
    assert [t.split(":")[0] for t in tables] == ["project fp32 batch 4"]  # each row's table is the same code
    for table in tables:
        assert "2 steps traced" in table
        shares = _kind_shares(table)
        assert len(shares) == len(kernel_table.KINDS) + 1 and abs(sum(shares.values()) - 100) < 0.5
        assert shares["matmul"] > 0 and int(re.search(r"launches per step (\d+)", table)[1]) > 0
    assert list((tmp_path / "trace" / "project_fp32_4").glob("plugins/profile/*/*.trace.json.gz"))
    hlo = (tmp_path / "trace" / "project_fp32_4" / "optimized_hlo.txt").read_text()  # the kernels, by name
    assert hlo.startswith("HloModule") and "fusion" in hlo
    header, row = done.stdout.splitlines()[1:3]
    assert header.split()[-2:] == ["loop", "ms"]
    step_ms, loop_ms = float(row.split()[3]), float(row.split()[-1])
    assert step_ms > 0 and loop_ms > 0  # the synchronised median and the back-to-back mean
    first, again, hits = map(float, re.search(r"# project fp32 batch 4: compile ([\d.]+) s, again in a fresh "
                                              r"process from the persistent cache ([\d.]+) s \((\d+) cache hits",
                                              done.stdout).groups())
    assert hits >= 1 and again < first
