"""The cost model that learns (issue 49): refits are kept only when held-out error falls, two
sweeps into two DBs feed one machine's calibration, each attempt records the calibration that
priced it, reprice uses the latest, memory is an upper bound, and the co-design fast pass still
prices as estimate does under a calibration."""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from codesign.config.hosts import Hosts
from codesign.config.jobs import PlannedJob
from codesign.config.types import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec
from codesign.outcome import OOM, Outcome
from codesign.cost.model import Workload, estimate
from codesign.hardware.profiles import BUILTIN, DeviceProfile, ProfileBook, profile_id
from codesign.cost.calibration import COMPONENTS
from codesign.cost.learning import Calibration, Point, calibrated, memory_bound, refit
from codesign.cost.plan import make_plan
from codesign.run.learning import Learner
from codesign.run.profile_cache import ProfileCache, profiles_for, this_machine
from codesign.run.reprice import fitted_calibrations, reprice
from codesign.run.sweep import Pricing, run_sweep
from codesign.store.database import Store
from tests.conftest import db_rows
from tests.test_ranking import fast_pass_is_auto_search

BASE = BUILTIN["cpu"]
MODEL = ModelSpec(16, 8, 4, 2, (("DOT", "LINEAR"),) * 2)
# (devices, (pp, dp, op), micro-batches): every plan kind on 2 and 4 virtual CPU devices
PLANS = [(2, (1, 2, 1), 1), (2, (1, 1, 2), 1), (4, (1, 4, 1), 1), (4, (1, 2, 2), 1), (4, (2, 2, 1), 2),
         (2, (1, 2, 1), 2), (4, (1, 1, 4), 1), (4, (2, 1, 2), 4), (4, (1, 4, 1), 4), (2, (2, 1, 1), 2),
         (4, (2, 2, 1), 4), (1, (1, 1, 1), 1)]


def job(devices: int, pp_dp_op: tuple[int, int, int], micro: int, batch: int = 8) -> Job:
    parallel = ParallelSpec("manual", (micro,), pp_dp_op[0], pp_dp_op=pp_dp_op)
    return Job(MODEL, ClusterSpec(1, devices, "NVLink", "cpu"), TrainingSpec(batch, 3), parallel, micro, "cpu")


JOBS = [job(*plan) for plan in PLANS]


def base_seconds(j: Job) -> float:
    return estimate(Workload.of(j, BASE), make_plan(j)).seconds


def base_peak(j: Job) -> float:
    return estimate(Workload.of(j, BASE), make_plan(j)).peak_bytes


class Measured:
    """An executor whose jobs have finished when asked: each measured at `times` its base price."""

    def __init__(self, times: float = 1.5):
        self.times = times

    def can_start(self, job, running):
        return True

    def start(self, job, timeout, plans=(), log=None, running=(), then=None, power_limits=None):
        return job

    def wait(self, running, seconds):
        return [(j, Outcome("succeeded", metrics={"median": self.times * base_seconds(j),
                                                  "max_memory": base_peak(j)}, duration=1.0)) for j in running]

    def cancel(self, handle):
        pass

    def close(self):
        pass


@pytest.fixture
def cache(tmp_path, monkeypatch) -> ProfileCache:
    """A fresh profile cache, used (the suite's CODESIGN_PROFILE=builtin uses none)."""
    monkeypatch.delenv("CODESIGN_PROFILE", raising=False)
    monkeypatch.delenv("CODESIGN_LEARNING", raising=False)
    return ProfileCache(tmp_path / "profiles")


def sweep(db, jobs, cache: ProfileCache, times: float = 1.5) -> Pricing:
    pricing = Pricing(profiles_for(Hosts.local(0), cache=cache))
    store = Store(db)
    try:
        run_sweep([PlannedJob(j) for j in jobs], store, Measured(times), retry_failed=False, manual_timeout=60,
                  pricing=pricing)
    finally:
        store.close()
    return pricing


def learner(cache: ProfileCache) -> Learner:
    return Learner.load(this_machine("cpu", Hosts.local(0)), cache, BASE)


def learn(machine: Learner, point: Point) -> None:
    """What a sweep does with a point, with no job running: add it, then refit where due."""
    machine.learn(point)
    if machine.refit_due():
        machine.refit()


def recorded_calibration(row: dict):
    return json.loads(row["all_configs"])["prediction"]["calibration"]


def points(jobs, times: float = 1.5, calibration: Calibration | None = None) -> list[Point]:
    """The jobs measured at `times` their price under the calibration (None: the base profile)."""
    profile = calibrated(BASE, calibration)
    found = []
    for i, j in enumerate(jobs):
        e = estimate(Workload.of(j, profile), make_plan(j))
        found.append(Point(j, make_plan(j), (), "succeeded", times * e.seconds, e.peak_bytes, f"test.db#{i}"))
    return found


def test_a_refit_that_makes_held_out_error_worse_is_rejected_and_the_previous_one_stays(cache):
    # The machine's steps are exactly what calibration 1 prices: any refit (drawn toward the base
    # profile) can only price the held-out ones worse than it does.
    first = refit(BASE, points(JOBS[:6], 1.5), None, 1, 0.0)
    assert first.accepted and first.previous_error == pytest.approx(1 / 3)
    machine = learner(cache)
    machine._save([first])
    machine = learner(cache)
    assert machine.current == first
    for point in points(JOBS[:8], 1.0, first):
        learn(machine, point)
    versions = machine.versions()
    assert [(v.version, v.accepted) for v in versions] == [(1, True), (2, False)]
    assert versions[1].points == 8 and versions[1].previous_error < 1e-9 < versions[1].held_out_error
    assert machine.current == first and machine.profile.calibration.version == 1
    assert learner(cache).current == first


def test_a_refit_is_due_at_six_points_then_at_a_fifth_more(cache):
    """Due by the pool's count, which the learner keeps without reading the pool (until its first
    refit has read it, a refit may be due)."""
    machine = learner(cache)
    fitted, due = [], []
    for point in points(JOBS, 1.5):
        machine.learn(point)
        due.append(machine.refit_due())
        machine.refit()
        fitted.append(len(machine.versions()))
    assert fitted == [0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4]  # refits at 6, 8, 10 and 12 points
    assert due == [True, False, False, False, False, True, False, True, False, True, False, True]
    assert machine.current.version == max(v.version for v in machine.versions() if v.accepted)
    assert all(v.held_out_error < v.previous_error for v in machine.versions() if v.accepted)


def test_two_sweeps_into_two_dbs_feed_one_calibration_and_leave_each_others_db_alone(tmp_path, cache):
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    sweep(a, JOBS[:4], cache)
    before = db_rows(a)
    sweep(b, JOBS[4:8], cache)
    assert db_rows(a) == before
    assert [r["job_key"] for r in db_rows(b)] != [r["job_key"] for r in before] and len(db_rows(b)) == 4
    pooled = learner(cache).points()
    assert [p.source.split("#")[0] for p in pooled] == [str(a)] * 4 + [str(b)] * 4
    first, second = learner(cache).versions()  # at the sixth point (four of a's, two of b's) and the eighth
    assert (first.points, second.points) == (6, 8) and first.accepted
    assert learner(cache).current == (second if second.accepted else first)


def test_each_attempt_records_the_calibration_that_priced_it(tmp_path, cache):
    pricing = sweep(tmp_path / "a.db", JOBS[:8], cache)
    found = db_rows(tmp_path / "a.db")
    assert [recorded_calibration(r) for r in found] == [None] * 6 + [1] * 2
    profile = pricing.book.for_job(JOBS[0])
    assert profile.calibration.version == 1 and profile_id(profile) != profile_id(BASE)
    assert {r["profile_id"] for r in found[6:]} == {profile_id(profile)}
    # priced after the refit, the jobs are closer to their measured 1.5x than the base profile prices
    for r in found[6:]:
        assert abs(r["predicted_time"] / r["median"] - 1) < 0.2
    for r in found[:6]:
        assert r["predicted_time"] == pytest.approx(r["median"] / 1.5, rel=1e-9)
    # the DB keeps a copy of the calibrated profile that priced them
    store = Store(tmp_path / "a.db")
    kept = {profile_id(p) for p in store.stored_profiles(DeviceProfile.from_dict)}
    store.close()
    assert kept == {profile_id(BASE), profile_id(profile)}


def test_reprice_keeps_what_was_predicted_and_says_which_repricings_the_calibration_was_fitted_to(
        tmp_path, cache, monkeypatch):
    """The latest calibration prices every attempt again, beside what it predicted before it ran;
    in-sample only where it was fitted to that attempt: one of the machine's points, finished
    before the fit. Not in-sample: attempts that finished after it (a.db's last two, run with
    learning off), nor ones that finished before it but were never points (c.db's)."""
    monkeypatch.setenv("CODESIGN_LEARNING", "0")
    sweep(tmp_path / "c.db", JOBS[:3], cache, times=1.4)
    monkeypatch.delenv("CODESIGN_LEARNING")
    sweep(tmp_path / "a.db", JOBS[:8], cache)
    monkeypatch.setenv("CODESIGN_LEARNING", "0")
    sweep(tmp_path / "a.db", JOBS[8:10], cache)
    monkeypatch.delenv("CODESIGN_LEARNING")
    current = learner(cache).current
    found = {}
    for db in ("a.db", "c.db"):
        before = db_rows(tmp_path / db)
        store = Store(tmp_path / db)
        try:
            profiles = profiles_for(Hosts.local(0), store, cache=cache)
            found[db] = reprice(store, store.attempts(), profiles.book, (),
                                fitted_calibrations(profiles.learners.values()))
        finally:
            store.close()
        assert db_rows(tmp_path / db) == before
    assert (found["a.db"].beside, found["a.db"].simulated, found["c.db"].beside) == (10, 0, 3)
    repriced = db_rows(tmp_path / "a.db", "repricings")
    assert [r["attempt_id"] for r in repriced] == [r["id"] for r in db_rows(tmp_path / "a.db")]
    assert {(r["calibration"], r["profile_id"]) for r in repriced} == {
        (current.version, profile_id(learner(cache).profile))}
    # the 7th and 8th are points: in-sample where the calibration in use came after them (a refit
    # at the 8th point, or a memory bound they raised), not where it was fitted at the 6th
    after_the_sixth = [int(r["finished_at"] <= current.created) for r in db_rows(tmp_path / "a.db")[6:8]]
    assert [r["in_sample"] for r in repriced] == [1] * 6 + after_the_sixth + [0, 0]
    assert [r["in_sample"] for r in db_rows(tmp_path / "c.db", "repricings")] == [0, 0, 0]


def test_no_learning_prices_by_the_base_profile_and_keeps_no_points(tmp_path, cache, monkeypatch):
    assert profiles_for(Hosts.local(0), cache=cache, learning=False).learners == {}
    monkeypatch.setenv("CODESIGN_LEARNING", "0")
    pricing = sweep(tmp_path / "a.db", JOBS[:8], cache)
    assert pricing.book.for_job(JOBS[0]) == BASE
    assert learner(cache).points() == [] and learner(cache).versions() == []
    assert [recorded_calibration(r) for r in db_rows(tmp_path / "a.db")] == [None] * 8


def test_the_memory_bound_covers_the_measured_peaks_and_an_oom_raises_it():
    measured = points(JOBS[:8])
    peaks = [dataclasses.replace(p, peak=p.peak * (1 + 0.02 * i)) for i, p in enumerate(measured)]
    assert memory_bound(BASE, peaks) == pytest.approx(1.14 / 1.025)  # the highest of eight: none 2.5% above it
    big = job(4, (1, 4, 1), 1, batch=64)
    small = dataclasses.replace(BASE, memory=int(1.3 * base_peak(big)))  # the big job fits, as priced
    oom = Point(big, make_plan(big), (), OOM, None, None, "test.db#9")
    assert memory_bound(small, [*peaks, oom]) == pytest.approx(1.3, rel=1e-6)
    bound = calibrated(small, refit(small, [*peaks, oom], None, 1, 0.0))
    assert estimate(Workload.of(big, small), make_plan(big)).fits
    assert not estimate(Workload.of(big, bound), make_plan(big)).fits


def test_the_co_design_fast_pass_prices_as_estimate_under_a_calibration():
    calibration = dataclasses.replace(refit(BASE, points(JOBS, 1.5), None, 1, 0.0),
                                      plan_factors=(("dp", 0.6), ("op", 1.7), ("dp x op", 0.8)), memory_factor=1.3)
    book = ProfileBook()
    book.add(calibrated(BASE, calibration))
    ranked = fast_pass_is_auto_search(ClusterSpec(1, 4, "NVLink", "sim", "cpu"), 1, book)
    assert np.isfinite(ranked.seconds).any()


def test_a_peak_above_its_prediction_raises_the_memory_bound_at_once(cache):
    machine = learner(cache)
    first, second = points(JOBS[:2])
    machine.learn(first)
    assert machine.versions() == []  # at its prediction: nothing to raise, too few points to refit
    assert machine.learn(dataclasses.replace(second, peak=second.peak * 1.25))
    (version,) = machine.versions()
    assert version.memory_only and version.accepted and version.memory_factor == pytest.approx(1.25 / 1.025)
    assert dict(version.factors) == dict.fromkeys(COMPONENTS, 1.0) and version.plan_factors == ()
    assert machine.profile.calibration.memory_factor == pytest.approx(1.25 / 1.025) and machine.profile.calibration.version == 1


def test_codesign_profile_lists_the_machines_calibrations_without_measuring(tmp_path, monkeypatch, capsys):
    """`codesign profile --calibrations`: every version on stdout, one line each, oldest first;
    none yet is said on stderr, exit 0; nothing is measured or written."""
    from codesign.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(["profile", "--platform", "cpu", "--calibrations"]) == 0
    none = capsys.readouterr()
    assert none.out == "" and "no calibration of the cpu devices" in none.err
    machine = Learner.load(this_machine("cpu", Hosts.local(0)), ProfileCache(), BASE)
    for point in points(JOBS[:8], 1.5):
        learn(machine, point)
    assert main(["profile", "--platform", "cpu", "--calibrations"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [v.summary() for v in machine.versions()] and len(lines) == 2
    assert lines[0].startswith("calibration 1: 6 points, held-out error ") and ", accepted; memory x" in lines[0]
    assert sorted(p.name for p in (tmp_path / "xdg" / "codesign" / "profiles").iterdir()) == [
        f"{machine.machine.key}.{suffix}" for suffix in ("calibrations.json", "calibrations.json.bak", "points.jsonl")]


def test_learning_replay_prices_recorded_points_under_each_prior(tmp_path, capsys, monkeypatch):
    """bench/learning_replay.py on a run whose steps all took 1.5x their base price: a fit to
    either half prices the other closer than the base profile's 33%, the weaker prior closer;
    --time-refits times a refit within the window and without one."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import learning_replay

    pool = tmp_path / "run" / "cache-learning" / "key.points.jsonl"
    pool.parent.mkdir(parents=True)
    pool.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in points(JOBS, 1.5)))
    monkeypatch.setattr(sys, "argv", ["learning_replay.py", str(tmp_path / "run"), "--priors", "0.03", "3"])
    assert learning_replay.main() == 0
    lines = capsys.readouterr().out.splitlines()
    found = [re.search(r"two-fold ([\d.]+)% \(base profile ([\d.]+)%\).* all ([\d.]+)%", line) for line in lines]
    (weak, base, _), (strong, base_again, _) = [[float(x) for x in m.groups()] for m in found]
    assert base == base_again == pytest.approx(33.3, abs=0.05)
    assert weak < strong < base and lines[0].startswith("prior 0.03, ") and "12 points" in lines[0]
    monkeypatch.setattr(sys, "argv", ["learning_replay.py", "--time-refits", "12", "--priors", "0.3"])
    assert learning_replay.main() == 0
    timed = capsys.readouterr().out.splitlines()
    assert [re.sub(r"[\d.]+ s$", "S", line) for line in timed] == ["refit of 12 points (window 300): S",
                                                                    "refit of 12 points (window 12): S"]


def test_on_a_machine_its_model_can_express_the_learner_converges_as_noise_allows(monkeypatch, capsys):
    """learning_replay --synthetic: bench_learning's jobs on a made-up machine (the built-in
    profile, each component and plan kind scaled) measured with 1% noise, as steady as a GPU's
    steps: a sweep's last third is priced within 3%, at most 0.5x its first third's error and
    below the base profile's (issue 55's goal); the next sweep's models start within 2x of that."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import learning_replay

    monkeypatch.setattr(sys, "argv", ["learning_replay.py", "--synthetic", "0.01", "--seeds", "1", "--priors", "0.3",
                                      "--truth-spread", "0.5"])
    assert learning_replay.main() == 0
    (line,) = capsys.readouterr().out.splitlines()
    found = re.search(r"noise 1%, machine 0 \(base profile off by ([\d.]+)%\).* thirds ([\d.]+)% / \.\. / ([\d.]+)%.*"
                      r"second sweep's first third ([\d.]+)%", line)
    unfitted, first, last, other = (float(x) / 100 for x in found.groups())
    assert unfitted > 0.15  # the made-up machine is far from the base profile
    assert last < 0.03 and last <= 0.5 * first and last < unfitted and other < 2 * last


def test_a_refit_fits_the_newest_points_of_its_window_only():
    """Past the window, older points no longer move the time factors; the memory bound still
    covers every point."""
    old = points(JOBS[:6], 3.0)
    old = [dataclasses.replace(p, peak=p.peak * 1.5) for p in old]
    new = points(JOBS[6:], 1.2)
    windowed = refit(BASE, [*old, *new], None, 1, 0.0, window=6)
    alone = refit(BASE, new, None, 1, 0.0)
    assert windowed.factors == alone.factors and windowed.plan_factors == alone.plan_factors
    assert windowed.points == 12 and windowed.memory_factor == pytest.approx(1.5 / 1.025)
    assert refit(BASE, [*old, *new], None, 1, 0.0).factors != alone.factors
