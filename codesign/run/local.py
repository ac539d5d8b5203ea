"""Run job bodies in their own process groups, with hard timeouts.

The child gets its platform through the environment before JAX starts, writes its
Outcome as JSON, and is killed with its whole process group when it overstays. A
crash, a hang, a segfault or a missing outcome becomes an Outcome; nothing a job does
reaches the orchestrator. A job never outlives the process that started it: its group is
led by `guard`, which holds a lifeline to this process. `JobProcess` is the piece the Ray
executor reuses on every host. The local executor keeps one spare process (`warm`) importing
Python and JAX while a job runs; the next job with the same environment starts in it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import psutil

from codesign.outcome import FAILED, INTERRUPTED, TIMEOUT, Outcome, read_outcome
from codesign.gpu_power import LIMITS_ENV, limits_env
from codesign.cost.plan import Plan
from codesign.run.device_env import device_env
from codesign.config.types import Job

log = logging.getLogger(__name__)
POLL_EVERY = 0.05  # seconds between looks at running children
OUTPUT_TAIL = 4000  # characters of the child's output kept with a crash
GROUP_EXIT_WAIT = 5.0  # seconds a killed job's process group gets to vanish
RESTORE_WAIT = 10.0  # seconds a power-limited job's guard gets to put the limits back when stopped


def job_env(job: Job, cache_dir: str | None, local_devices: int | None = None,
            extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: which devices JAX sees, decided before it imports.

    local_devices is this process's share of a multi-host job (all devices when None).
    """
    env = device_env(dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {})), job.platform,
                     local_devices or job.cluster.num_devices)
    if cache_dir:
        env["CODESIGN_CACHE_DIR"] = cache_dir
    return env


class GuardedProcess:
    """`python -m MODULE ARGS...` under a guard leading its own process group; the group dies
    when this process does (see `guard`). Its output goes to `output`, or to this process's own
    stdout and stderr when None."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], output: Path | None = None,
                 stdin: int = subprocess.DEVNULL):
        lifeline, self._lifeline = os.pipe()  # we hold the write end until the process is over
        self.limited = LIMITS_ENV in env  # its guard sets GPU power limits, and must put them back
        self._closing = threading.Lock()
        sink = open(output, "a") if output else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "codesign.run.guard", str(os.getpid()), str(lifeline), *command],
                env=dict(env), stdout=sink, stderr=subprocess.STDOUT if sink else None,
                stdin=stdin, start_new_session=True, pass_fds=(lifeline,))
        finally:
            os.close(lifeline)
            if sink:
                sink.close()
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when it still runs after timeout seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the whole group and wait (a bounded time) until it is gone: leftovers of a
        job must not hold devices when the next job starts. A guard that set power limits gets
        SIGTERM first: it puts them back, then kills its group itself."""
        if self.limited and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(RESTORE_WAIT)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        until = time.monotonic() + GROUP_EXIT_WAIT
        while time.monotonic() < until and _group_running(self.proc.pid):
            time.sleep(POLL_EVERY)
        with self._closing:  # the Ray actor may stop a job from a second thread
            lifeline, self._lifeline = self._lifeline, None
        if lifeline is not None:
            os.close(lifeline)


class SpareProcess(GuardedProcess):
    """`python -m codesign.run.warm MODULE` under a guard: a job process importing Python and
    JAX before its job is known, for the next job run with this environment and job module."""

    def __init__(self, env: Mapping[str, str], job_module: str):
        self.env, self.job_module = dict(env), job_module
        self._tmp = tempfile.TemporaryDirectory(prefix="codesign-spare-")
        super().__init__(["codesign.run.warm", job_module], env, Path(self._tmp.name) / "log", stdin=subprocess.PIPE)

    def fits(self, env: Mapping[str, str], job_module: str) -> bool:
        return self.proc.poll() is None and (self.env, self.job_module) == (dict(env), job_module)

    def hand_over(self, log: Path, args: Sequence[str]) -> bool:
        """Give it its job (where its output goes, the job body's arguments); False if it is gone."""
        try:
            self.proc.stdin.write((json.dumps([str(log), *args]) + "\n").encode())
            self.proc.stdin.close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.kill()
        self._tmp.cleanup()


class JobProcess(GuardedProcess):
    """One job body, `python -m MODULE JOB.json OUTCOME.json`, under a guard (in `spare`, when
    one that fits is given). JOB.json holds the job and, under "chosen_plans", the plans the
    toolkit chose for it, best predicted first, if any. Its output goes to `log` (kept: a hang
    leaves its evidence), else to a temp file."""

    def __init__(self, job: Job, env: Mapping[str, str], job_module: str, plans: Sequence[Plan] = (),
                 log: Path | None = None, spare: SpareProcess | None = None):
        self._tmp = tempfile.TemporaryDirectory(prefix="codesign-job-")
        tmp = Path(self._tmp.name)
        self.outcome_file, self.log_file = tmp / "outcome.json", log or tmp / "log"
        chosen = {"chosen_plans": [plan.to_dict() for plan in plans]} if plans else {}
        (tmp / "job.json").write_text(json.dumps({**job.to_dict(), **chosen}))
        args = [str(tmp / "job.json"), str(self.outcome_file)]
        self.log_file.touch()  # there, whenever the job ends: a spare opens it once it has its job
        if spare is not None and spare.hand_over(self.log_file, args):
            self._adopt(spare)
        else:
            if spare is not None:
                spare.close()
            super().__init__([job_module, *args], env, self.log_file)

    def _adopt(self, spare: SpareProcess) -> None:
        """Become the spare's guarded process, its timeout running from now."""
        self.proc, self._lifeline, self._closing = spare.proc, spare._lifeline, spare._closing
        self.limited = spare.limited
        self.started = time.monotonic()
        spare._tmp.cleanup()

    def output_tail(self, limit: int = OUTPUT_TAIL) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def result(self, code: int) -> Outcome:
        """The outcome the child wrote, or why there is none; removes the job's temp files."""
        self.kill()
        try:
            try:
                return read_outcome(self.outcome_file)
            except FileNotFoundError:
                problem = "without a result"
            except (OSError, ValueError) as err:
                problem = f"with an unreadable outcome file ({err})"
            tail = self.output_tail()
        finally:
            self._tmp.cleanup()
        status = INTERRUPTED if code == -signal.SIGINT else FAILED
        return Outcome(status, error=f"job process exited with {_exit_text(code)} {problem};"
                                     f" its last output:\n{tail}")

    def close(self) -> None:
        """Kill the group and remove the job's temp files, whatever state the job is in."""
        self.kill()
        self._tmp.cleanup()


class LocalRun:
    """A job running on this machine, with its deadline and the GPUs it holds."""

    def __init__(self, job: Job, timeout: float, process: JobProcess, gpus: tuple[int, ...] = (),
                 stream: bool = False):
        self.job, self.timeout, self.process, self.gpus = job, timeout, process, gpus
        self.deadline = process.started + timeout
        self.streamed = 0 if stream else None  # bytes of the log already copied to stderr

    def check(self) -> Outcome | None:
        """The outcome once the job ended or overstayed (then killed); None while it runs."""
        self.stream()
        code = self.process.proc.poll()
        if code is not None:
            outcome = self.process.result(code)
        elif time.monotonic() >= self.deadline:
            self.process.close()
            outcome = Outcome(TIMEOUT, error=f"killed after the {self.timeout:g} s timeout; its last output:\n"
                                             f"{self.process.output_tail()}")
        else:
            return None
        self.stream()
        outcome.duration = time.monotonic() - self.process.started
        if self.gpus:
            outcome.metrics["gpu_ids"] = list(self.gpus)
        return outcome

    def stream(self) -> None:
        """With -v: the job's new output, as it comes, on stderr."""
        if self.streamed is None:
            return
        try:
            with open(self.process.log_file, "rb") as f:
                f.seek(self.streamed)
                new = f.read()
        except OSError:
            return
        self.streamed += len(new)
        if new:
            sys.stderr.write(new.decode(errors="replace"))
            sys.stderr.flush()


class LocalExecutor:
    """Each job in a fresh subprocess on this machine. GPU jobs get disjoint GPUs of this host
    (CUDA_VISIBLE_DEVICES: each sees only its own), so jobs needing fewer GPUs than the host has
    run side by side; CPU jobs share the cores, `cpu_slots` at a time, never beside GPU jobs."""

    def __init__(self, cache_dir: str | None = None, job_module: str = "codesign.engine.job",
                 gpus: Sequence[int] = (), cpu_slots: int = 1, stream: bool = False):
        self.cache_dir = cache_dir
        self.job_module = job_module  # `python -m MODULE JOB.json OUTCOME.json` runs the job body
        self.gpus, self.cpu_slots, self.stream = tuple(gpus), cpu_slots, stream
        self.spare: SpareProcess | None = None

    def free_gpus(self, running: Sequence[LocalRun]) -> list[int]:
        held = {g for run in running for g in run.gpus}
        return [g for g in self.gpus if g not in held]

    def can_start(self, job: Job, running: Sequence[LocalRun]) -> bool:
        if job.platform == "gpu":
            if not self.gpus:  # the host's GPUs are not known by id: a GPU job holds them all
                return not running
            return (all(r.job.platform == "gpu" for r in running)
                    and len(self.free_gpus(running)) >= job.cluster.num_devices)
        return all(r.job.platform == "cpu" for r in running) and len(running) < self.cpu_slots

    def start(self, job: Job, timeout: float, plans: Sequence[Plan] = (), log: Path | None = None,
              running: Sequence[LocalRun] = (), then: Job | None = None,
              power_limits: Mapping[int, float] | None = None) -> LocalRun:
        """Run the job under the plans given (the toolkit chose them; with several, the fastest
        as measured), else under its manual spec's; GPU jobs on the first free GPUs, under the
        power limits given (job device id -> watts; its guard sets and restores them). A spare
        process starts for `then`, the job likely next (else one like this one), so that a sweep's
        first job on another cluster starts warm too; a job with limits never starts in a spare
        (its guard sets them as it starts)."""
        gpus = self._gpus_for(job, self.free_gpus(running))
        env = {**self._env(job, gpus), **limits_env(power_limits)}
        spare, self.spare = self.spare, None
        if spare is not None and not spare.fits(env, self.job_module):
            spare.close()
            spare = None
        process = JobProcess(job, env, self.job_module, plans, log, spare)
        if not running:  # the next job starts when this one ends, on the GPUs free then; beside
            # other jobs (GPUs shared out) it would see others: another environment, no spare
            ahead = then if then is not None and then.platform != "sim" else job
            self.spare = SpareProcess(self._env(ahead, self._gpus_for(ahead, self.gpus)), self.job_module)
        return LocalRun(job, timeout, process, gpus, self.stream)

    def _gpus_for(self, job: Job, free: Sequence[int]) -> tuple[int, ...]:
        return tuple(free[:job.cluster.num_devices]) if job.platform == "gpu" and self.gpus else ()

    def _env(self, job: Job, gpus: tuple[int, ...]) -> dict[str, str]:
        return job_env(job, self.cache_dir, extra={"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {})

    def wait(self, running: Sequence[LocalRun], seconds: float) -> list[tuple[LocalRun, Outcome]]:
        """Block until some jobs end (or overstay) or seconds pass; returns those that ended."""
        until = time.monotonic() + seconds
        while True:
            ended = [(run, outcome) for run in running if (outcome := run.check()) is not None]
            if ended or time.monotonic() >= until:
                return ended
            time.sleep(POLL_EVERY)

    def cancel(self, run: LocalRun) -> None:
        run.process.close()

    def close(self) -> None:
        """The sweep is over: no spare process outlives it."""
        if self.spare is not None:
            self.spare.close()
            self.spare = None


def _group_running(pgid: int) -> bool:
    """Some process of the group is alive; zombies hold no devices (and PID 1 may reap late)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (psutil.Error, ProcessLookupError):
            continue
    return False


def _exit_text(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"
