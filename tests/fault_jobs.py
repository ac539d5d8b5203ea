"""A job body that misbehaves on purpose, chosen by the job's parallel description.

Run by the executor as `python -m tests.fault_jobs JOB.json OUTCOME.json`; `tests.fault_cli`
is the codesign command line with this job body.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

from codesign.outcome import Outcome, write_outcome


def note(line: str) -> None:
    """Append a line to $FAULT_PIDS, where a test reads pids and times."""
    with open(os.environ["FAULT_PIDS"], "a") as f:
        f.write(line + "\n")


def process_age() -> float:
    """Seconds since this process was created, on the kernel's boot clock (psutil's create_time
    adds a boot time rounded to the second: up to 1 s off time.time())."""
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")


def wait_until(condition: Callable[[], bool], seconds: float = 30) -> None:
    """Poll the condition until it holds or the seconds are up (the test then finds out which)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def meet(jobs: int) -> None:
    """Mark this job started in $FAULT_PIDS.started, then wait until `jobs` have."""
    started = os.environ["FAULT_PIDS"] + ".started"
    with open(started, "a") as f:
        f.write(f"{os.getpid()}\n")

    def all_started() -> bool:
        with open(started) as f:
            return len(f.readlines()) >= jobs

    wait_until(all_started)


def spare_beside() -> bool:
    """Whether the executor that started this job (its guard's parent) has a spare process
    (`codesign.run.warm`) other than this one, which may itself be a former spare."""
    executor = psutil.Process(os.getppid()).parent()
    for proc in executor.children(recursive=True):
        try:
            if proc.pid != os.getpid() and proc.cmdline()[1:3] == ["-m", "codesign.run.warm"]:
                return True
        except psutil.Error:
            continue
    return False


def main(job_path: str, outcome_path: str) -> None:
    with open(job_path) as f:
        behaviour = json.load(f)["parallel"]["description"]
    print(f"fault job: {behaviour}", flush=True)  # what its log shows
    if behaviour == "hang":
        # a grandchild in the same process group must die with the job
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        note(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    elif behaviour == "kill-actor":
        # Ray only: SIGKILL the actor that started this job body (its guard's parent); the job
        # body and its grandchild must die with it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        actor = psutil.Process(os.getppid()).ppid()
        note(f"{os.getpid()} {actor} {child.pid}")
        os.kill(actor, signal.SIGKILL)
        time.sleep(600)
    elif behaviour.startswith("work"):
        # "work SECONDS": a grandchild in the job's group, then SECONDS of "training", then success
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(float(behaviour.split()[1]))
    elif behaviour.startswith("sleep"):
        # record when it ran and which GPUs it saw, so a test can see jobs run one after another
        start = time.time()
        time.sleep(1.5)
        note(f"{start} {time.time()} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}")
    elif behaviour.startswith("meet"):
        # "meet N LABEL": like sleep, but before ending wait (30 s at most) until N such jobs have
        # started, so jobs that run at once overlap however slowly their processes start
        start = time.time()
        meet(int(behaviour.split()[1]))
        note(f"{start} {time.time()} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}")
    elif behaviour.startswith("whoami"):
        # "whoami LABEL": which process ran it, when that process was created, when the job ended;
        # it ends once a spare process runs beside it (30 s at most), however slowly that one starts
        wait_until(spare_beside)
        note(f"{behaviour.split()[1]} {os.getpid()} {time.time() - process_age()} {time.time()}")
    elif behaviour.startswith("measured"):
        # "measured LABEL": succeeds at once with a step time and a peak, a point to learn from
        write_outcome(outcome_path, Outcome("succeeded", metrics={"avg": 0.5, "median": 0.5, "max_memory": 1e6}))
        return
    elif behaviour == "crash":
        print("about to crash", flush=True)
        raise RuntimeError("the job body crashed")
    elif behaviour == "segfault":
        ctypes.string_at(0)
    elif behaviour == "no-outcome":
        return
    elif behaviour in ("empty-outcome", "corrupt-outcome"):
        with open(outcome_path, "w") as f:
            f.write("" if behaviour == "empty-outcome" else '{"status": "succ')
        return
    write_outcome(outcome_path, Outcome("succeeded", metrics={"avg": 0.5}))


if __name__ == "__main__":
    main(*sys.argv[1:])
