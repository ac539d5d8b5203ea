"""The GPU profile's path (engine/probe/: work timed inside compiled loops, sections kept in
OUT.json.parts), run on CPU at small sizes; and measured points, as the cost model prices them."""

import dataclasses
import json
import logging
import os
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest

from codesign.cost.model import Workload, estimate
from codesign.hardware.collectives import over_link
from codesign.hardware.device import Devices
from codesign.cost.plan import make_plan
from codesign.hardware.links import NVLINK, Link
from codesign.hardware.profiles import BUILTIN, ENCODER_PAIR, LAYER, DeviceProfile, Provenance, Rate, interpolated
from codesign.config.types import MIXERS, ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from tests.conftest import run_on_devices

FORWARD = ((1e6, 2e-5), (1e8, 4e-5), (1e10, 2e-3))
BACKWARD = tuple((2 * w, 2 * s) for w, s in FORWARD)


def measured_h100() -> DeviceProfile:
    """The built-in H100 with every rate carrying points."""
    rates = tuple((p, tuple((k, dataclasses.replace(r, forward_points=FORWARD, backward_points=BACKWARD))
                            for k, r in table)) for p, table in BUILTIN["H100"].rates)
    return dataclasses.replace(BUILTIN["H100"], rates=rates, roofline=False, provenance=Provenance("measured"),
                               gemms=False)


def call_time(*args) -> float:
    """One call at a profile's rates, as the hardware prices it."""
    return Devices(BUILTIN["H100"], NVLINK, NVLINK).call(*args)


def test_interpolation_is_log_log_between_points_and_linear_at_the_rate_past_the_largest():
    for work, seconds in FORWARD:
        assert interpolated(FORWARD, work, 1e12) == pytest.approx(seconds)
    assert interpolated(FORWARD, 1e7, 1e12) == pytest.approx(np.sqrt(2e-5 * 4e-5))  # geometric midpoint
    assert interpolated(FORWARD, 3e10, 1e13) == pytest.approx(2e-3 + 2e10 / 1e13)
    assert 0 < interpolated(FORWARD, 1e3, 1e12) <= 2e-5  # below the smallest: never more than it


def test_a_profile_with_points_round_trips_and_prices_by_interpolation():
    profile = measured_h100()
    for stored in (profile, BUILTIN["H200"]):
        assert DeviceProfile.from_dict(json.loads(json.dumps(stored.to_dict()))) == stored
    rate = profile.rate("bf16", "DOT")
    assert call_time(1e9, rate.forward, rate.overhead, 1.0, rate.forward_points) == pytest.approx(
        interpolated(FORWARD, 1e9, rate.forward))
    job = Job(ModelSpec(512, 160, 20, 2, (tuple(MIXERS),) * 2), ClusterSpec(1, 1, "NVLink"),
              TrainingSpec(256, 3, precision="bf16"), ParallelSpec("one", (1,), pp_dp_op=(1, 1, 1)), 1, "gpu")
    plan = make_plan(job)
    with_points = estimate(Workload.of(job, profile), plan).seconds
    lines = estimate(Workload.of(job, dataclasses.replace(profile, rates=BUILTIN["H100"].rates)), plan).seconds
    assert with_points != pytest.approx(lines)


def test_profiles_stored_without_points_load_and_price_as_before():
    for profile in (BUILTIN[kind] for kind in ("H100", "A100", "cpu")):  # the H200's is a measured one
        data = profile.to_dict()
        assert all(set(r) == {"forward", "backward", "overhead"} for t in data["rates"].values() for r in t.values())
        assert DeviceProfile.from_dict(json.loads(json.dumps(data))) == profile
    rate = Rate(1e12, 8e11, 5e-5)
    assert call_time(1e9, rate.forward, rate.overhead, 0.5, rate.forward_points) == (5e-5 + 1e-3) / 0.5


def test_the_link_is_fitted_to_collective_times_as_the_cost_model_prices_them():
    from codesign.engine.probe.gpu_sections import fitted_link

    truth, n = Link(3e11, 8e-6), 8
    sizes = [2**k for k in range(20, 29, 2)]
    found = {kind: [[s, over_link(kind, s, n, truth)] for s in sizes]
             for kind in ("all-reduce", "all-gather", "reduce-scatter")}
    link = fitted_link(found, n)
    assert link.bandwidth == pytest.approx(truth.bandwidth, rel=1e-3)
    assert link.latency == pytest.approx(truth.latency, rel=1e-3)


# -- the loop-timed path on CPU (JAX) -----------------------------------------------------------

@pytest.fixture
def tiny():
    from codesign.engine.probe.loops import LoopSizes

    return LoopSizes(64, 2**16, ((8, 2, 4),), (2, 8), (2**10, 2**12), 0.002)


def test_loop_timing_gives_sane_positive_rates(tiny):
    from codesign.engine.probe.gpu_sections import matmul_carries, matmul_rates, stream_bandwidth, stream_bytes
    from codesign.engine.probe.loops import GPU_LOOPS

    assert [[a.dtype.name for a in carry] for carry in matmul_carries(4)] == [["float32"] * 3, ["bfloat16"] * 3]
    rates = matmul_rates(tiny)
    assert set(rates) == {"fp32", "bf16"}
    assert all(1e6 < r < 1e13 for r in rates.values()), rates
    assert 1e6 < stream_bandwidth(tiny) < 1e13
    assert stream_bytes(2**20) == 2**21  # read and written back
    assert stream_bytes(GPU_LOOPS.stream) >= 2**30  # an H100's L2 is 50 MB


def test_one_slow_call_does_not_end_a_loops_growth():
    """A loop grows until its fastest long and short calls differ by the aim: one slow first long
    call once stopped it at one trip, where the fastest pair then differed by nothing (a tiny
    matmul at 3e19 FLOP/s in CI)."""
    from codesign.engine.probe.loops import MAX_TRIPS, loop_times

    calls = []

    def run(state, trips):  # 10 us a trip; the first timed long call 50 ms late
        calls.append(int(trips.max()))
        time.sleep(1e-5 * calls[-1] + (0.05 if len(calls) == 4 else 0))
        return state

    [per_iteration] = loop_times(run, (0,), 0.01, [1])
    assert per_iteration == pytest.approx(1e-5, rel=0.3)
    assert max(calls) == MAX_TRIPS + 1


@pytest.mark.slow
def test_mixer_points_are_forward_and_backward_seconds_by_flops(tiny):
    from codesign.engine.probe.compiles import compile_side_by_side
    from codesign.engine.probe.gpu_sections import mixer_points, mixer_section, points_rate

    sections = {kind: mixer_section(kind, "fp32", tiny) for kind in ("ATTENTION", "DOT")}
    programs = compile_side_by_side(((kind, part), getattr(section, part).compile) for kind, section in sections.items()
                                    for part in ("lowered", "init"))
    dot = mixer_points((programs["DOT", "lowered"], programs["DOT", "init"]), sections["DOT"], tiny)
    assert [w for w, _ in dot["forward"]] == sorted(sections["DOT"].work)
    found = mixer_points((programs["ATTENTION", "lowered"], programs["ATTENTION", "init"]), sections["ATTENTION"], tiny)
    forward, backward = found["forward"], found["backward"]
    assert len(forward) == len(backward) == 2
    assert [2 * w for w, _ in forward] == [w for w, _ in backward]  # keyed by the call's backward FLOPs
    for points in (forward, backward):
        assert points[0][0] < points[1][0] and 0 < points[0][1] <= points[1][1]
    rate = points_rate(forward, backward, 1e13, tiny.batches[0] / tiny.batches[-1])
    assert rate.forward > 0 and rate.backward > 0 and rate.overhead > 0
    assert sections["DOT"].inners == [64, 64] * 2  # tiny bodies: the most iterations a trip


def test_each_mixers_backward_is_timed_against_a_random_cotangent(tiny):
    """As a step's backward gets one: against a plain sum's ones XLA:GPU turned a skip
    projection's matmul gradients into row sums, and the profile priced them at nothing."""
    import jax.numpy as jnp

    from codesign.engine.probe.gpu_sections import mixer_section

    section = mixer_section(LAYER, "bf16", tiny)
    forward, backward = section.init.compile()()[:2]  # each point: its forward's carry, its backward's
    assert len(forward) == 3 and len(backward) == 4
    cotangent = backward[2]
    assert cotangent.shape == forward[2].shape and cotangent.dtype == jnp.float32
    assert float(jnp.std(cotangent)) > 0.5 and len(jnp.unique(cotangent)) > cotangent.size // 2


def test_with_pair_the_later_widths_time_two_vmapped_encoders_as_the_engine_calls_them(tiny):
    """By default (CODESIGN_PROFILE_PAIR=0: not) ATTENTION's later widths are timed as a layer of two ATTENTION
    mixers (their encoders one vmapped call), in place of one encoder: no more programs."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from codesign.engine.probe.gpu_sections import mixer_section
    from codesign.engine.probe.mixers import mixer_module
    from codesign.hardware.profiles import ENCODER_PAIR
    from codesign.zhen import counts

    module, flops = mixer_module(ENCODER_PAIR, 8, 2, 4, "fp32")
    assert flops == 2 * counts.mixer_work("ATTENTION", 8, 2, 4).flops
    z = jnp.ones((3, 4, 8))
    params = jax.eval_shape(module.init, jax.random.key(0), z)["params"]
    assert sorted(params["ZhenBlock_0"]) == ["mixer_0_attention", "mixer_1_attention", "norm"]
    two = dataclasses.replace(tiny, widths=((8, 2, 4), (6, 2, 4)), pair=True)
    section = mixer_section("ATTENTION", "fp32", two)
    assert section.kinds == ["ATTENTION", "ATTENTION", ENCODER_PAIR, ENCODER_PAIR] and len(section.inners) == 8
    single = counts.mixer_work("ATTENTION", 6, 2, 4).flops
    assert section.work[2:] == [2 * single * b for b in two.batches]
    assert mixer_section("DOT", "fp32", two).kinds == ["DOT"] * 4
    assert mixer_section("ATTENTION", "fp32", dataclasses.replace(two, pair=False)).kinds == ["ATTENTION"] * 4


def test_the_carries_are_patterned_values_without_a_random_generator(tiny):
    """The init programs fill the carries from a hash of each index, not the model's random
    initialisers (a third of the fusions, a fifth of the compile on this CPU): finite, bounded,
    uniform with unrelated neighbours (as random bits draw a GPU's power), each leaf its own."""
    import jax
    import jax.numpy as jnp

    from codesign.engine.probe.gpu_sections import mixer_section
    from codesign.engine.probe.loops import pattern

    section = mixer_section("ATTENTION", "bf16", tiny)
    compiled = section.init.compile()
    assert "rng" not in compiled.as_text() and "threefry" not in compiled.as_text()
    params, z, cotangent = compiled()[1][:3]
    leaves = jax.tree.leaves(params)
    assert all(bool(jnp.isfinite(leaf.astype(jnp.float32)).all()) for leaf in leaves)
    assert all(float(jnp.abs(leaf.astype(jnp.float32)).max()) <= 0.0501 for leaf in leaves)
    kernels = [leaf for leaf in leaves if leaf.ndim == 2 and leaf.size > 16]
    assert len({tuple(np.asarray(k.astype(jnp.float32)).ravel()[:8]) for k in kernels}) == len(kernels)
    assert z.dtype == jnp.bfloat16 and cotangent.dtype == jnp.float32 and float(jnp.std(cotangent)) > 0.5
    values = np.asarray(pattern(jax.ShapeDtypeStruct((1000, 100), jnp.float32), 3))
    assert values.min() >= -1 and values.max() < 1 and abs(values.mean()) < 0.01 and abs(values.std() - 3**-0.5) < 0.01
    assert abs(np.corrcoef(values.ravel()[:-1], values.ravel()[1:])[0, 1]) < 0.01  # neighbours unrelated
    assert np.array_equal(values, pattern(jax.ShapeDtypeStruct((1000, 100), jnp.float32), 3))
    assert not np.array_equal(values, pattern(jax.ShapeDtypeStruct((1000, 100), jnp.float32), 4))
    assert not re.search(r"\bthreefry2x32\b", section.init.as_text())


def test_the_pair_is_timed_unless_the_environment_says_0(monkeypatch):
    from codesign.engine.probe.loops import GPU_LOOPS, PAIR_ENV, loop_sizes

    monkeypatch.delenv(PAIR_ENV, raising=False)
    assert loop_sizes("gpu") == GPU_LOOPS and GPU_LOOPS.pair
    assert loop_sizes("cpu").pair and loop_sizes("cpu").widths != GPU_LOOPS.widths
    monkeypatch.setenv(PAIR_ENV, "0")
    assert not loop_sizes("gpu").pair and loop_sizes("gpu").widths == GPU_LOOPS.widths


def test_compile_spans_list_every_program_in_the_order_it_finished():
    from codesign.engine.probe.compiles import compile_spans

    spans = {("fp32", "DOT", "lowered"): (0.0, 9.5), ("fp32", "DOT", "init"): (0.1, 2.0), ("scratch",): (2.2, 3.0)}
    assert compile_spans(spans) == ("in the order done, start+seconds: fp32 DOT init 0.1+2.0, scratch 2.2+3.0, "
                                    "fp32 DOT lowered 0.0+9.5")


def test_the_compile_log_says_how_busy_the_cores_were_counting_a_compiler_run_as_a_subprocess(caplog):
    """CPU seconds of the process's threads and of its finished children (XLA may run ptxas as one):
    at the core count the profile's compiles wait on the CPU, near one on something else."""
    import subprocess
    import sys

    from codesign.engine.probe.compiles import compile_side_by_side, cores_busy, cpu_seconds

    before = cpu_seconds()
    busy_child = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", busy_child], check=True)
    assert cpu_seconds() - before >= 0.3
    assert cores_busy(30.0, 10.0) == f"30 CPU-s: 3.0 of {os.cpu_count()} cores busy"

    def spin():
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
        return 1

    with caplog.at_level(logging.INFO, logger="codesign.profile"):
        assert compile_side_by_side([(("a",), spin), (("b",), spin)]) == {("a",): 1, ("b",): 1}
    busy = re.search(r"2 programs compiled side by side in ([\d.]+) s, (\d+) CPU-s: ([\d.]+) of \d+ cores busy",
                     caplog.text)
    assert busy and float(busy[3]) > 0


def test_past_the_largest_point_the_rate_is_that_widths_own_marginal_rate():
    from codesign.engine.probe.gpu_sections import points_rate
    from codesign.engine.probe.loops import inner_count

    # Two widths of about the same FLOPs, each at micro-batches 128 and 1024 (ratio 1/8).
    forward = ((0.9e9, 9e-5), (1e9, 1e-4), (7.2e9, 7e-4), (8e9, 8e-4))
    rate = points_rate(forward, tuple((2 * w, 2 * s) for w, s in forward), 1e15, 1 / 8)
    assert rate.forward == pytest.approx(7e9 / 7e-4) and rate.backward == pytest.approx(7e9 / 7e-4)
    assert points_rate(forward, forward, 5e12, 1 / 8).forward == 5e12  # never past the matmul peak
    assert points_rate(forward, forward, 1e15, 1 / 3).forward == pytest.approx(0.8e9 / 1e-4)  # no partner
    assert [inner_count(f) for f in (1e3, 2e11 / 8, 2e11, 1e12)] == [64, 8, 4, 4]


def test_each_sections_programs_are_handed_to_the_compiler_before_the_next_section_is_traced(tmp_path, tiny,
                                                                                             monkeypatch):
    """lowered_programs yields a section's two compiles as soon as it is lowered (compile_side_by_side
    starts them while the next is traced), skips the sections the parts file holds, and ends with
    the scratch step."""
    from codesign.engine.probe import gpu_sections as engine

    events = []

    def fake_section(kind, precision, sizes):
        events.append(f"trace {precision} {kind}")
        return SimpleNamespace(lowered=SimpleNamespace(compile=f"{precision} {kind} loop"),
                               init=SimpleNamespace(compile=f"{precision} {kind} init"))

    monkeypatch.setattr(engine, "mixer_section", fake_section)
    monkeypatch.setattr(engine, "scratch_step", lambda widths: SimpleNamespace(compile=lambda options: "scratch"))
    parts = engine.Parts(tmp_path / "p.json.parts")
    parts.data["fp32 DOT"] = {}
    sections = {}
    programs = []
    for name, program in engine.lowered_programs(parts, tiny, sections):
        events.append(f"compile {' '.join(name)}")
        programs.append(program)
    names = [f"{p} {k}" for p in ("fp32", "bf16") for k in (*MIXERS, LAYER) if f"{p} {k}" != "fp32 DOT"]
    assert events == [e for name in names for e in (f"trace {name}", f"compile {name} lowered", f"compile {name} init")
                      ] + ["compile scratch step"]
    assert sorted(sections) == sorted(names) and programs[:2] == ["fp32 LINEAR loop", "fp32 LINEAR init"]
    assert programs[-1]() == "scratch"


def test_sections_are_saved_as_they_come_and_a_rerun_measures_only_what_is_missing(tmp_path, tiny, monkeypatch):
    from codesign.engine.probe import gpu_sections as engine

    path = tmp_path / "p.json.parts"
    parts = engine.Parts(path)
    assert parts.get("matmul", lambda: {"fp32": 1e9, "bf16": 2e9}) == {"fp32": 1e9, "bf16": 2e9}
    assert json.loads(path.read_text()) == {"matmul": {"fp32": 1e9, "bf16": 2e9}}
    points = {"forward": [list(p) for p in FORWARD], "backward": [list(p) for p in BACKWARD]}
    parts.data.update({"bandwidth": 1e10, "dispatch": 1e-4, "scratch": 0.5, "collectives": {},
                       **{f"{p} {k}": points for p in ("fp32", "bf16") for k in (*MIXERS, LAYER)}})
    del parts.data["bf16 LAYER"]
    path.write_text(json.dumps(parts.data))

    measured = []

    def fake_section(kind, precision, sizes):
        measured.append((kind, precision))
        return SimpleNamespace(lowered=SimpleNamespace(compile=None), init=SimpleNamespace(compile=None))

    def never(*_):
        raise AssertionError("a section of the parts file was measured again")

    monkeypatch.setattr(engine, "mixer_section", fake_section)
    monkeypatch.setattr(engine, "compile_side_by_side", lambda lowered: {name: None for name, _ in lowered})
    monkeypatch.setattr(engine, "mixer_points", lambda program, section, sizes: points)
    for name in ("matmul_rates", "stream_bandwidth", "dispatch_time", "scratch_fraction", "collective_times"):
        monkeypatch.setattr(engine, name, never)
    profile = engine.loop_profile(engine.Parts(path), tiny)
    assert measured == [(LAYER, "bf16")]
    assert "bf16 LAYER" in json.loads(path.read_text())
    assert profile.bandwidth == 1e10 and profile.rate("bf16", LAYER).forward_points == FORWARD
    assert profile.rate("bf16", ENCODER_PAIR) == profile.rate("bf16", "ATTENTION")  # no pair timed: ATTENTION's
    halved = {k: [[w, s / 2] for w, s in v] for k, v in points.items()}
    parts = engine.Parts(path)
    parts.data["fp32 ATTENTION"] = {**points, "pair": halved}
    paired = engine.loop_profile(parts, tiny)
    assert paired.rate("fp32", ENCODER_PAIR).forward_points == tuple((w, s / 2) for w, s in FORWARD)
    assert paired.rate("fp32", "ATTENTION").forward_points == FORWARD


def test_collectives_are_timed_in_one_loop_over_every_local_device():
    code = """
        import json
        from codesign.engine.probe.gpu_sections import collective_times, fitted_link
        from codesign.engine.probe.loops import LoopSizes
        found = collective_times(LoopSizes(64, 2**16, ((8, 2, 4),), (2,), (2**12, 2**16), 0.002))
        print(json.dumps([found, vars(fitted_link(found, 2))]))
    """
    found, link = json.loads(run_on_devices(2, code, xla_flags="").stdout.strip().splitlines()[-1])
    assert set(found) == {"all-reduce", "all-gather", "reduce-scatter"}
    for points in found.values():
        assert [s for s, _ in points] == [2**12, 2**16] and all(0 < t < 0.1 for _, t in points)
    assert link["bandwidth"] > 1e6 and 1e-8 < link["latency"] < 1e-2
