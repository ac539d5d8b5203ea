"""The learning store survives crashes and shared file systems (issue 55, item 5): calibrations
are replaced through a synced temporary file and a synced directory, points are appended synced
under their lock, a damaged calibrations file falls back to its last good copy (said once) and
fails no command, a sweep that finds another refitting still raises the memory bound, and the
locks are lock files, which hold on NFS where flock may not."""

import dataclasses
import errno
import fcntl
import json
import logging
import os
import threading
import time

import pytest

import codesign.run.learning as learning
from codesign.config.hosts import Hosts
from codesign.cost.calibration import COMPONENTS
from codesign.cost.learning import Calibration, Point, memory_bound
from codesign.cost.plan import make_plan
from codesign.hardware.profiles import profile_id
from codesign.outcome import OOM
from codesign.run.durable import STALE, lock_of, locked
from codesign.run.learning import backup_of, calibration_versions
from codesign.run.profile_cache import ProfileCache, this_machine
from tests.configs import ONE_CPU_DEVICE, SMALL_HEAD
from tests.conftest import db_rows, run_cli
from tests.test_learning import BASE, JOBS, cache, job, learn, learner, points, recorded_calibration  # noqa: F401

CALIBRATION = Calibration(1, profile_id(BASE), tuple(dict.fromkeys(COMPONENTS, 1.2).items()), (), 1.1, 6, 0.1, 0.3,
                          True, 0.0)
ONE_DEVICE = SMALL_HEAD + ONE_CPU_DEVICE + """
[[parallel_spec]]
description = "one device"
num_micro_batches = [1]
"(pp, dp, op)" = [1, 1, 1]
"""
DAMAGED = "calibrations.json does not read (JSONDecodeError"


def synced_and_replaced(monkeypatch) -> list[tuple]:
    """Each os.fsync (the path of the fd it syncs) and os.replace, in order, as they happen."""
    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


def test_calibrations_are_replaced_through_a_synced_temporary_file_then_a_synced_directory(cache, monkeypatch):
    machine = learner(cache)
    path = machine.file("calibrations.json")
    events = synced_and_replaced(monkeypatch)
    machine._save([CALIBRATION])
    first, second = events[1][1], events[4][1]  # the temporary files, beside their targets
    assert events == [("fsync", first), ("replace", first, str(path)), ("fsync", str(cache.root)),
                      ("fsync", second), ("replace", second, str(backup_of(path))), ("fsync", str(cache.root))]
    assert first.startswith(f"{path}.") and second.startswith(f"{backup_of(path)}.")
    assert calibration_versions(cache, machine.machine) == [CALIBRATION]
    assert sorted(p.name for p in cache.root.iterdir()) == [path.name, backup_of(path).name]  # no temporary left


def test_a_cached_profile_is_replaced_through_a_synced_temporary_file_then_a_synced_directory(cache, monkeypatch):
    machine = this_machine("cpu", Hosts.local(0))
    cache.root.mkdir(parents=True)
    events = synced_and_replaced(monkeypatch)
    path = cache.save(machine, BASE)
    temporary = events[0][1]
    assert events == [("fsync", temporary), ("replace", temporary, str(path)), ("fsync", str(cache.root))]
    assert cache.load(machine) == BASE


def test_a_point_is_appended_flushed_and_fsynced_under_its_lock(cache, monkeypatch):
    machine = learner(cache)
    path = machine.file("points.jsonl")
    seen = []
    fsync = os.fsync

    def recorded_fsync(fd):  # what is synced, whether under the pool's lock, and how much was flushed by then
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), lock_of(path).exists(), path.stat().st_size))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    first, second = points(JOBS[:2])
    machine.add(first)
    machine.add(second)
    one = len(json.dumps(first.to_dict())) + 1
    assert seen == [(str(path), True, one), (str(cache.root), False, one),  # a new file: its name synced too
                    (str(path), True, path.stat().st_size)]
    assert [p.source for p in machine.points()] == [first.source, second.source]


def test_a_torn_last_point_is_skipped_said_once_and_ended_before_the_next_append(cache, caplog):
    machine = learner(cache)
    first, torn, third = points(JOBS[:3])
    machine.add(first)
    with machine.file("points.jsonl").open("a") as f:
        f.write(json.dumps(torn.to_dict())[:80])  # a crash mid-append
    with caplog.at_level(logging.WARNING, logger="codesign.run.learning"):
        assert [p.source for p in machine.points()] == [first.source]
        assert [p.source for p in machine.points()] == [first.source]
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "1 unreadable point(s) skipped (a crash mid-append leaves one)"]
    machine.add(third)
    assert [p.source for p in machine.points()] == [first.source, third.source]  # only the torn one is lost


def test_a_damaged_calibrations_file_prices_by_its_last_good_copy_said_once_else_by_the_base_profile(cache, caplog):
    machine = learner(cache)
    machine._save([CALIBRATION])
    path = machine.file("calibrations.json")
    path.write_text(path.read_text()[:200])  # truncated mid-JSON
    with caplog.at_level(logging.WARNING, logger="codesign.run.learning"):
        assert learner(cache).current == CALIBRATION and learner(cache).current == CALIBRATION
    (said,) = caplog.records
    assert said.getMessage().startswith(f"{path} does not read (JSONDecodeError: ")
    assert said.getMessage().endswith("pricing by its last good copy (1 version(s)) until the next calibration "
                                      "replaces it")
    # the next version written replaces the damaged file, after the last good copy's versions
    first, second = points(JOBS[:2])
    machine = learner(cache)
    machine.learn(first)
    assert machine.learn(dataclasses.replace(second, peak=second.peak * 2))
    assert [v.version for v in learning.read_versions(path)] == [1, 2] and machine.current.memory_only
    # with no copy that reads, the base profile prices
    path.write_text('{"versions": [')
    backup_of(path).write_text("")
    assert learner(cache).current is None and learner(cache).profile == BASE


@pytest.fixture
def damaged_cache(tmp_path, monkeypatch):
    """A profile cache (the commands' own, through XDG) whose calibrations file was truncated
    mid-JSON after calibration 1 was written; the commands use it (no CODESIGN_PROFILE=builtin)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CODESIGN_PROFILE", raising=False)
    monkeypatch.delenv("CODESIGN_LEARNING", raising=False)
    machine = learner(ProfileCache())
    machine._save([CALIBRATION])
    path = machine.file("calibrations.json")
    path.write_text(path.read_text()[:150])
    (tmp_path / "c.toml").write_text(ONE_DEVICE)
    return tmp_path


def test_plan_and_profile_run_on_a_truncated_calibrations_file_and_say_so_once(damaged_cache):
    listed = run_cli("profile", "--platform", "cpu", "--calibrations", cwd=damaged_cache, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [CALIBRATION.summary()] and listed.stderr.count(DAMAGED) == 1
    planned = run_cli("plan", "-c", "c.toml", cwd=damaged_cache, timeout=300)
    assert planned.returncode == 0, planned.stderr
    assert planned.stderr.count(DAMAGED) == 1 and "codesign: 2 plans priced" in planned.stderr
    assert "pp1 dp1 op1" in planned.stdout


@pytest.mark.slow
def test_a_sweep_runs_on_a_truncated_calibrations_file_priced_by_its_last_good_copy(damaged_cache):
    ran = run_cli("-c", "c.toml", "-d", "r.db", cwd=damaged_cache, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.count(DAMAGED) == 1
    (row,) = db_rows(damaged_cache / "r.db")
    assert row["status"] == "succeeded" and recorded_calibration(row) == 1


def oom_point() -> Point:
    big = job(4, (1, 4, 1), 1, batch=64)
    return Point(big, make_plan(big), (), OOM, None, None, "b.db#1")


def test_a_sweep_that_finds_another_refitting_still_raises_the_memory_bound(cache, monkeypatch):
    """b's OOM comes in while a refits: b skips the refit but raises the bound; a's refit, fitted
    without b's point, is written with the bound b's point needs, not lower."""
    a, b = learner(cache), learner(cache)
    for point in points(JOBS[:6]):
        a.learn(point)
    fitting, b_changed, b_refitted = learning.refit, [], []

    def refit_while_b_learns(*args, **kwargs):
        b_changed.append(b.learn(oom_point()))
        b_refitted.append(b.refit())
        return fitting(*args, **kwargs)

    monkeypatch.setattr(learning, "refit", refit_while_b_learns)
    assert a.refit()
    bound = memory_bound(BASE, a.points())
    assert b_changed == [True] and b_refitted == [False] and b.current.memory_factor == pytest.approx(bound)
    assert bound > 1.5 and a.current.memory_factor == pytest.approx(bound)
    assert [(v.version, v.memory_only) for v in a.versions()] == [(1, True), (2, False)]


def test_a_raise_waits_for_another_sweeps_write_of_the_calibrations(cache):
    machine = learner(cache)
    path = machine.file("calibrations.json")
    path.parent.mkdir(parents=True)
    held = threading.Event()

    def other_sweep():
        with locked(lock_of(path)):
            held.set()
            time.sleep(0.5)

    other = threading.Thread(target=other_sweep)
    other.start()
    assert held.wait(10)
    start = time.monotonic()
    assert machine.learn(oom_point())
    waited = time.monotonic() - start
    other.join(10)
    assert waited >= 0.4 and machine.versions()[0].memory_only


def test_learning_takes_no_flock_which_nfs_may_refuse(cache, monkeypatch):
    """On NFS without lockd (or Lustre without -o flock), flock fails: learning locks by files."""
    def refused(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    monkeypatch.setattr(fcntl, "lockf", refused)
    machine = learner(cache)
    for point in points(JOBS[:6], 1.5):
        learn(machine, point)
    assert len(machine.points()) == 6 and machine.current.version == 1
    assert sorted(p.suffix for p in cache.root.iterdir()) == [".bak", ".json", ".jsonl"]  # every lock let go


def test_a_lock_left_by_a_crash_is_broken_once_stale(cache, caplog):
    machine = learner(cache)
    lock = lock_of(machine.file("points.jsonl"))
    lock.parent.mkdir(parents=True)
    lock.write_text("node7 pid 4242 0123abcd")
    then = time.time() - STALE - 1
    os.utime(lock, (then, then))
    with caplog.at_level(logging.WARNING, logger="codesign.run.durable"):
        machine.learn(points(JOBS[:1])[0])
    assert len(machine.points()) == 1 and not lock.exists()
    assert f"{lock}: broke a lock held for" in caplog.text and "by node7 pid 4242 (it crashed" in caplog.text
