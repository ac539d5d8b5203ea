"""bench/gpu_check.sh in its reduced CPU form: part 8 times the step under each XLA flag set, with its kernel table."""

import os
import re
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_part_8_runs_the_step_once_under_each_flag_set(tmp_path):
    flag_sets = ["--xla_cpu_enable_fast_math=false", "--xla_backend_optimization_level=1"]
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_SMOKE": "1", "GPU_CHECK_PARTS": "8",
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
    assert (tmp_path / "gpu_check.tgz").stat().st_size > 0
