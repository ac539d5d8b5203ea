"""The profile's calibration: the factors fitted to real probe steps (cost/calibration.py,
pure: its tests import no JAX) and the CPU probes that time them (engine/probe/, in children)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from codesign.cost.calibration import (
    COMPONENTS,
    WIDE_PROBE,
    fitted_factors,
    probe_jobs,
    scaled,
)
from codesign.cost.model import Workload, estimate
from codesign.cost.plan import make_plan
from codesign.hardware.profiles import BUILTIN
from tests.conftest import FAST_XLA, run_on_devices


def predicted(profile, jobs):
    return [estimate(Workload.of(j, profile), make_plan(j)).seconds for j in jobs]


def test_the_probe_steps_cover_every_fitted_component_on_eight_cpu_devices():
    jobs = probe_jobs(8)
    kinds = {(j.parallel.pp_dp_op, j.num_micro_batches > 1) for j in jobs}
    assert kinds == {((1, 1, 1), False), ((1, 1, 1), True), ((1, 2, 1), False), ((1, 8, 1), False),
                     ((2, 1, 4), True)}
    assert [j.cluster.num_devices for j in probe_jobs(1)] == [1] * 4
    assert sorted({j.cluster.num_devices for j in jobs}) == [1, 2, 8]  # a process each: no more
    assert len(jobs) == 7  # each a compile, most of a CPU profile's time
    assert {j.model.num_features for j in jobs if j.parallel.pp_dp_op == (1, 2, 1)} == {WIDE_PROBE[0]}  # gradients to copy
    deep = [j for j in jobs if j.model.num_zhen_layers == 4]  # matmul-heavy: the pipeline contends as in sweeps
    assert [(j.cluster.num_devices, j.parallel.pp_dp_op, j.model.tokens[0]) for j in deep] == [
        (8, (2, 1, 4), ("DOT", "ATTENTION", "LINEAR"))]


@pytest.mark.parametrize("truth", [dict(fixed=0.5, flops=2.0, memory=3.0, sync=4.0, contention=1.3),
                                   dict(fixed=1.5, flops=0.7, memory=1.0, sync=0.5, contention=1.8)])
def test_factors_are_recovered_from_steps_the_cost_model_would_predict(truth):
    """Unpenalised, the fit recovers the factors that made the steps; drawn toward the
    micro-benchmarks, it still fits the steps, with factors no further from 1 than the truth."""
    probed = BUILTIN["cpu"]
    assert probed.shared.sync_traffic > 0 and probed.shared.contention > 0
    jobs = probe_jobs(8)
    measured = predicted(scaled(probed, truth), jobs)
    found = fitted_factors(probed, jobs, measured, prior=0.0)
    assert set(found) == set(COMPONENTS)
    for k in COMPONENTS:
        assert found[k] == pytest.approx(truth[k], rel=0.05), (k, found)
    assert predicted(scaled(probed, found), jobs) == pytest.approx(measured, rel=0.02)
    drawn = fitted_factors(probed, jobs, measured)
    misses = np.abs(np.array(predicted(scaled(probed, drawn), jobs)) / measured - 1)
    assert np.median(misses) < 0.06 and misses.max() < 0.15  # 5.2% with truth0 once CONVOLUTION ran 50x faster
    assert sum(np.log(v) ** 2 for v in drawn.values()) <= sum(np.log(v) ** 2 for v in truth.values())


def test_a_component_no_probe_exercises_keeps_its_micro_benchmark():
    jobs = probe_jobs(1)  # one device: no all-reduce, so nothing to fit "sync" to,
    probed = BUILTIN["cpu"]
    measured = [1.3 * t for t in predicted(probed, jobs)]
    found = fitted_factors(probed, jobs, measured)
    assert found["sync"] == found["contention"] == 1.0  # nor a pipeline to fit "contention" to


@pytest.mark.slow
def test_the_shared_core_probe_times_the_probe_models_gradients_on_each_device_count():
    out = run_on_devices(2, "import json\nfrom codesign.engine.probe.cpu_benchmarks import measured, speedup\n"
                            "print(json.dumps(measured(speedup(1))))", xla_flags="").stdout.strip().splitlines()[-1]
    peak, points = json.loads(out)
    assert peak > 1e8 and [n for n, _ in points] == [1, 2]
    assert points[0][1] == 1.0 and 1.0 <= points[1][1] <= 2.5  # two devices: at worst they take turns


def test_probe_steps_start_from_host_drawn_parameters_of_the_models_shapes_compiling_nothing():
    """A probe step is timed, never compared: its stage's parameters are drawn on the host, the
    tree, shapes and dtypes of the model's own initialisation, without compiling its program."""
    out = run_on_devices(1, """
        import json, jax, numpy as np
        from codesign.engine.probe.probe_steps import probe_params
        from codesign.engine.programs import initial_params
        from codesign.cost.calibration import probe_jobs
        compiles = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else 0)
        model = probe_jobs(8)[-1].model  # the 4-layer "dot" probe; a pipeline's second stage
        drawn = probe_params(model, (2, 3), 0)
        drawing = len(compiles)
        initial = initial_params(model, (2, 3), 0)
        same = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), drawn, initial)
        print(json.dumps({"compiles": [drawing, len(compiles)], "layers": sorted(drawn),
                          "same": jax.tree.structure(drawn) == jax.tree.structure(initial)
                                  and all(jax.tree.leaves(same)),
                          "std": [float(np.std(a)) for a in jax.tree.leaves(drawn) if a.size >= 256]}))
        """, xla_flags="").stdout.strip().splitlines()[-1]
    found = json.loads(out)
    assert found["compiles"][0] == 0 and found["compiles"][1] > 0  # the model's own init compiles
    assert found["layers"] == ["layer_2", "layer_3"] and found["same"]
    assert found["std"] and all(0.04 < s < 0.06 for s in found["std"])


@pytest.mark.slow
def test_the_micro_benchmarks_time_calls_on_arrays_already_on_the_device():
    """Their inputs are drawn on the host (nothing compiled) and placed once: a timed call that
    copied them in again would price every mixer call with a host transfer."""
    run_on_devices(2, """
        import jax
        from codesign.engine.probe.cpu_benchmarks import link, measured, mixer_times, speedup
        with jax.transfer_guard_host_to_device("disallow"):
            for bench in (mixer_times("LINEAR", 1), mixer_times("DOT", 1), speedup(1), link(1)):
                measured(bench)
        """, xla_flags="")


def test_the_cpu_link_latency_is_one_more_array_in_a_program_reducing_many():
    code = ("import json\nfrom codesign.engine.probe.cpu_benchmarks import link, measured\n"
            "print(json.dumps(vars(measured(link(1)))))")
    found = json.loads(run_on_devices(2, code, xla_flags="").stdout.strip().splitlines()[-1])
    assert found["bandwidth"] > 1e7 and 1e-8 < found["latency"] < 1e-3


def test_the_fit_runs_without_jax():
    code = ("import sys\nfrom codesign.cost.calibration import fitted_factors, probe_jobs\n"
            "from codesign.hardware.profiles import BUILTIN\n"
            "fitted_factors(BUILTIN['cpu'], probe_jobs(1), [0.01] * 4)\nassert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_probe_steps_on_fewer_devices_are_timed_in_a_child_that_sees_only_those(monkeypatch):
    """The child compiles its probe steps once, then times a round each time it is asked."""
    from codesign.engine.probe.probe_steps import (  # JAX: here only
        PROBE_ROUNDS,
        PROBE_SECONDS,
        ChildProbes,
    )

    monkeypatch.setenv("XLA_FLAGS", FAST_XLA)  # the child inherits it: its compiles are most of the test

    child = ChildProbes(1, 1)
    try:
        child.ready()  # raises unless the child saw exactly one device
        rounds = [child.round(), child.round()]
    finally:
        child.close()
    assert child.proc.returncode == 0
    for times in rounds:
        assert len(times) == len(probe_jobs(1)) == 4
        assert all(sum(t) >= PROBE_SECONDS / PROBE_ROUNDS and 0 < min(t) < 5 for t in times)


def test_a_cpu_profile_compiles_every_program_before_it_times_any(tmp_path, monkeypatch):
    """The probe children start first, then this process compiles its micro-benchmarks and
    probes; nothing is timed before every program (the children's too) is compiled."""
    from types import SimpleNamespace

    from codesign.engine.probe import cpu_profile as engine  # JAX: here only
    from codesign.hardware.links import Link
    from codesign.hardware.profiles import LAYER
    from codesign.config.types import MIXERS

    events = []

    def bench(name, value):
        events.append(f"start {name}")
        yield
        events.append(f"time {name}")
        return value

    class Probes:
        def __init__(self, devices):
            self.devices = devices

        def ready(self):
            events.append(f"ready {self.devices}")

        def round(self):
            events.append(f"time steps {self.devices}")
            return [[0.01]]

        def close(self):
            events.append(f"close {self.devices}")

    class Child(Probes):
        def __init__(self, devices, repeats):
            super().__init__(devices)
            events.append(f"start child {devices}")

    class Local(Probes):
        def __init__(self, jobs, repeats, pool=None):
            super().__init__(0)
            events.append("compile local steps")

    def job(devices):
        return SimpleNamespace(cluster=SimpleNamespace(num_devices=devices), num_micro_batches=1, global_batch=8,
                               parallel=SimpleNamespace(pp_dp_op=(1, devices, 1)))

    n = len(engine.jax.devices())
    values = {"bandwidth": 1e10, "dispatch": 1e-4, "call": 1e-5, "speedup": (1e10, [(1, 1.0)]),
              "link": Link(1e9, 1e-5), **{f"fp32 {k}": [(1e-4, 2e-4), (1e-3, 2e-3)] for k in (*MIXERS, LAYER)}}
    monkeypatch.setattr(engine, "probe_jobs", lambda _: [job(n), job(n + 1)])
    monkeypatch.setattr(engine, "ChildProbes", Child)
    monkeypatch.setattr(engine, "LocalProbes", Local)
    monkeypatch.setattr(engine, "micro_benchmarks", lambda _: {k: bench(k, v) for k, v in values.items()})
    monkeypatch.setattr(engine, "update_scratch", lambda _: events.append("compile scratch") or 0.1)
    monkeypatch.setattr(engine, "fitted_factors", lambda *_: {})
    profile = engine.cpu_profile(engine.Parts(tmp_path / "p.json.parts"), repeats=1)

    first_time = next(i for i, e in enumerate(events) if e.startswith("time"))
    assert events[0] == f"start child {n + 1}"
    assert {"compile local steps", "compile scratch", f"ready {n + 1}"} <= set(events[:first_time])
    assert {f"start {k}" for k in values} <= set(events[:first_time])
    assert {f"time {k}" for k in values} | {"time steps 0", f"time steps {n + 1}"} <= set(events[first_time:])
    assert events[-1] == f"close {n + 1}" and profile.bandwidth == 1e10 and profile.link == Link(1e9, 1e-5)
    assert profile.shared.cores == len(os.sched_getaffinity(0))  # what its op groups' fixed costs overlap on
