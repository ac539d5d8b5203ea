"""The package's shape: pure stages import no JAX, job keys survive growth and upgrades, and
every bench script still runs."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from codesign.config.loader import load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs, job_key
from codesign.config.types import TrainingSpec
from codesign.store.database import Store
from tests.conftest import REPO, run_cli

DATA = REPO / "tests" / "data"
PURE_PACKAGES = ("cli", "config", "hardware", "cost", "planner", "run", "store", "report")
PURE_MODULES = ("codesign.zhen.counts", "codesign.zhen.search", "codesign.cli", "codesign.outcome")

# Keys of the four jobs of tests/data/results_v0.1.0.toml, pinned: a change to the canonical form
# re-keys every DB, so it must come with a schema migration (store/schema.py).
GOLDEN_KEYS = {
    ("data parallel", 1): "4fe2bf0b4197182dbe98cd19b849b85b8c1c7ec7a27122971201fb67fdd2f8ab",
    ("data parallel", 3): "4a3cca4223cc6b49459f638fc9a6686672a51a2070d890696c0528da5d2cbe5d",
    ("pipeline", 2): "ea794120bb441d9f35a89b6782888c7527fa634a8bd774ebdddc6ba301a45102",
    ("Auto search", 1): "05a930938ac09220b0c4072d720a18a624825a66d39e4f91b88b4a5b0f50f200",
}


def pure_modules() -> list[str]:
    package = REPO / "codesign"
    modules = [f"codesign.{p}.{f.stem}" for p in PURE_PACKAGES for f in sorted((package / p).glob("*.py"))
               if f.stem != "__init__"]
    return modules + list(PURE_MODULES)


@pytest.mark.slow
@pytest.mark.parametrize("module", pure_modules())
def test_pure_code_imports_no_jax(module):
    code = f"import sys, {module}; print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_dry_run_imports_no_jax(tmp_path):
    code = ("import runpy, sys; sys.argv = ['codesign', '--dry-run', '-c', sys.argv[1], '-d', 'r.db']\n"
            "try:\n    runpy.run_module('codesign', run_name='__main__')\n"
            "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
            "print('JAX', 'jax' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, str(DATA / "results_v0.1.0.toml")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "4 jobs: 4 run" in proc.stdout and "JAX False" in proc.stderr


def release_jobs() -> dict[tuple[str, int], object]:
    config = load_config(DATA / "results_v0.1.0.toml")
    return {(p.job.parallel.description, p.job.num_micro_batches): p for p in enumerate_jobs(config, Hosts.local(0))}


def test_job_keys_are_pinned():
    assert {name: p.key for name, p in release_jobs().items()} == GOLDEN_KEYS


def test_an_optional_field_added_later_does_not_re_key():
    @dataclasses.dataclass(frozen=True)
    class GrownTraining(TrainingSpec):
        gradient_clipping: float | None = None  # a knob of some later release, at its default

    job = release_jobs()[("data parallel", 1)].job
    grown = dataclasses.replace(job, training=GrownTraining(**dataclasses.asdict(job.training)))
    assert job_key(grown) == job_key(job)
    clipped = dataclasses.replace(job, training=GrownTraining(**dataclasses.asdict(job.training),
                                                              gradient_clipping=1.0))
    assert job_key(clipped) != job_key(job)


def release_db(path: Path) -> Path:
    """A results DB exactly as codesign 0.1.0 wrote it (schema 2, its own keys)."""
    conn = sqlite3.connect(path)
    conn.executescript((DATA / "results_v0.1.0.sql").read_text())
    conn.close()
    return path


@pytest.mark.slow
def test_a_release_db_is_re_keyed_and_keeps_its_skips(tmp_path):
    db = release_db(tmp_path / "results.db")
    before = db.read_bytes()
    dry = run_cli("--dry-run", "-c", str(DATA / "results_v0.1.0.toml"), "-d", str(db), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "4 jobs: 1 run, 3 skip" in dry.stdout  # the Auto search job of 0.1.0 never ran
    assert db.read_bytes() == before  # the dry run migrated a private copy
    store = Store(db)
    rows = store.attempts()
    assert [r["job_key"] for r in rows] == list(GOLDEN_KEYS.values())
    assert [(r["status"], json.loads(r["all_configs"])["parallel"]["description"]) for r in rows] == [
        ("succeeded", "data parallel"), ("invalid", "data parallel"), ("succeeded", "pipeline"),
        ("invalid", "Auto search")]
    store.close()
    rerun = run_cli("-c", str(DATA / "results_v0.1.0.toml"), "-d", str(db), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert "attempted: 1 succeeded; skipped (already recorded or running elsewhere): 3" in rerun.stderr
    store = Store(db)
    auto = store.attempts()[-1]  # the Auto search job 0.1.0 rejected: its plan chosen, run, recorded
    store.close()
    assert (auto["job_key"], auto["status"], auto["description"]) == (GOLDEN_KEYS[("Auto search", 1)],
                                                                      "succeeded", "Auto search")
    assert auto["avg"] > 0 and auto["predicted_time"] > 0 and auto["pp_dp_op"].startswith("[")
    assert json.loads(auto["all_configs"])["auto_search"]["priced"] >= 1


BENCH_SMOKE = {  # "{db}": a copy of the 0.1.0 results DB
    "bench_auto_search.py": ["--max-devices", "2", "--layers", "4", "--micro", "1"],
    "bench_codesign.py": ["--ranking", "plan_sim"],  # the layer-group rankings take minutes
    "bench_cost_model.py": ["-d", "{db}", "--repredict", "--noise", "{db}"],
    "bench_plan.py": ["--repeat", "1"],
    "bench_dry_run.py": ["--jobs", "1000"],
    "bench_faults.py": ["--trials", "1", "--real", "0", "--stops", "1"],
    "bench_search.py": ["--max-slots", "8"],
    "bench_plans.py": ["-c", str(DATA / "results_v0.1.0.toml"), "--timeout", "120"],
    "bench_report.py": ["--attempts", "200"],
    "bench_power.py": ["-d", "{db}", "--limits"],  # no NVML here: the limit runs say so and are skipped
    "bench_auto.py": ["--models", "tiny", "--devices", "1", "--micro", "1", "--iters", "3", "--confirm", "1"],
    "bench_learning.py": ["--jobs", "1", "--base", "builtin"],  # measuring the base takes a minute
    "bench_teaching.py": ["--jobs", "1", "--teach", "1"],  # two minutes: it measures its base, as issue 55 asks
    "bench_energy.py": ["--groups", "2"],
    "bench_calibrations.py": ["--config", str(DATA / "one_cpu_job.toml")],
    "bench_megatron.py": [],  # its rows' Auto searches (--auto) take minutes; tests/test_transformer.py runs two
}


SMOKED_ELSEWHERE = {"bench_step.py": "tests/test_kernel_table.py",  # run there with --trace and --recompile
                    "bench_gemms.py": "tests/test_gpu_check.py"}  # run there as part 11 runs it


def test_every_bench_script_is_smoke_tested():
    assert sorted([*BENCH_SMOKE, *SMOKED_ELSEWHERE]) == sorted(p.name for p in (REPO / "bench").glob("bench_*.py"))
    assert all(script in (REPO / test).read_text() for script, test in SMOKED_ELSEWHERE.items())


@pytest.mark.slow
@pytest.mark.scripts
@pytest.mark.parametrize("script", sorted(BENCH_SMOKE))
def test_bench_scripts_run_with_their_smallest_arguments(script, tmp_path):
    db = str(release_db(tmp_path / "results.db"))
    args = [arg.replace("{db}", db) for arg in BENCH_SMOKE[script]]
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) >= 2, proc.stdout



def imported_modules(path: Path) -> set[str]:
    """Top-level names of what a module imports (the module's own text, parsed)."""
    import ast

    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_the_store_speaks_only_specs_and_outcomes_and_specs_probe_nothing():
    for path in (REPO / "codesign" / "store").glob("*.py"):
        ours = {m for m in imported_modules(path) if m.startswith("codesign")}
        assert all(m.split(".")[1] in ("config", "outcome", "errors", "csv_cells", "store") for m in ours), (path.name, ours)
    for path in (REPO / "codesign" / "config").glob("*.py"):
        assert not imported_modules(path) & {"subprocess", "shutil", "ray", "jax"}, path.name  # discovery is run/'s
    assert "scipy.optimize" in imported_modules(REPO / "codesign" / "cost" / "calibration.py")


def test_the_dependencies_are_declared_as_imported():
    """Every third-party module the package imports is a declared dependency (or an extra's),
    and every declared dependency is imported somewhere."""
    import tomllib
    from importlib import metadata

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {spec.split(">")[0].split("[")[0].strip() for spec in project["dependencies"]}
    extras = {spec.split(">")[0].split("[")[0].strip() for specs in project["optional-dependencies"].values()
              for spec in specs}
    top = {m.split(".")[0] for path in (REPO / "codesign").rglob("*.py") for m in imported_modules(path)}
    third_party = {m for m in top if m != "codesign" and m not in sys.stdlib_module_names}
    providers = metadata.packages_distributions()
    used = {providers.get(m, [m])[0].lower() for m in third_party}  # an extra not installed: its module's name
    assert used - {d.lower() for d in declared | extras} == set()
    assert {d.lower() for d in declared} - used == set()


def test_pricing_imports_point_down_its_flow():
    """DESIGN.md's pricing flow: the hardware answers (it knows no cost model and no search), the
    cost model composes (it knows no search), the search chooses."""
    above = {"hardware": {"cost", "planner"}, "cost": {"planner"}}
    for package, forbidden in above.items():
        for path in (REPO / "codesign" / package).glob("*.py"):
            ours = {m.split(".")[1] for m in imported_modules(path) if m.startswith("codesign.")}
            assert not ours & forbidden, (package, path.name, ours & forbidden)
