"""The lifeline of a job: a small process that leads the job's process group and takes the
whole group down the moment the process that started it is gone.

`python -m codesign.run.guard PARENT_PID LIFELINE_FD MODULE ARGS...` runs `python -m MODULE
ARGS...` as its child, in its own group. The parent holds the write end of a pipe whose read
end is LIFELINE_FD: when the parent dies (kill -9, the OOM killer), the kernel closes it, the
read sees end-of-file, and the guard SIGKILLs its group: the job body and everything it
started, however busy (a compile holding the GIL cannot delay a separate process). The
parent-death signal is a second path to the same end. When the job body ends by itself, the
guard (a child subreaper, so orphaned descendants become its children) kills what it left
behind, then exits as its child did, so the parent reads the job's own exit code or signal.

A job given GPU power limits (`power_limits`) runs under them: the guard sets them before the
job body starts and puts the previous ones back on every way out it has (the job body ends,
crashes or is killed; the lifeline closes; SIGTERM), before it kills the group. Only SIGKILL of
the guard itself would skip that: the executor sends SIGTERM first to a limited job's guard.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

import psutil

from codesign.gpu_power import APPLIED_ENV, PowerLimits, from_env

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_ROUNDS = 3  # kill-and-wait rounds for what the job body left (a process may fork meanwhile)
LIMITS: list[PowerLimits] = []  # the job's power limits, once set: every way out restores them


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value)


def set_parent_death_signal(signum: int) -> None:
    """Linux: the kernel sends signum to this process when the thread that started it ends."""
    _prctl(_PR_SET_PDEATHSIG, signum)


def kill_leftovers() -> None:
    """SIGKILL and reap every descendant still alive after the job body ended."""
    for _ in range(LEFTOVER_ROUNDS):
        left = psutil.Process().children(recursive=True)
        if not left:
            return
        for proc in left:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=5)


def restore_limits() -> None:
    for limits in LIMITS:
        limits.restore()


def kill_group(*_: object) -> None:
    """Put the power limits back, then SIGKILL this process group: the guard, the job body and
    whatever they started."""
    restore_limits()
    os.killpg(0, signal.SIGKILL)


def set_limits() -> dict[str, str] | None:
    """Set the job's power limits, if it has any; the job body's environment then says whether
    they were (None: the guard's own environment, unchanged)."""
    limits = from_env()
    if limits is None:
        return None
    LIMITS.append(limits)
    return {**os.environ, APPLIED_ENV: limits.apply()}


def watch(lifeline: int) -> None:
    """Block on the lifeline; the parent never writes, so returning means it has closed."""
    while os.read(lifeline, 1):
        pass
    kill_group()


def exit_as(code: int) -> None:
    """End this process the way the child ended: same exit code, or the same signal."""
    if code < 0:
        if -code != signal.SIGKILL:  # Python's handlers (SIGINT, SIGTERM here) must not catch it
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


def main(argv: list[str]) -> None:
    parent, lifeline, command = int(argv[0]), int(argv[1]), argv[2:]
    signal.signal(signal.SIGTERM, kill_group)
    set_parent_death_signal(signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent:  # the parent died before the death signal was armed
        kill_group()
    child = subprocess.Popen([sys.executable, "-m", *command], env=set_limits(),
                             preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL))
    threading.Thread(target=watch, args=(lifeline,), daemon=True).start()
    code = child.wait()
    kill_leftovers()
    restore_limits()
    exit_as(code)


if __name__ == "__main__":
    main(sys.argv[1:])
