"""Fewer, steadier calibrations (issue 55, item 4): each point carries its steps' own noise (p90 /
median - 1 of the attempt's measured steps), and a refit is kept only when its held-out gain
exceeds the held-out points' noise: a gain within it is a calibration chasing the noise."""

import dataclasses

import numpy as np
import pytest

from codesign.cost.learning import Calibration, errs_less, refit, steps_noise
from codesign.outcome import Outcome
from codesign.run.learning import point_of
from tests.test_learning import BASE, JOBS, cache, learn, learner, points  # noqa: F401


def noisy(pool, noise: float | None):
    return [dataclasses.replace(p, noise=noise) for p in pool]


def test_a_refit_is_kept_only_when_its_held_out_gain_exceeds_the_steps_noise():
    """Steps at 1.5x the base price: the base profile errs 33% on the held-out points, a refit far
    less (10%). Its gain is evidence against noise below it, none against noise above it."""
    pool = points(JOBS, 1.5)
    quiet = refit(BASE, noisy(pool, None), None, 1, 0.0)
    gain = quiet.previous_error - quiet.held_out_error
    assert quiet.accepted and quiet.noise == 0.0 and gain > 0.2
    kept = refit(BASE, noisy(pool, 0.5 * gain), None, 1, 0.0)
    assert kept.accepted and kept.noise == pytest.approx(0.5 * gain)
    rejected = refit(BASE, noisy(pool, 1.1 * gain), None, 1, 0.0)
    assert not rejected.accepted and rejected.noise == pytest.approx(1.1 * gain)
    assert (rejected.held_out_error, rejected.previous_error) == (kept.held_out_error, kept.previous_error)
    assert f"steps' noise {1.1 * gain:.1%}, rejected" in rejected.summary()


def test_a_rejected_refit_leaves_the_calibration_in_use(cache):
    """Points whose steps vary by 40% cannot show that the newest third is priced 33% better."""
    machine = learner(cache)
    for point in noisy(points(JOBS[:6], 1.5), 0.4):
        learn(machine, point)
    (version,) = machine.versions()
    assert not version.accepted and version.noise == pytest.approx(0.4)
    assert machine.current is None and machine.profile == BASE


def test_the_noise_is_the_median_of_the_points_that_measured_one():
    pool = points(JOBS[:4])
    assert steps_noise(noisy(pool, None)) == 0.0
    measured = [dataclasses.replace(p, noise=n) for p, n in zip(pool, (0.02, None, 0.3, 0.05))]
    assert steps_noise(measured) == pytest.approx(0.05)


def test_the_gain_must_exceed_the_noise_by_its_standard_error():
    previous = np.array([0.30, 0.30, 0.30, 0.30])
    found = np.array([0.10, 0.12, 0.08, 0.10])  # a gain of 0.20, standard error 0.008
    assert errs_less(found, previous, 1.0, 0.19) and not errs_less(found, previous, 1.0, 0.195)
    assert not errs_less(found, previous, 1.0, 0.21)


def test_a_point_carries_the_noise_of_its_steps():
    metrics = {"median": 0.020, "p90": 0.023, "max_memory": 1e6, "jobs_beside": 0}
    assert point_of(JOBS[0], Outcome("succeeded", metrics=metrics), (), "a.db#1", "").noise == pytest.approx(0.15)
    # no p90 (a job body of an earlier codesign): its noise is not known
    del metrics["p90"]
    assert point_of(JOBS[0], Outcome("succeeded", metrics=metrics), (), "a.db#2", "").noise is None


def test_a_calibrations_file_from_before_reads_with_no_noise():
    version = refit(BASE, points(JOBS, 1.5), None, 1, 0.0)
    old = {k: v for k, v in version.to_dict().items() if k != "noise"}
    assert Calibration.from_dict(old) == dataclasses.replace(version, noise=0.0)
