"""Profiles for a sweep: nothing waits on a profile it does not need, measured ones are kept per
machine and shared, measuring is supervised like a job, and every attempt says what priced it.
The profiler is tests.fault_profile (instant, hanging or crashing), run by tests.fault_cli."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest

from codesign import __version__
from codesign.cost.model import COST_MODEL_VERSION
from codesign.hardware.profiles import BUILTIN, profile_id
from codesign.run.profile_cache import Machine, ProfileCache, profiles_for, this_machine
from codesign.config.hosts import Hosts
from tests.conftest import REPO, db_rows
from tests.fault_trials import FAKE_CONFIG

AUTO_CONFIG = FAKE_CONFIG + """
[[parallel_spec]]
description = "Auto search"
num_micro_batches = [1]
"""


@pytest.fixture
def measuring_env(tmp_path, monkeypatch):
    """A sweep that may measure: no CODESIGN_PROFILE=builtin, an empty cache of its own."""
    env = {k: v for k, v in os.environ.items() if k != "CODESIGN_PROFILE"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO), FAULT_PIDS=str(tmp_path / "pids"),
               FAULT_PROFILE="ok")
    return env


def fault_cli(cwd, env, *args, **extra):
    return subprocess.run([sys.executable, "-m", "tests.fault_cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**env, **extra})


def cached_profile_files(env) -> list:
    root = ProfileCache().root.relative_to(ProfileCache().root.parents[1])  # codesign/profiles
    folder = os.path.join(env["XDG_CACHE_HOME"], root)
    return sorted(f for f in os.listdir(folder) if f.endswith(".json")) if os.path.isdir(folder) else []


def test_manual_jobs_start_at_once_priced_by_the_built_in_profile_and_say_so(tmp_path, measuring_env):
    (tmp_path / "c.toml").write_text(FAKE_CONFIG)
    proc = fault_cli(tmp_path, measuring_env, "-c", "c.toml", "-d", "r.db", FAULT_PROFILE="hang")
    assert proc.returncode == 0, proc.stderr
    assert "measuring" not in proc.stderr and not (tmp_path / "pids").exists()
    rows = db_rows(tmp_path / "r.db")
    builtin = profile_id(BUILTIN["cpu"])
    assert {(r["status"], r["profile_id"], r["cost_model"], r["codesign_version"]) for r in rows} == {
        ("succeeded", builtin, COST_MODEL_VERSION, __version__)}
    conn = sqlite3.connect(tmp_path / "r.db")
    (kept,) = conn.execute("SELECT profile FROM profiles WHERE profile_id = ?", (builtin,)).fetchone()
    assert json.loads(kept) == BUILTIN["cpu"].to_dict()


def test_an_auto_search_job_measures_once_right_before_it_and_every_db_shares_the_profile(tmp_path, measuring_env):
    (tmp_path / "c.toml").write_text(AUTO_CONFIG)
    proc = fault_cli(tmp_path, measuring_env, "-c", "c.toml", "-d", "r.db")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("codesign: measuring the cpu devices") == 1
    assert proc.stderr.index("codesign profile: fake profile") > proc.stderr.index("measuring")
    assert len(cached_profile_files(measuring_env)) == 1
    rows = db_rows(tmp_path / "r.db")
    measured = dict(BUILTIN["cpu"].to_dict(), source="measured")
    ids = [r["profile_id"] for r in rows]
    assert ids[:3] == [profile_id(BUILTIN["cpu"])] * 3  # the manual jobs ran before it was measured
    assert ids[3].startswith("cpu@") and ids[3] != ids[0] and rows[3]["description"] == "Auto search"
    conn = sqlite3.connect(tmp_path / "r.db")
    assert json.loads(conn.execute("SELECT profile FROM profiles WHERE profile_id = ?", (ids[3],)).fetchone()[0]) \
        == measured
    again = fault_cli(tmp_path, measuring_env, "-c", "c.toml", "-d", "other.db", FAULT_PROFILE="hang")
    assert again.returncode == 0 and "measuring" not in again.stderr  # another DB: the cached profile
    assert {r["profile_id"] for r in db_rows(tmp_path / "other.db")} == {ids[3]}


def test_the_profile_compiles_through_the_jobs_persistent_cache(tmp_path, measuring_env):
    (tmp_path / "c.toml").write_text(AUTO_CONFIG)
    env = dict(measuring_env, FAULT_CACHES=str(tmp_path / "caches"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    assert fault_cli(tmp_path, env, "-c", "c.toml", "-d", "r.db").returncode == 0
    assert fault_cli(tmp_path, env, "profile", "--platform", "cpu").returncode == 0
    shared = dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "shared"))
    assert fault_cli(tmp_path, shared, "profile", "--platform", "cpu").returncode == 0
    assert (tmp_path / "caches").read_text().splitlines() == [
        str(tmp_path / "jax_cache"),  # the sweep's: its jobs' cache beside the DB
        os.path.join(env["XDG_CACHE_HOME"], "codesign", "profiles", "jax_cache"),  # no DB: the user's cache
        str(tmp_path / "shared")]  # JAX's own, where the user set one: every job's too


def test_a_sweep_whose_jobs_are_all_skipped_never_profiles(tmp_path, measuring_env):
    (tmp_path / "c.toml").write_text(AUTO_CONFIG)
    env = dict(measuring_env, CODESIGN_PROFILE="builtin")
    assert fault_cli(tmp_path, env, "-c", "c.toml", "-d", "r.db").returncode == 0
    start = time.monotonic()
    proc = fault_cli(tmp_path, measuring_env, "-c", "c.toml", "-d", "r.db", FAULT_PROFILE="hang")
    assert proc.returncode == 0 and "skipped (already recorded or running elsewhere): 4" in proc.stderr
    assert "measuring" not in proc.stderr and not (tmp_path / "pids").exists()
    assert time.monotonic() - start < 30


@pytest.mark.slow
@pytest.mark.drills
@pytest.mark.parametrize("behaviour, problem", [("hang", "timed out after 2 s"), ("crash", "exited with code 1")])
def test_a_profile_that_fails_says_so_in_one_line_and_the_built_in_profile_prices(
        tmp_path, measuring_env, behaviour, problem):
    (tmp_path / "c.toml").write_text(AUTO_CONFIG)
    proc = fault_cli(tmp_path, measuring_env, "-c", "c.toml", "-d", "r.db", FAULT_PROFILE=behaviour,
                     CODESIGN_PROFILE_TIMEOUT="2")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if problem in line]
    assert lines == [f"codesign: profiling the cpu devices (cpu, {this_machine('cpu', Hosts.local(0)).host}) "
                     f"{problem}; pricing with the built-in profile"]
    rows = db_rows(tmp_path / "r.db")
    assert [r["status"] for r in rows] == ["succeeded"] * 4
    assert {r["profile_id"] for r in rows} == {profile_id(BUILTIN["cpu"])}
    assert cached_profile_files(measuring_env) == []
    if behaviour == "hang":
        assert_gone([int(p) for p in (tmp_path / "pids").read_text().split()])


def assert_gone(pids: list[int], grace: float = 10.0) -> None:
    until = time.monotonic() + grace
    alive = pids
    while alive and time.monotonic() < until:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"left running: {alive}"


@pytest.mark.drills
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGKILL, -signal.SIGKILL)])
def test_stopping_the_orchestrator_while_it_profiles_leaves_no_process_behind(tmp_path, measuring_env, signum, code):
    (tmp_path / "c.toml").write_text(AUTO_CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "tests.fault_cli", "-c", "c.toml", "-d", "r.db"], cwd=tmp_path,
                            env=dict(measuring_env, FAULT_PROFILE="hang"), stderr=subprocess.PIPE, text=True)
    pids = tmp_path / "pids"
    until = time.monotonic() + 60
    while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < until:
        time.sleep(0.1)
    profiler, grandchild = map(int, pids.read_text().split())
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == code
    assert_gone([profiler, grandchild])
    assert [r["status"] for r in db_rows(tmp_path / "r.db")] == ["succeeded"] * 3  # the manual jobs before it


def test_profiles_are_cached_per_machine_and_read_back(tmp_path):
    cache = ProfileCache(tmp_path)
    here = Machine("cpu", "cpu", "Some CPU x 2", (("jax", "1"),))
    elsewhere = [Machine("cpu", "cpu", "Some CPU x 4", (("jax", "1"),)), Machine("cpu", "cpu", "Some CPU x 2",
                                                                                 (("jax", "2"),))]
    measured = BUILTIN["cpu"].__class__.from_dict(dict(BUILTIN["cpu"].to_dict(), source="measured", bandwidth=1e9))
    cache.save(here, measured)
    assert cache.load(here) == measured
    assert [cache.load(m) for m in elsewhere] == [None, None]
    assert len({cache.path(m) for m in [here, *elsewhere]}) == 3
    (tmp_path / f"{here.key}.json").write_text("{half")
    assert cache.load(here) is None  # a damaged file is no profile, not a crash


def test_on_ray_the_built_in_profile_of_the_nodes_kind_prices_never_this_machines(tmp_path, monkeypatch):
    monkeypatch.delenv("CODESIGN_PROFILE", raising=False)
    cache = ProfileCache(tmp_path)
    cpu = this_machine("cpu", Hosts.local(0))
    cache.save(cpu, BUILTIN["cpu"].__class__.from_dict(dict(BUILTIN["cpu"].to_dict(), source="measured")))
    local = profiles_for(Hosts.local(0), cache=cache)
    assert local.book.profiles["cpu"].source == "measured"
    ray = profiles_for(Hosts((8, 8), "a Ray cluster", True, "H200"), on_ray=True, cache=cache)
    assert ray.book.profiles["cpu"].source == "built-in" and ray.book.local["gpu"] == "H200"
    assert ray.has_measured("cpu") and ray.has_measured("gpu")  # nothing is measured on Ray


def test_verbose_streams_each_jobs_output_and_every_log_is_kept(tmp_path, measuring_env):
    (tmp_path / "c.toml").write_text(FAKE_CONFIG)
    proc = fault_cli(tmp_path, measuring_env, "-v", "-c", "c.toml", "-d", "r.db")
    assert proc.returncode == 0, proc.stderr
    for seconds in ("0.4", "0.8", "0.6"):
        assert f"fault job: work {seconds}\n" in proc.stderr
    quiet = fault_cli(tmp_path, measuring_env, "-c", "c.toml", "-d", "other.db")
    assert "fault job:" not in quiet.stderr
    for row in db_rows(tmp_path / "r.db") + db_rows(tmp_path / "other.db"):
        assert open(row["log_path"]).read().startswith("fault job: work ")
