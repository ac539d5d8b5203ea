"""The sweep loop: start what the executor has room for, handle what ended, repeat.

Every outcome, from `invalid` to a crashed process or a lost Ray node, goes through the
same path (store.finish); only this process writes the DB. SIGINT or SIGTERM stops the
loop after the running jobs are killed and recorded `interrupted` (a rerun retries them).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

from tqdm import tqdm

from codesign.errors import PlanError
from codesign.outcome import INTERRUPTED, INVALID, OOM, SIMULATED, Outcome
from codesign.planner.auto import Candidate, NoPlanFits, choose_plan
from codesign.planner.cost import predict, recorded
from codesign.planner.plan import Plan, make_plan
from codesign.planner.profiles import ProfileBook
from codesign.spec.config import LinkSpec
from codesign.spec.jobs import PlannedJob, job_timeout
from codesign.spec.types import Job
from codesign.store.database import Store

log = logging.getLogger(__name__)
HEARTBEAT_EVERY = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the orchestrator; the command exits 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


@contextlib.contextmanager
def signals_stop_the_sweep() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into Stopped; a second signal is ignored so the cleanup finishes."""
    def stop(signum: int, _frame: object) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Executor(Protocol):
    """Runs jobs out of process; a handle stands for one running job."""

    def can_start(self, job: Job, running: Sequence[Any]) -> bool: ...  # True when none run
    def start(self, job: Job, timeout: float, plans: Sequence[Plan] = ()) -> Any: ...  # plans: chosen
    def wait(self, running: Sequence[Any], seconds: float) -> list[tuple[Any, Outcome]]: ...
    def cancel(self, handle: Any) -> None: ...


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


@dataclass(eq=False)
class Attempt:
    """One claimed attempt in flight: the only record of it outside the DB."""

    item: PlannedJob
    attempt_id: int
    handle: Any
    prediction: dict[str, Any] = field(default_factory=dict)
    candidates: tuple[Candidate, ...] = ()  # Auto search: the plans sent to the job, best predicted first


@dataclass(frozen=True)
class Prepared:
    """What the orchestrator knows of a job before starting it: the plans the toolkit chose
    (none for a manual spec), what it predicts, or the outcome that makes a process pointless."""

    candidates: tuple[Candidate, ...] = ()
    prediction: dict[str, Any] = field(default_factory=dict)
    outcome: Outcome | None = None


def invalid_outcome(job: Job) -> Outcome | None:
    """Reject a plan that cannot run before paying for a process."""
    try:
        make_plan(job)
    except PlanError as err:
        return Outcome(INVALID, error=str(err), duration=0.0)
    return None


@dataclass(frozen=True)
class Pricing:
    """What the orchestrator prices plans with before anything runs: the device profiles and
    the config's link overrides. It predicts a manual plan and chooses an Auto search one."""

    book: ProfileBook = field(default_factory=ProfileBook)
    links: tuple[LinkSpec, ...] = ()

    def prepare(self, job: Job) -> Prepared:
        """An Auto search job's chosen plans, a manual one's prediction, or why it cannot run."""
        if job.parallel.is_auto:
            return self.choose(job)
        outcome = invalid_outcome(job)
        return Prepared(outcome=outcome) if outcome else Prepared(prediction=predict(job, self.book, self.links))

    def choose(self, job: Job) -> Prepared:
        """Search the plan space of an Auto search job: its auto_trials best plans, the best's
        prediction and the search's record; `oom` when no plan fits, `invalid` when none can run."""
        try:
            choice = choose_plan(job, self.book, self.links)
        except NoPlanFits as err:
            return Prepared(outcome=Outcome(OOM, error=str(err), duration=0.0))
        except PlanError as err:
            return Prepared(outcome=Outcome(INVALID, error=str(err), duration=0.0))
        log.info("Auto search priced %d plans in %.2f s", choice.priced, choice.seconds)
        return Prepared(choice.trials(job.parallel.auto_trials),
                        {**self.predicted(job, choice.best()), "auto_search": choice.record()})

    def predicted(self, job: Job, candidate: Candidate) -> dict[str, Any]:
        """A chosen plan's prediction, recorded as a manual plan's is."""
        return recorded(candidate.estimate, self.book.for_job(job))

    def with_trials(self, job: Job, outcome: Outcome, candidates: Sequence[Candidate]) -> Outcome:
        """A job that trialled several chosen plans ran the fastest as measured: its prediction
        is that plan's, and each trial is recorded with its prediction beside its measurement."""
        trials = outcome.metrics.get("auto_trials")
        if not trials:
            return outcome
        for trial, candidate in zip(trials, candidates):
            trial["predicted_time"] = candidate.estimate.seconds
        if outcome.chosen_plan:
            ran = Plan.from_dict(outcome.chosen_plan)
            outcome.metrics.update(next(self.predicted(job, c) for c in candidates if c.plan == ran))
        return outcome


class Sweep:
    """The loop's state: jobs not yet started, attempts running, what happened so far."""

    def __init__(self, planned: list[PlannedJob], store: Store, executor: Executor,
                 retry_failed: bool, manual_timeout: float, max_concurrent: int | None,
                 pricing: Pricing | None = None):
        self.queue = collections.deque(planned)
        self.running: list[Attempt] = []
        self.store, self.executor = store, executor
        self.retry_failed, self.manual_timeout = retry_failed, manual_timeout
        self.max_concurrent = max_concurrent or math.inf  # None: as many as the executor allows
        self.pricing = pricing or Pricing()
        self.summary = SweepSummary()
        self.progress = tqdm(total=len(planned), desc="jobs", unit="job", dynamic_ncols=True)

    def run(self) -> SweepSummary:
        beat = time.monotonic()
        try:
            while self.queue or self.running:
                self.start_what_fits()
                if not self.running:
                    continue
                for handle, outcome in self.executor.wait([a.handle for a in self.running], HEARTBEAT_EVERY):
                    self.record(next(a for a in self.running if a.handle is handle), outcome)
                if time.monotonic() - beat >= HEARTBEAT_EVERY:
                    beat = time.monotonic()
                    for attempt in self.running:
                        self.store.heartbeat(attempt.attempt_id)
        except BaseException as err:
            self.stop(err)
            raise
        finally:
            self.progress.close()
        return self.summary

    def start_what_fits(self) -> None:
        """Claim and start jobs in order while the cap and the executor allow; a simulated job is
        recorded with its prediction and never started."""
        while self.queue and len(self.running) < self.max_concurrent:
            item = self.queue[0]
            simulated = item.job.platform == "sim"
            if not (item.unavailable or simulated) and not self.executor.can_start(
                    item.job, [a.handle for a in self.running]):
                return
            self.queue.popleft()
            if item.unavailable:
                self.summary.unavailable[item.unavailable] += 1
                self.progress.update()
                continue
            attempt_id = self.store.claim(item.key, item.job, self.retry_failed)
            if attempt_id is None:
                self.summary.skipped += 1
                self.progress.update()
                continue
            ready = self.pricing.prepare(item.job)
            if ready.outcome is not None:
                self.record(Attempt(item, attempt_id, None), ready.outcome)
                continue
            if simulated:
                self.record(Attempt(item, attempt_id, None, ready.prediction), simulated_outcome(item.job, ready))
                continue
            plans = [c.plan for c in ready.candidates]
            handle = self.executor.start(item.job, job_timeout(item.job, self.manual_timeout), plans)
            self.running.append(Attempt(item, attempt_id, handle, ready.prediction, ready.candidates))

    def record(self, attempt: Attempt, outcome: Outcome) -> None:
        """The one path every outcome takes into the DB."""
        if attempt in self.running:
            self.running.remove(attempt)
        outcome = self.pricing.with_trials(attempt.item.job, outcome, attempt.candidates)
        outcome.metrics = {**attempt.prediction, **outcome.metrics}
        if not self.store.finish(attempt.attempt_id, outcome):
            log.warning("attempt %d was closed by another orchestrator; its outcome %s is dropped",
                        attempt.attempt_id, outcome.status)
        self.summary.statuses[outcome.status] += 1
        self.progress.update()
        log.info("job %s: %s%s", attempt.item.key[:12], outcome.status,
                 f" ({outcome.error.strip().splitlines()[-1]})" if outcome.error else "")

    def stop(self, err: BaseException) -> None:
        """Kill what runs and record it as interrupted (a plain rerun retries it)."""
        if isinstance(err, Stopped):
            why = f"the orchestrator got {err}"
        else:
            why = "stopped by the user" if isinstance(err, KeyboardInterrupt) else f"the sweep stopped: {err!r}"
        for attempt in list(self.running):
            self.executor.cancel(attempt.handle)
            self.store.finish(attempt.attempt_id, Outcome(INTERRUPTED, error=why))
            self.running.remove(attempt)


def simulated_outcome(job: Job, ready: Prepared) -> Outcome:
    """A job on a cluster this machine does not have: its plan (chosen, for Auto search) is
    recorded with its prediction, and nothing runs."""
    if ready.candidates:
        plan = ready.candidates[0].plan
        return Outcome(SIMULATED, plan=plan.describe(), chosen_plan=plan.to_dict(), duration=0.0)
    return Outcome(SIMULATED, plan=make_plan(job).describe(), duration=0.0)


def run_sweep(planned: list[PlannedJob], store: Store, executor: Executor, retry_failed: bool,
              manual_timeout: float, max_concurrent: int | None = 1,
              pricing: Pricing | None = None) -> SweepSummary:
    reaped = store.reap_stale()
    if reaped:
        log.warning("marked %d attempt(s) of stopped runs as interrupted", reaped)
    return Sweep(planned, store, executor, retry_failed, manual_timeout, max_concurrent, pricing).run()
