"""A job body that misbehaves on purpose, chosen by the job's parallel description.

Run by the executor as `python -m tests.fault_jobs JOB.json OUTCOME.json`.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time


def main(job_path: str, outcome_path: str) -> None:
    with open(job_path) as f:
        behaviour = json.load(f)["parallel"]["description"]
    if behaviour == "hang":
        # a grandchild in the same process group must die with the job
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAULT_PIDS"], "a") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(600)
    elif behaviour == "kill-actor":
        # Ray only: SIGKILL the actor that started this job body; the job body must die with it
        with open(os.environ["FAULT_PIDS"], "a") as f:
            f.write(f"{os.getpid()} {os.getppid()}\n")
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(600)
    elif behaviour.startswith("sleep"):
        # record when it ran, so a test can see jobs overlap
        start = time.time()
        time.sleep(1.5)
        with open(os.environ["FAULT_PIDS"], "a") as f:
            f.write(f"{start} {time.time()}\n")
    elif behaviour == "crash":
        print("about to crash", flush=True)
        raise RuntimeError("the job body crashed")
    elif behaviour == "segfault":
        ctypes.string_at(0)
    with open(outcome_path, "w") as f:
        json.dump({"status": "succeeded", "metrics": {"avg": 0.5}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
