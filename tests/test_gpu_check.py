"""bench/gpu_check.sh in its reduced CPU form: part 8 times the step under each XLA flag set, with its
kernel table, then every change that beat part 1's step together (bench/flag_winners.py)."""

import os
import re
import subprocess
import sys
import tarfile

import pytest

from bench import bench_gemms, bench_power, flag_winners
from codesign.outcome import Outcome
from codesign.store.database import Store
from tests.conftest import REPO
from tests.test_store import JOB

HEAD = "        step precision  batch   step ms   samples/s  TFLOP/s  peak MiB compile s   loop ms\n"


def rows(*found: tuple[str, float]) -> str:
    """bench_step's printed table with these (row, bf16 step ms) at batch 1024."""
    return HEAD + "".join(f"{row:>12}      bf16   1024     {ms:.2f}     113585    0.123    1000.0     15.18      8.46\n"
                          for row, ms in found)


def flag_rows(flags: str, ms: float) -> str:
    return f"# XLA_FLAGS +{flags}\n" + rows(("project", ms)).split("\n", 1)[1]


def test_changes_that_beat_part_1_are_timed_together_where_two_or_more_did():
    part1 = rows(("project", 9.02), ("project-whole-leaf", 8.90))
    sets = [flag_rows("--a=1", 8.80), flag_rows("--b=", 9.50), flag_rows("--c=0 --d=1", 9.01)]
    assert flag_winners.combined(1024, part1, sets) == ("project-whole-leaf", ["--a=1", "--c=0 --d=1"])
    slower_leaf = rows(("project", 9.02), ("project-whole-leaf", 9.10))
    assert flag_winners.combined(1024, slower_leaf, sets) == ("project", ["--a=1", "--c=0 --d=1"])
    assert flag_winners.combined(1024, slower_leaf, sets[:2]) is None  # one change alone: part 8 timed it already
    assert flag_winners.combined(1024, part1, sets[:2]) == ("project-whole-leaf", ["--a=1"])
    assert flag_winners.combined(4096, part1, sets) is None  # no row at that batch: nothing to beat
    cut_short = "# XLA_FLAGS +--e=1\n"  # its process timed out before printing a row
    assert flag_winners.combined(1024, slower_leaf, [cut_short, sets[0], sets[2]]) == ("project", ["--a=1", "--c=0 --d=1"])


@pytest.mark.slow
@pytest.mark.scripts
def test_part_8_runs_the_step_once_under_each_flag_set_then_the_winners_together(tmp_path):
    flag_sets = ["--xla_cpu_enable_fast_math=false", "--xla_backend_optimization_level=1"]
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_SMOKE": "1", "GPU_CHECK_PARTS": "1 8",
           "GPU_CHECK_XLA": ";".join(flag_sets), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    log = (tmp_path / "gpu_check.log").read_text()
    assert f"## 8. the step under other XLA flags: {';'.join(flag_sets)}" in log
    found = re.findall(r"^# XLA_FLAGS \+(\S+)\n\s+project\s+bf16\s+8\s+([\d.]+)", log, re.MULTILINE)
    assert [flags for flags, _ in found] == flag_sets and all(float(ms) > 0 for _, ms in found)
    part_8 = log.split("## 8. ")[1]
    assert part_8.count("## kernels: project bf16 batch 8: 1 steps traced") == len(flag_sets)
    with tarfile.open(tmp_path / "gpu_check.tgz") as archive:  # the rows the choice was made from, kept
        text = {name: archive.extractfile(f"./{name}").read().decode()
                for name in ["step_bf16.txt", *(f"flags_{i}.txt" for i in range(len(flag_sets)))]}
    chosen = flag_winners.combined(8, text["step_bf16.txt"], [text[f"flags_{i}.txt"] for i in range(len(flag_sets))])
    together = re.search(r"^## 8\. together, each faster than the bf16 step of part 1: (.*)\n\s+(\S+)\s+bf16\s+8\s+[\d.]+",
                         log, re.MULTILINE)
    # which changes beat part 1 on this CPU is noise; the script must do what the rows it kept say
    assert (together.groups() if together else None) == (
        (" ".join([chosen[0], *chosen[1]]), chosen[0]) if chosen else None)


def test_part_9_compares_energy_with_the_prediction_and_runs_the_power_limits_where_it_may():
    """Part 9 exists, after part 4 and before part 5, among the default parts; the script parses."""
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu_check.sh")], check=False).returncode == 0
    assert 'GPU_CHECK_PARTS:-1 2 3 4 11 12 10 9 5 6}' in script
    order = [script.index(f"\nif part {n}. ") for n in (4, 10, 9, 5)]
    assert order == sorted(order)
    assert 'bench/bench_power.py -d "$work/gpu.db" --limits' in script


@pytest.mark.slow
@pytest.mark.scripts
def test_part_12_runs_a_transformer_through_the_cli_and_prices_it(tmp_path):
    """Part 12 (issue 56): after part 11, bench/gpu_transformer.toml's jobs through the CLI into a
    DB of their own, then the cost model's error on them; its smoke form runs on CPU."""
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    assert script.index("\nif part 11. ") < script.index("\nif part 12. ") < script.index("\nif part 10. ")
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_SMOKE": "1", "GPU_CHECK_PARTS": "12", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "## 12. transformers through the CLI" in log and "attempted: 3 succeeded" in log, log[-3000:]
    assert re.search(r"^all\s+3\s+[\d.]+%", log, re.MULTILINE), log[-2000:]  # the cost model's error on the 3 jobs


@pytest.mark.scripts
def test_part_11_times_the_seed_models_gemms_beside_the_hardware_model():
    """Part 11 (issue 54): after part 4, bench_gemms.py in each precision; on CPU it times every
    distinct GEMM of the tiny model and says the CPU has no table to compare with."""
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    assert script.index("\nif part 4. ") < script.index("\nif part 11. ") < script.index("\nif part 10. ")
    assert 'bench/bench_gemms.py "${model[@]:0:2}" --batch $b1 --precision $precision' in script
    gemms = bench_gemms
    seed = gemms.shapes(gemms.MODELS["seed"], 1024)
    assert ("L0 DOT[1] fwd", 1024, 512, 512 * 512) in seed and len(seed) == len({s[1:] for s in seed})
    proc = subprocess.run([sys.executable, "bench/bench_gemms.py", "--model", "tiny", "--batch", "8", "--repeats", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines()[2:] if line.strip()]
    assert len(rows) == len(gemms.shapes(gemms.MODELS["tiny"], 8)) and all("no table" in r for r in rows)


def test_part_10_runs_the_cost_jobs_again_priced_by_what_part_3_taught():
    """Part 10 (issue 49): the calibrations listed, part 3's pass again on the same profile cache
    into a second DB, and the cost model's error on that DB."""
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    part = script[script.index("\nif part 10. "):script.index("\nif part 9. ")]
    steps = ['codesign profile --platform $platform --calibrations', 'cost_pass "$work/gpu_again.db"',
             'bench/bench_cost_model.py -d "$work/gpu_again.db"']
    assert [part.index(step) for step in steps] == sorted(part.index(step) for step in steps)
    first = script[script.index("\nif part 3. "):script.index("\nif part 4. ")]
    assert 'cost_pass "$work/gpu.db"' in first


def test_bench_power_prints_the_ratio_and_says_why_limits_cannot_be_set(tmp_path, capsys):
    """Without NVML (this VM) the limit runs are skipped with the reason, exit 0; each attempt
    shows measured against predicted joules, or why nothing measured."""
    store = Store(tmp_path / "gpu.db")
    measured = {"median": 0.01, "energy_per_iter": 3.3, "avg_power": 330.0, "energy_source": "zeus:nvml",
                "predicted_time": 0.011, "predicted_energy": 3.0}
    store.finish(store.claim("a", JOB, retry_failed=False), Outcome("succeeded", metrics=measured))
    unmeasured = {"median": 0.01, "energy": {"source": None, "joules_per_iter": None, "watts_per_device": None,
                                             "reason": "zeus is not installed"}}
    store.finish(store.claim("b", JOB, retry_failed=False), Outcome("succeeded", metrics=unmeasured))
    store.close()
    assert bench_power.main(["-d", str(tmp_path / "gpu.db"), "--limits"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "3.300" in lines[1] and "1.100" in lines[1] and lines[1].endswith("zeus:nvml")
    assert lines[2].endswith("zeus is not installed")
    assert lines[3].startswith("power limits: NVML cannot say the default limit") and len(lines) == 4
    assert bench_power.main(["-d", str(tmp_path / "none.db")]) == 0
