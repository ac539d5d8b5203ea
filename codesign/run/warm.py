"""A job process started before its job, so that the next job does not wait for Python and JAX
to import (a large share of a small job's time).

`python -m codesign.run.warm MODULE` imports what a job body needs, then reads one line from
stdin: a JSON list [LOG, ARGS...]. It sends its output to LOG and runs `python -m MODULE ARGS...`
in this process. End of input without a line (the sweep ended first) exits quietly. Nothing here
touches a device: which devices JAX will see is already fixed by the environment, read when the
job body first uses JAX.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

WARM_IMPORTS = ("jax", "flax.linen", "optax", "codesign.engine.programs", "codesign.engine.step",
                "codesign.engine.pipeline")
# A GPU job's energy meter (the `energy` extra, where installed); CPU jobs rarely have a counter.
GPU_WARM_IMPORTS = ("zeus.monitor",)


def redirect_output(path: str) -> None:
    """This process's stdout and stderr (and its children's) append to path."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> None:
    module = argv[0]
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        for name in GPU_WARM_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    line = sys.stdin.readline()
    if not line:
        return
    log, *args = json.loads(line)
    redirect_output(log)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
