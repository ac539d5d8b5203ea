"""Run one job body in its own process group, with a hard timeout.

The child gets its platform through the environment before JAX starts, writes its
Outcome as JSON, and is killed with its whole process group when it overstays. A
crash, a hang or a segfault becomes an Outcome; nothing a job does reaches the
orchestrator.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from codesign.results import FAILED, INTERRUPTED, TIMEOUT, Outcome
from codesign.specs import Job

log = logging.getLogger(__name__)
HEARTBEAT_EVERY = 5.0
OUTPUT_TAIL = 4000  # characters of the child's output kept with a crash


def job_env(job: Job, cache_dir: str | None) -> dict[str, str]:
    """The child's environment: which devices JAX sees, decided before it imports."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if job.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        flags.append(f"--xla_force_host_platform_device_count={job.cluster.num_devices}")
    else:
        env["JAX_PLATFORMS"] = "cuda"
    env["XLA_FLAGS"] = " ".join(flags)
    if cache_dir:
        env["CODESIGN_CACHE_DIR"] = cache_dir
    return env


class LocalExecutor:
    """Each job in a fresh subprocess on this machine."""

    def __init__(self, cache_dir: str | None = None, job_module: str = "codesign.runtime"):
        self.cache_dir = cache_dir
        self.job_module = job_module  # `python -m MODULE JOB.json OUTCOME.json` runs the job body

    def run(self, job: Job, timeout: float, heartbeat: Callable[[], None]) -> Outcome:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="codesign-job-") as tmp:
            job_file, outcome_file, log_file = (Path(tmp) / n for n in ("job.json", "outcome.json", "log"))
            job_file.write_text(json.dumps(job.to_dict()))
            with open(log_file, "w") as output:
                proc = subprocess.Popen(
                    [sys.executable, "-m", self.job_module, str(job_file), str(outcome_file)],
                    env=job_env(job, self.cache_dir), stdout=output, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)
                try:
                    outcome = self._wait(proc, timeout, heartbeat, outcome_file, log_file)
                except BaseException:
                    _kill_group(proc)
                    raise
        outcome.duration = time.monotonic() - start
        return outcome

    def _wait(self, proc: subprocess.Popen, timeout: float, heartbeat: Callable[[], None],
              outcome_file: Path, log_file: Path) -> Outcome:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                code = proc.wait(timeout=max(0.0, min(HEARTBEAT_EVERY, left)))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    _kill_group(proc)
                    return Outcome(TIMEOUT, error=f"killed after the {timeout:g} s timeout")
                heartbeat()
        _kill_group(proc)  # leftovers of a finished job must not hold devices
        if outcome_file.exists():
            data = json.loads(outcome_file.read_text())
            return Outcome(**data)
        tail = log_file.read_text(errors="replace")[-OUTPUT_TAIL:]
        status = INTERRUPTED if code == -signal.SIGINT else FAILED
        return Outcome(status, error=f"job process exited with {_exit_text(code)} without a result;"
                                     f" its last output:\n{tail}")


def _exit_text(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
