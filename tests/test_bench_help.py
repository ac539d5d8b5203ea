"""Every bench script answers --help (exit 0, argparse's usage line) without running its bench;
the other files in bench/ are modules that a script imports."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = sorted((REPO / "bench").glob("*.py"))
SCRIPTS = [path for path in BENCH if 'if __name__ == "__main__":' in path.read_text()]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_bench_script_answers_help_with_its_usage(script: Path):
    proc = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {script.name} ")


def test_a_bench_file_without_a_main_is_a_module_a_bench_script_imports():
    imports = "\n".join(path.read_text() for path in SCRIPTS)
    modules = [path.stem for path in BENCH if path not in SCRIPTS]
    assert modules and [m for m in modules if f"import {m}\n" not in imports] == []
