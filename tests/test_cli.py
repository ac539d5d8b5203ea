"""The command line as users run it: dry run, the default command, reruns, exports, run.sh."""

import importlib
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pandas as pd
import pytest

import codesign
from codesign.cli import COMMANDS, main
from codesign.cli.session import MANUAL_JOB_TIMEOUT
from codesign.outcome import Outcome
from codesign.report import fmt
from codesign.config.loader import DEFAULT_CONFIG, load_config
from codesign.config.hosts import Hosts
from codesign.config.jobs import enumerate_jobs
from codesign.store.database import Store
from codesign.store.schema import LEGACY_COLUMNS
from tests.conftest import REPO, SMALL_CONFIG, db_rows, run_cli


def test_dry_run_lists_fixture_jobs_and_writes_nothing(tmp_path, fixture_config):
    proc = run_cli("--dry-run", "-c", str(fixture_config), "-d", "results.db", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "46 jobs: 0 run, 0 skip, 0 running, 46 unavailable" in lines
    table = lines[1:lines.index("")]  # header, one row per job, then a blank line
    assert len(table) == 46 and all(row.endswith(" unavailable") for row in table)
    assert "unavailable: needs 2 GPU hosts; this machine is one host" in lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, message", [
    ("[training_spec\n", "c.toml: file: invalid TOML"),
    (SMALL_CONFIG.replace('"(pp, dp, op)" = [1, 2, 1]', '"(pp, dp, op)" = [1, 2, "x"]'),
     "c.toml: [[parallel_spec]] #1 field '(pp, dp, op)': expected 3 positive integers"),
])
def test_config_errors_exit_2_and_change_nothing(tmp_path, text, message):
    (tmp_path / "c.toml").write_text(text)
    proc = run_cli("-c", "c.toml", "-d", "r.db", cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == "" and not (tmp_path / "r.db").exists()


AUTO_SPEC = """
[[parallel_spec]]
description = "Auto search"
num_micro_batches = [1]
"""
RUN_HERE = (0, 9)  # of the default config's 14 jobs: one device, and 4 devices with 2 micro-batches


@pytest.fixture(scope="module")
def default_sweep(tmp_path_factory):
    """README command 1 (`./run.sh`: the built-in default config) in a folder whose results.db
    already records the default jobs but two as failed, so that the command runs those two."""
    cwd = tmp_path_factory.mktemp("sweep")
    planned = list(enumerate_jobs(load_config(DEFAULT_CONFIG), Hosts.local(0)))
    store = Store(cwd / "results.db")
    for i, item in enumerate(planned):
        if i not in RUN_HERE:
            store.finish(store.claim(item.key, item.job, retry_failed=False),
                         Outcome("failed", error="recorded by the test, not run"))
    store.close()
    start = time.monotonic()
    proc = subprocess.run([str(REPO / "run.sh")], cwd=cwd, capture_output=True, text=True, timeout=600)
    return cwd, proc, time.monotonic() - start


@pytest.mark.slow
def test_default_command_runs_the_default_config(default_sweep):
    cwd, proc, seconds = default_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert "attempted: 2 succeeded; skipped (already recorded or running elsewhere): 12" in proc.stderr
    attempts = db_rows(cwd / "results.db")
    assert len(attempts) == 14
    ran = [r for r in attempts if r["status"] == "succeeded"]
    assert [(r["gpus_per_node"], r["num_micro_batches"]) for r in ran] == [(1, 1), (4, 2)]
    for r in ran:
        assert 0 < r["median"] <= r["p90"] and r["avg"] > 0 and r["throughput"] > 0
        assert r["max_memory"] > 0 and r["compile_time"] > 0 and r["platform"] == "cpu"
        assert r["job_duration"] >= r["compile_time"]
    print(f"default command, 2 jobs: {seconds:.1f} s")


@pytest.mark.slow
def test_rerun_attempts_nothing(default_sweep):
    cwd, _, _ = default_sweep
    proc = run_cli(cwd=cwd)
    assert proc.returncode == 0
    assert "attempted: none; skipped (already recorded or running elsewhere): 14" in proc.stderr
    assert len(db_rows(cwd / "results.db")) == 14
    dry = run_cli("-D", cwd=cwd)
    assert "14 jobs: 0 run, 14 skip" in dry.stdout


def path_without_sqlite3(tmp_path) -> str:
    """A PATH holding only what the export scripts run (bash, dirname, python3): no sqlite3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in (("bash", shutil.which("bash")), ("dirname", shutil.which("dirname")),
                         ("python3", sys.executable)):
        (bin_dir / name).symlink_to(target)
    assert shutil.which("sqlite3", path=str(bin_dir)) is None
    return str(bin_dir)


@pytest.mark.slow
def test_exports_open_in_pandas_with_the_original_columns(default_sweep, tmp_path):
    cwd, _, _ = default_sweep
    env = {**os.environ, "PATH": path_without_sqlite3(tmp_path)}
    expected = {"results_all.csv": 14, "results_succeeded.csv": 2}
    for script, csv in (("export_all.sh", "results_all.csv"), ("export_succeeded.sh", "results_succeeded.csv")):
        proc = subprocess.run([str(REPO / script)], cwd=cwd, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        frame = pd.read_csv(cwd / csv)
        assert list(frame.columns[:3]) == ["id", "job_key", "status"]
        assert set(LEGACY_COLUMNS) <= set(frame.columns)
        assert len(frame) == expected[csv]
        assert frame["status"].value_counts().to_dict() == (
            {"succeeded": 2, "failed": 12} if csv == "results_all.csv" else {"succeeded": 2})
        assert frame.loc[frame["status"] == "succeeded", "avg"].gt(0).all()


def assert_summary(stderr: str, cells: list[str]) -> None:
    """The sweep summary has one row (SMALL_CONFIG: one model on one cluster) showing these cells in order."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("codesign: best plan per model and cluster"))
    header, row = lines[start + 1:start + 3]
    assert header.split() == ["model", "cluster", "best", "plan", "samples/s", "vs", "data", "parallel", "failed",
                              "attempts"]
    assert len(lines) == start + 3
    at = 0
    for cell in cells:
        assert f" {cell} " in f" {row[at:]} ", (cell, row)
        at = row.index(cell, at) + len(cell)


@pytest.mark.slow
def test_retry_failed_reruns_only_the_failed(tmp_path):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG)
    proc = run_cli("-c", "c.toml", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == ""
    first = db_rows(tmp_path / "results.db")
    assert [r["status"] for r in first] == ["succeeded", "invalid"]
    assert "global batch 8 is not divisible by num_micro_batches = 3" in first[1]["error"]
    expected = ["F8 D4 O2 L1 [LD]", "1x2 NVLink (cpu)", "data parallel | pp1 dp2 op1 | mb1",
                fmt.number(first[0]["throughput"]), "1.00x", "1 invalid"]  # the DP plan is its own baseline
    assert_summary(proc.stderr, expected)
    again = run_cli("-c", "c.toml", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == ""
    assert len(db_rows(tmp_path / "results.db")) == 2
    assert_summary(again.stderr, expected)  # nothing ran: the summary comes from the recorded attempts
    assert run_cli("-c", "c.toml", "--retry-failed", cwd=tmp_path).returncode == 0
    again = db_rows(tmp_path / "results.db")
    assert [(r["job_key"], r["status"]) for r in again[2:]] == [(first[1]["job_key"], "invalid")]


def test_a_job_past_its_timeout_is_killed_and_the_next_runs(tmp_path):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG.replace("[1, 3]", "[1, 2]"))
    proc = run_cli("-c", "c.toml", "--manual-job-timeout", "0.5", cwd=tmp_path)
    assert proc.returncode == 3  # the sweep finished; some jobs did not
    attempts = db_rows(tmp_path / "results.db")
    assert [r["status"] for r in attempts] == ["timeout", "timeout"]
    assert all(0.5 <= r["job_duration"] < 10 for r in attempts)
    for r in attempts:  # the log is kept beside the DB, and its tail is on the attempt
        log = tmp_path / "logs" / r["job_key"] / f"{r['id']}.log"
        assert r["log_path"] == str(log) and log.exists()
        assert r["error"].startswith("killed after the 0.5 s timeout; its last output:\n")
        assert r["error"].endswith(log.read_text()[-100:])


def fake_python(tmp_path, code: int):
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho run >> {tmp_path}/calls\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize("code, calls", [(1, 3), (2, 1), (0, 1), (3, 1)])
def test_run_sh_restarts_abnormal_exits_only(tmp_path, code, calls):
    env = {**os.environ, "CODESIGN_PYTHON": fake_python(tmp_path, code), "CODESIGN_MAX_RESTARTS": "2",
           "CODESIGN_RESTART_DELAY": "0"}
    proc = subprocess.run([str(REPO / "run.sh"), "-c", "x.toml"], cwd=tmp_path, env=env,
                                        capture_output=True, text=True, timeout=60)
    assert proc.returncode == code
    assert (tmp_path / "calls").read_text().count("run") == calls


def test_run_sh_stops_on_a_config_error(tmp_path):
    proc = subprocess.run([str(REPO / "run.sh"), "-c", "missing.toml"], cwd=tmp_path,
                                        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing.toml: file: not found" in proc.stderr
    assert "restart" not in proc.stderr


@pytest.mark.slow
def test_precision_is_recorded_on_every_attempt(tmp_path):
    text = SMALL_CONFIG.replace("num_iters = 3", 'num_iters = 3\nprecision = "bf16"').replace("[1, 3]", "[1]")
    (tmp_path / "c.toml").write_text(text)
    assert run_cli("-c", "c.toml", cwd=tmp_path).returncode == 0
    (attempt,) = db_rows(tmp_path / "results.db")
    assert (attempt["status"], attempt["precision"]) == ("succeeded", "bf16")
    # no GPU, no RAPL: absent, not zero, with the reason in all_configs
    assert (attempt["energy_per_iter"], attempt["avg_power"], attempt["energy_source"]) == (None, None, None)
    assert json.loads(attempt["all_configs"])["energy"]["reason"]
    assert attempt["predicted_energy"] > 0  # the cost model prices it wherever nothing measures it


def test_jobs_this_machine_cannot_provide_are_counted_not_recorded(tmp_path, fixture_config):
    proc = run_cli("-c", str(fixture_config), "-d", "r.db", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "codesign: not attempted, 6 job(s): needs 1 GPUs; this machine has 0" in proc.stderr
    assert "codesign: not attempted, 27 job(s): needs 2 GPU hosts; this machine is one host" in proc.stderr
    assert db_rows(tmp_path / "r.db") == []


def fake_nvidia_smi(tmp_path, listing: str) -> dict:
    """PATH with an nvidia-smi that lists `listing`, ahead of the real PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{listing}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_gpus_jax_cannot_see_are_reported_with_the_fix(tmp_path):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG.replace('platform = "cpu"', 'platform = "gpu"'))
    listing = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\\n"
    proc = run_cli("-D", "-c", "c.toml", cwd=tmp_path, env=fake_nvidia_smi(tmp_path, listing))
    assert proc.returncode == 0, proc.stderr
    assert "this machine has NVIDIA GPUs (nvidia-smi lists 2) but JAX sees none (" in proc.stderr
    assert "To use the GPUs: pip install -e '.[gpu]' (the CUDA build of JAX)" in proc.stderr
    assert "unavailable: needs 2 GPUs; this machine has 0" in proc.stdout


def test_no_warning_where_nvidia_smi_lists_no_gpu(tmp_path):
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("this machine has NVIDIA devices")
    (tmp_path / "c.toml").write_text(SMALL_CONFIG.replace('platform = "cpu"', 'platform = "auto"'))
    proc = run_cli("-D", "-c", "c.toml", cwd=tmp_path, env=fake_nvidia_smi(tmp_path, "No devices were found\\n"))
    assert proc.returncode == 0 and "NVIDIA" not in proc.stderr
    assert "2 jobs: 2 run" in proc.stdout  # auto: virtual CPU devices


@pytest.mark.slow
def test_plan_and_the_sweep_price_every_job_of_the_default_config_alike(default_sweep):
    """`codesign plan` resolves platforms ("auto": virtual CPU devices on this machine) and
    profiles exactly as the sweep does: the same predicted_time for every job."""
    from codesign.run.profile_cache import profiles_for
    from codesign.run.sweep import Pricing

    cwd, _, _ = default_sweep
    proc = run_cli("plan", "--format", "csv", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    planned = {}
    for row in pd.read_csv(io.StringIO(proc.stdout)).itertuples():
        for name in str(row.manual).split("; ") if isinstance(row.manual, str) else ():
            planned[(row.model, row.cluster, row.micro_batches, name)] = row.time_ms / 1e3
    pricing = Pricing(profiles_for(Hosts.local(0)))
    jobs = [p.job for p in enumerate_jobs(load_config(DEFAULT_CONFIG), Hosts.local(0))]
    swept = {(j.model.summary(), j.cluster.summary(), j.num_micro_batches, j.parallel.description):
             pricing.prepare(j).prediction.get("predicted_time") for j in jobs}
    assert len(swept) == 14 and all(swept.values())
    assert planned.keys() == swept.keys()
    for key, seconds in swept.items():
        assert planned[key] == pytest.approx(seconds, rel=1e-9), key
    recorded = [r for r in db_rows(cwd / "results.db") if r["status"] == "succeeded"]
    assert len(recorded) == 2
    for r in recorded:  # what the sweep recorded is what it priced
        key = next(k for k, j in zip(swept, jobs) if j.model.num_zhen_layers == r["num_zhen_layers"]
                   and j.cluster.num_devices == r["gpus_per_node"] and j.num_micro_batches == r["num_micro_batches"]
                   and j.parallel.description == r["description"])
        assert r["predicted_time"] == pytest.approx(swept[key], rel=1e-9)


def test_jobs_compile_into_jaxs_own_cache_dir_where_the_user_set_one(tmp_path, monkeypatch):
    from codesign.cli.session import jax_cache

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert jax_cache(str(tmp_path / "r.db")) == str(tmp_path / "jax_cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "shared"))
    assert jax_cache(str(tmp_path / "r.db")) == str(tmp_path / "shared")


def test_help_lists_the_commands_each_with_its_own_help_and_the_version(tmp_path):
    top = run_cli("--help", cwd=tmp_path)
    assert top.returncode == 0
    for command in ("run", "plan", "profile", "reprice", "report", "export", "search"):
        assert f"    {command} " in top.stdout, command
    run_help = run_cli("run", "--help", cwd=tmp_path).stdout
    assert "--manual-job-timeout" in run_help and "--max-layers" not in run_help
    assert "--max-layers" in run_cli("search", "--help", cwd=tmp_path).stdout
    assert "--max-layers" not in run_cli("--help", cwd=tmp_path).stdout
    version = run_cli("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"codesign {codesign.__version__}"
    assert codesign.__version__ != "0.1.0"
    missing = run_cli("-v", "report", "-d", "missing.db", cwd=tmp_path)  # a global flag before the command
    assert missing.returncode == 2 and "missing.db" in missing.stderr and "usage:" not in missing.stderr


def example_lines(help_text: str) -> list[str]:
    """The command lines of a --help's examples section."""
    section = help_text.split("\nexamples:\n", 1)[1]
    return [line.strip() for line in section.splitlines() if line.startswith("  codesign ")]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_commands_help_ends_with_examples_that_parse_and_shows_only_real_defaults(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0
    assert "(default: None)" not in out and "(default: False)" not in out
    lines = example_lines(out)
    assert 2 <= len(lines) <= 3 and lines[0].startswith(f"codesign {command}")
    for part in (part for line in lines for part in line.split("&&")):  # each, as the parser reads it
        argv = shlex.split(part.split(">")[0])[1:]  # after `codesign`, less a `> FILE`
        name = argv[0] if argv[0] in COMMANDS else "run"  # no command: the earlier toolkit's run
        parser = importlib.import_module(f"codesign.cli.{name}").build_parser()
        parser.parse_args(argv[1:] if argv[0] in COMMANDS else argv)


def test_flags_with_a_real_default_still_show_it(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert f"(default: {MANUAL_JOB_TIMEOUT})" in out and "(default: results.db)" in out


def test_codesign_profile_gives_up_after_the_sweeps_profile_timeout_which_the_environment_sets(tmp_path):
    """One default for both: PROFILE_TIMEOUT, which CODESIGN_PROFILE_TIMEOUT overrides."""
    from codesign.cli import profile
    from codesign.run.profile_cache import PROFILE_TIMEOUT

    assert profile.build_parser().parse_args([]).timeout == PROFILE_TIMEOUT
    env = {k: v for k, v in os.environ.items() if k != "CODESIGN_PROFILE"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO), FAULT_PROFILE="ok",
               CODESIGN_PROFILE_TIMEOUT="7")
    proc = subprocess.run([sys.executable, "-m", "tests.fault_cli", "profile", "--platform", "cpu"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "for the cost model (at most 7 s)..." in proc.stderr and '"source": "measured"' in proc.stdout


def test_run_top_runs_the_winners_as_a_sweep_and_records_them(tmp_path):
    """search --rank --run-top: the N best of each cluster run as codesign run's sweep would
    (its defaults: nothing retried, here, one job at a time), recorded in the DB and the CSV."""
    small = ["--base-features", "32", "--base-emb-dim", "16", "--base-output-per-emb", "4", "--slots", "3",
             "--max-layers", "3", "--param-tolerance", "1"]
    (tmp_path / "c.toml").write_text(SMALL_CONFIG.split("[[parallel_spec]]")[0] + AUTO_SPEC)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CODESIGN_PROFILE": "builtin"}
    proc = subprocess.run([sys.executable, "-m", "tests.fault_cli", "search", "--rank", "-c", "c.toml", "-d", "r.db",
                           "--run-top", "1", *small], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "codesign: attempted: 1 succeeded; skipped (already recorded or running elsewhere): 0" in proc.stderr
    assert "codesign: 1x2 NVLink (cpu), 1 micro-batches, groups=1: " in proc.stderr
    ran = db_rows(tmp_path / "r.db")
    assert [(r["status"], r["description"], r["gpus_per_node"]) for r in ran] == [("succeeded", "Auto search", 2)]
    ranked = pd.read_csv(tmp_path / "codesign_rank.csv")
    winners = ranked[ranked["job_key"].notna()].sort_values("rank")
    assert list(winners["rank"]) == [1] and list(winners["job_key"]) == [r["job_key"] for r in ran]


def test_the_version_is_read_from_the_checkout_where_codesign_is_not_installed(monkeypatch):
    """scripts/python.sh runs the checkout on a GPU machine's own Python, without installing it."""
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    pyproject = tomllib.loads((Path(codesign.__file__).parents[1] / "pyproject.toml").read_text())
    assert codesign._version() == pyproject["project"]["version"] == codesign.__version__


def test_the_earlier_toolkits_command_lines_still_work(tmp_path):
    old = run_cli("--search-model", "--seed", "1", "--max-similar", "3", "--max-per-depth", "1", cwd=tmp_path)
    new = run_cli("search", "--seed", "1", "--max-similar", "3", "--max-per-depth", "1", cwd=tmp_path)
    assert old.returncode == new.returncode == 0 and old.stdout == new.stdout and "[[model]]" in old.stdout
    (tmp_path / "c.toml").write_text(SMALL_CONFIG)
    old = run_cli("-D", "-c", "c.toml", cwd=tmp_path)
    new = run_cli("run", "--dry-run", "--config", "c.toml", cwd=tmp_path)
    assert old.returncode == new.returncode == 0 and old.stdout == new.stdout and "2 jobs: 2 run" in old.stdout


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_a_timeout_must_be_a_positive_number_of_seconds(tmp_path, value):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG)
    proc = run_cli("-c", "c.toml", "--manual-job-timeout", value, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"--manual-job-timeout: expected a positive number of seconds, got '{value}'" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["c.toml"]


def test_no_progress_bar_where_stderr_is_not_a_terminal(tmp_path):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG.replace("[1, 3]", "[3]"))
    proc = run_cli("-c", "c.toml", cwd=tmp_path)
    assert proc.returncode == 0 and "attempted: 1 invalid" in proc.stderr
    assert "jobs:" not in proc.stderr and "job/s" not in proc.stderr
