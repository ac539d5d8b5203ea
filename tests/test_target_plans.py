"""bench/target_plans.py on CPU devices: every plan of a config (Auto search's, the one it
chooses) compiled as a job compiles it, nothing allocated, its collectives counted from the
compiled programs. CI has no CUDA build of JAX: virtual CPU devices stand in for the GPUs."""

import json

import pytest

from tests.configs import EVERY_MIXER_MODEL
from tests.conftest import run_on_devices

CONFIG = """
[training_spec]
avg_batch_size_per_device = 4
num_iters = 2
""" + EVERY_MIXER_MODEL + """
[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 4
transport = "NVLink"

[[parallel_spec]]
description = "data parallel"
num_micro_batches = [1]
"(pp, dp, op)" = [1, 4, 1]

[[parallel_spec]]
description = "ZeRO-2"
num_micro_batches = [2]
"(pp, dp, op)" = [1, 4, 1]
auto_sharding_option = { prefer_reduce_scatter = true }

[[parallel_spec]]
description = "pipeline"
num_micro_batches = [2]
"(pp, dp, op)" = [2, 2, 1]
num_auto_layers = 2

[[parallel_spec]]
description = "too many stages"
num_micro_batches = [1]
"(pp, dp, op)" = [4, 1, 1]
num_auto_layers = 4

[[parallel_spec]]
description = "Auto search"
num_micro_batches = [1]
"""


@pytest.mark.slow
@pytest.mark.scripts
def test_each_plan_is_compiled_with_its_collectives_counted(tmp_path):
    (tmp_path / "plans.toml").write_text(CONFIG)
    proc = run_on_devices(4, f"""
        import json, sys
        from pathlib import Path
        import jax, numpy as np
        sys.path.insert(0, "bench")
        import target_plans
        from codesign.engine import programs
        programs.init_state = None  # compiling a plan allocates nothing
        jobs = target_plans.config_jobs(Path({str(tmp_path / "plans.toml")!r}))
        rows = [target_plans.job_rows(job, lambda hosts, per_host: np.array(jax.devices()[:hosts * per_host]), 2**40,
                                      each=True) for job in jobs]
        print(json.dumps([[job.platform for job in jobs], rows]))
    """)
    platforms, rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert platforms == ["gpu"] * 5, proc.stderr[-2000:]
    fields = [lines[0].split("'")[-1].split() for lines in rows]
    collectives = {name: dict(zip(["programs", "all-reduce", "all-gather", "reduce-scatter"], map(int, f[0:1] + f[2:5])))
                   for name, f in zip(["dp", "zero2", "pipeline"], fields)}
    assert collectives["dp"]["programs"] == 1 and collectives["dp"]["all-reduce"] >= 1
    assert collectives["zero2"]["all-gather"] >= 1  # the updated shards gathered (XLA:CPU all-reduces its scatters)
    assert collectives["pipeline"]["programs"] == 6
    all_reduces = {" ".join(line.split()[:3]): int(line.split()[3]) for line in rows[2][1:]}  # per program
    assert list(all_reduces) == [f"stage {i} {kind}" for i in (0, 1) for kind in ("forward", "backward", "update")]
    assert [all_reduces[f"stage {i} backward"] for i in (0, 1)] == [0, 0]  # 2 micro-batches: synced once, in the update
    assert all(all_reduces[f"stage {i} update"] >= 1 for i in (0, 1))
    assert all(f[-3] == "yes" for f in fields[:3] + fields[4:])  # then the cost model's peak, and its ratio to XLA's
    assert all(float(f[-1]) > 0 for f in fields[:3] + fields[4:])
    auto = rows[4][0]  # Auto search: the plan it chose, by the built-in H100 profile, compiled
    assert auto.startswith("1x4 Auto search groups=1 mb1 'Auto search' -> ") and "failed" not in auto, auto
    assert rows[3] == [rows[3][0]] and "failed: PlanError: num_auto_layers = 4 layer groups, but the model has only 2 layers" in rows[3][0]
