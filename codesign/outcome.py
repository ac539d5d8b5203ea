"""What a finished attempt produced: its status and, when it ran, its measurements."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
                  "energy_per_iter", "profile_id", "cost_model", "codesign_version", "gpu_ids", "jobs_beside",
                  "log_path", "avg_power", "energy_source", "predicted_energy")


@dataclass
class Outcome:
    status: str
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)  # concrete devices, stages, shardings
    chosen_plan: dict[str, Any] = field(default_factory=dict)  # Plan.to_dict() of a plan the toolkit chose
    duration: float | None = None


def write_outcome(path: str | Path, outcome: Outcome) -> None:
    """Write the whole outcome or nothing: a temp file beside it, then an atomic rename, so a
    job killed mid-write leaves no half file for the orchestrator to trust."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(outcome)))
    os.replace(tmp, path)


def read_outcome(path: str | Path) -> Outcome:
    """The outcome a job body wrote; ValueError when the file holds none."""
    text = Path(path).read_text()
    if not text.strip():
        raise ValueError("the file is empty")
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("status") not in FINAL_STATUSES:
        raise ValueError(f"no final status in {text[:200]!r}")
    try:
        return Outcome(**data)
    except TypeError as err:
        raise ValueError(str(err)) from None
