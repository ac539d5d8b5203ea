"""A plan too big for its devices is recorded `oom` from the compiled program, before allocation."""

import jax

from codesign import programs, runtime
from codesign.specs import ClusterSpec, Job, ModelSpec, ParallelSpec, TrainingSpec


class SmallDevice:
    """Stands in for a GPU's allocator statistics: CPUs report no memory limit."""

    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_too_big_a_plan_is_oom_before_anything_is_allocated(monkeypatch):
    job = Job(ModelSpec(64, 16, 4, 2, (("DOT", "LINEAR"),) * 2), ClusterSpec(1, 1, "NVLink", "cpu"),
              TrainingSpec(32, 3), ParallelSpec("single", (1,), 1, False, (1, 1, 1)), 1, "cpu")
    allocated = []
    monkeypatch.setattr(programs, "init_state", lambda *a: allocated.append(a))
    monkeypatch.setattr(jax, "local_devices", lambda: [SmallDevice(1 << 20)])
    outcome = runtime.run_job(job)
    assert outcome.status == "oom" and not allocated
    assert "GiB per device, the device has 0.00 GiB" in outcome.error
    assert outcome.plan["stages"][0]["device_ids"] == [0]
