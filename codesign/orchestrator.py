"""The sweep loop: for each enumerated job, claim it, run it, record it.

Every outcome, from `invalid` to a crashed process, goes through the same path
(store.finish); only a user's interrupt stops the loop, after recording it.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Protocol

from tqdm import tqdm

from codesign.errors import PlanError
from codesign.jobs import PlannedJob, job_timeout
from codesign.plan import make_plan
from codesign.results import INTERRUPTED, INVALID, Outcome
from codesign.specs import Job
from codesign.store import Store

log = logging.getLogger(__name__)


class Executor(Protocol):
    def run(self, job: Job, timeout: float, heartbeat) -> Outcome: ...


@dataclass
class SweepSummary:
    statuses: collections.Counter = field(default_factory=collections.Counter)
    skipped: int = 0
    unavailable: collections.Counter = field(default_factory=collections.Counter)  # reason -> jobs

    def lines(self) -> list[str]:
        ran = ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items())) or "none"
        out = [f"attempted: {ran}; skipped (already recorded or running elsewhere): {self.skipped}"]
        out += [f"not attempted, {n} job(s): {why}" for why, n in self.unavailable.items()]
        return out


def invalid_outcome(job: Job) -> Outcome | None:
    """Reject a plan that cannot run before paying for a process."""
    try:
        make_plan(job)
    except PlanError as err:
        return Outcome(INVALID, error=str(err), duration=0.0)
    return None


def run_sweep(planned: list[PlannedJob], store: Store, executor: Executor,
              retry_failed: bool, manual_timeout: float) -> SweepSummary:
    summary = SweepSummary()
    reaped = store.reap_stale()
    if reaped:
        log.warning("marked %d attempt(s) of stopped runs as interrupted", reaped)
    for item in tqdm(planned, desc="jobs", unit="job", dynamic_ncols=True):
        if item.unavailable:
            summary.unavailable[item.unavailable] += 1
            continue
        attempt = store.claim(item.key, item.job, retry_failed)
        if attempt is None:
            summary.skipped += 1
            continue
        outcome = _run_one(item.job, attempt, store, executor, manual_timeout)
        summary.statuses[outcome.status] += 1
        log.info("job %s: %s%s", item.key[:12], outcome.status,
                 f" ({outcome.error.strip().splitlines()[-1]})" if outcome.error else "")
    return summary


def _run_one(job: Job, attempt: int, store: Store, executor: Executor, manual_timeout: float) -> Outcome:
    outcome = invalid_outcome(job)
    try:
        if outcome is None:
            outcome = executor.run(job, job_timeout(job, manual_timeout), lambda: store.heartbeat(attempt))
    except KeyboardInterrupt:
        store.finish(attempt, Outcome(INTERRUPTED, error="stopped by the user"))
        raise
    if not store.finish(attempt, outcome):
        log.warning("attempt %d was closed by another orchestrator; its outcome %s is dropped",
                    attempt, outcome.status)
    return outcome
