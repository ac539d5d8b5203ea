"""What a finished attempt produced: its status and, when it ran, its measurements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
TIMEOUT = "timeout"
OOM = "oom"
INVALID = "invalid"
INTERRUPTED = "interrupted"
SIMULATED = "simulated"  # priced by the cost model, never run (a platform = "sim" cluster)
FINAL_STATUSES = (SUCCEEDED, FAILED, TIMEOUT, OOM, INVALID, INTERRUPTED, SIMULATED)
DONE_STATUSES = (SUCCEEDED, SIMULATED)  # a job with one of these is finished, even under --retry-failed

# Measurements a job body reports; each is a column of the attempts table.
METRIC_COLUMNS = ("avg", "median", "p90", "max_memory", "throughput", "compile_time",
                  "predicted_time", "predicted_memory", "compiled_memory", "device_kind", "versions",
                  "energy_per_iter")


@dataclass
class Outcome:
    status: str
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)  # concrete devices, stages, shardings
    chosen_plan: dict[str, Any] = field(default_factory=dict)  # Plan.to_dict() of a plan the toolkit chose
    duration: float | None = None
