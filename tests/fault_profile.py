"""A device profiler that misbehaves on purpose: `python -m tests.fault_profile OUT.json`.

$FAULT_PROFILE says how: "hang" (it and a grandchild sleep, their pids noted in $FAULT_PIDS),
"crash", or "ok" (writes the built-in cpu profile as if measured). Each run appends the JAX
compilation cache it was given to $FAULT_CACHES, where set. Run by tests.fault_cli.
"""

import json
import os
import subprocess
import sys
import time

from codesign.hardware.profiles import BUILTIN


def main(out: str) -> None:
    behaviour = os.environ.get("FAULT_PROFILE", "ok")
    print(f"codesign profile: fake profile, {behaviour}", file=sys.stderr, flush=True)
    if os.environ.get("FAULT_CACHES"):
        with open(os.environ["FAULT_CACHES"], "a") as f:
            f.write(f"{os.environ.get('CODESIGN_CACHE_DIR')}\n")
    if behaviour == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAULT_PIDS"], "a") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(600)
    elif behaviour == "crash":
        raise RuntimeError("the profiler crashed")
    data = BUILTIN["cpu"].to_dict()
    data["source"] = "measured"
    with open(out, "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    main(sys.argv[1])
