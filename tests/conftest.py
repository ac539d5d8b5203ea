import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.configs import SMALL_CONFIG  # noqa: F401  (the tests import it from here)

REPO = Path(__file__).resolve().parents[1]
# Sweeps in tests price with the built-in profiles instead of measuring this machine first
# (tests/test_cost.py measures explicitly).
os.environ.setdefault("CODESIGN_PROFILE", "builtin")
# Measured profiles live in the user's cache directory: the tests' own, never the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="codesign-tests-cache-")
USER_CONFIGS = REPO / "tests" / "data" / "user-configs"
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures" / "user-configs"  # checked against, where present
# Tests on 2 CPU cores are compile-bound: unoptimised XLA code compiles in half the time, and
# XLA:CPU's loop fusions emitted the older way (not through its MLIR fusion emitters) a third
# faster again (the fixture and parallel plans' equivalence tests: 129 s against 87). Every
# process of the suite compiles so (the sweeps' job processes inherit it) but where a test times
# steps against the cost model or a profile (it then sets XLA_FLAGS itself); and every one shares
# one compilation cache, as a user's JAX_COMPILATION_CACHE_DIR makes every DB share it.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", FAST_XLA)  # a test's subprocess imports this module with its own
# The suite runs on pytest-xdist's workers (pyproject's addopts): one run's workers share its cache.
RUN_DIR = Path(tempfile.gettempdir()) / f"codesign-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}"
RUN_DIR.mkdir(exist_ok=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(RUN_DIR / "jax"))


def db_rows(db, table: str = "attempts") -> list[dict]:
    """Every attempt (or repricing) as a user's own SQL sees it (straight from the file, not through the store)."""
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(f"SELECT * FROM {table} ORDER BY id")]
    finally:
        conn.close()


def gpu_cost_attempts(kind: str) -> list[dict]:
    """The CLI jobs of bench/gpu_cost.toml as a GPU of this built-in kind ran them (tests/data/KIND_gpu_cost.json):
    each attempt's job (Job.to_dict), median step seconds and peak bytes."""
    return json.loads((REPO / "tests" / "data" / f"{kind.lower()}_gpu_cost.json").read_text())["attempts"]


def run_cli(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "codesign", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def run_on_devices(n: int, script: str, timeout: float = 600, xla_flags: str = FAST_XLA) -> subprocess.CompletedProcess:
    """Run a Python script in a fresh process that sees n virtual CPU devices, compiling as the
    suite does (FAST_XLA) unless it times steps (xla_flags="": XLA's defaults)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={n} {xla_flags}".strip()}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture
def fixtures_dir() -> Path:
    """The users' configs of the earlier toolkit, as they wrote them (a copy of the shared
    fixtures in tests/data, so the suite needs nothing beside the checkout)."""
    return USER_CONFIGS


@pytest.fixture
def fixture_config(fixtures_dir: Path) -> Path:
    return fixtures_dir / "config.toml"
