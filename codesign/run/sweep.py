"""The sweep loop: start what the executor has room for, handle what ended, repeat.

Every outcome, from `invalid` to a crashed process or a lost Ray node, goes through the
same path (`Sweep.record` -> store.finish); only this process writes the DB. The orchestrator's
own failures take it too: an exception while pricing a job closes its attempt as `failed` with
the traceback's tail; one while recording a finished job records the job's own outcome with the
traceback beside its error (its measurements are never lost); the sweep goes on. SIGINT or
SIGTERM only set a flag, which the loop acts on between steps (so a finished result is always
recorded): it kills the running jobs, records them `interrupted` (a rerun retries them) and stops.

The cost model learns beside the loop: recording a point costs the same however many the
machine has, and a refit runs on a thread of its own (run.learning.Refits), so no job's
timeout or duration waits on one. Where jobs share the orchestrator's cores (virtual CPU
devices), a refit never runs beside one: it would slow the very steps it learns from. It waits
for the host's jobs to end, and no such job starts until it has; on GPUs it runs beside them.
The last refit due ends before the sweep returns.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import signal
import sys
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

from tqdm import tqdm

from codesign import __version__
from codesign.errors import PlanError
from codesign.outcome import FAILED, INTERRUPTED, INVALID, METRIC_COLUMNS, OOM, SIMULATED, Outcome
from codesign.planner.auto import Candidate, NoPlanFits, choose_plan
from codesign.planner.columns import plan_columns
from codesign.cost.learning import Calibration
from codesign.cost.model import predict, recorded
from codesign.cost.plan import Plan, make_plan
from codesign.planner.power_limits import by_device
from codesign.hardware.profiles import DeviceProfile, ProfileBook, profile_id
from codesign.run.profile_cache import Profiles
from codesign.run.learning import Refits, point_of
from codesign.run.reprice import prediction, stale, with_provenance
from codesign.config.loader import LinkSpec
from codesign.config.jobs import PlannedJob, job_timeout
from codesign.config.types import Job
from codesign.store.database import CONFIG_METRICS, Heartbeat, Store

log = logging.getLogger(__name__)
HEARTBEAT_EVERY = 5.0
POLL_EVERY = 0.5  # seconds the loop waits on its jobs before it looks at the stop flag again
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
TRACEBACK_TAIL = 3000  # characters of an orchestrator traceback kept on the attempt


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the orchestrator; the command exits 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


@dataclass
class StopFlag:
    """Set by a stop signal; the loop raises Stopped where it is safe to (never mid-record)."""

    signum: int | None = None

    def check(self) -> None:
        if self.signum is not None:
            raise Stopped(self.signum)


@contextlib.contextmanager
def signals_stop_the_sweep() -> Iterator[StopFlag]:
    """SIGINT and SIGTERM set the flag; a second signal is ignored so the cleanup finishes."""
    flag = StopFlag()

    def stop(signum: int, _frame: object) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        flag.signum = signum

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Executor(Protocol):
    """Runs jobs out of process; a handle stands for one running job."""

    def can_start(self, job: Job, running: Sequence[Any]) -> bool: ...  # True when none run
    def start(self, job: Job, timeout: float, plans: Sequence[Plan] = (), log: Path | None = None,
              running: Sequence[Any] = (), then: Job | None = None,
              power_limits: Mapping[int, float] | None = None) -> Any: ...
    # plans: chosen; log: where its output goes; then: the job likely to start next (a hint);
    # power_limits: watts per job device id, set for the job where the machine permits
    def wait(self, running: Sequence[Any], seconds: float) -> list[tuple[Any, Outcome]]: ...
    def cancel(self, handle: Any) -> None: ...
    def close(self) -> None: ...  # the sweep is over: release what the executor keeps between jobs


FAILURES = (FAILED, "timeout", OOM)  # statuses that make a finished sweep exit 3 (invalid is the config's answer)


@dataclass
class SweepSummary:
    statuses: collections.Counter = field(default_factory=collections.Counter)
    skipped: int = 0
    unavailable: collections.Counter = field(default_factory=collections.Counter)  # reason -> jobs
    repriced: int = 0  # simulated attempts priced again (their profile, links or cost model changed)

    @property
    def failures(self) -> int:
        return sum(self.statuses[s] for s in FAILURES)

    def lines(self) -> list[str]:
        ran = ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items())) or "none"
        out = [f"attempted: {ran}; skipped (already recorded or running elsewhere): {self.skipped}"]
        out += [f"re-priced {self.repriced} simulated attempt(s): their profile, links or cost model changed"
                ] * bool(self.repriced)
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
    log: Path | None = None
    beside: int = 0  # the most jobs that ran beside it at once


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


def failure(what: str) -> str:
    """The orchestrator's own exception, said as the error of the job it was handling."""
    return f"codesign failed while {what}:\n{traceback.format_exc()[-TRACEBACK_TAIL:]}"


def beside(came: Outcome, error: str) -> Outcome:
    """A job's outcome with the orchestrator's failure to record it appended to its error: its
    status and the measurements the DB has columns for stay (only the bookkeeping failed)."""
    known = set(METRIC_COLUMNS) | set(CONFIG_METRICS)
    return replace(came, error="\n".join(e for e in (came.error, error) if e),
                   metrics={k: v for k, v in came.metrics.items() if k in known})


@dataclass
class Pricing:
    """What the orchestrator prices plans with before anything runs: the device profiles and
    the config's link overrides. It predicts a manual plan and chooses an Auto search one."""

    profiles: Profiles = field(default_factory=lambda: Profiles(ProfileBook()))
    links: tuple[LinkSpec, ...] = ()
    priced_by: dict[str, DeviceProfile] = field(default_factory=dict)  # profile id -> each profile that priced
    in_use: dict[str, Calibration | None] = field(init=False)  # platform -> the calibration its jobs are priced by

    def __post_init__(self) -> None:
        self.in_use = {platform: learner.current for platform, learner in self.profiles.learners.items()}

    def provenance(self, found: dict[str, Any], job: Job) -> dict[str, Any]:
        """A prediction with what made it; the profile kept by its id, which a refit may replace in the book."""
        profile = self.book.for_job(job)
        self.priced_by[profile_id(profile)] = profile
        return with_provenance(found, profile, self.links)

    @property
    def book(self) -> ProfileBook:
        return self.profiles.book

    def prepare(self, job: Job) -> Prepared:
        """An Auto search job's chosen plans, a manual one's prediction, or why it cannot run."""
        if job.parallel.is_auto:
            return self.choose(job)
        outcome = invalid_outcome(job)
        if outcome:
            return Prepared(outcome=outcome)
        return Prepared(prediction=self.provenance(predict(job, self.book, self.links), job))

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
        return self.provenance(recorded(candidate.estimate, self.book.for_job(job)), job)

    def learn(self, job: Job, outcome: Outcome, source: str) -> bool:
        """A measured attempt of this machine is a point of its cost model (run.learning); True
        when it was one (a refit may be due)."""
        learner = self.profiles.learners.get(job.platform)
        if learner is None or job.cluster.is_simulated:
            return False
        point = point_of(job, outcome, self.links, source, profile_id(learner.base))
        if point is None:
            return False
        learner.learn(point)
        self.use_learned()
        return True

    def use_learned(self) -> None:
        """Jobs priced from now on are priced by each learner's calibration in use, where it
        changed: a raised memory bound, a refit it accepted, or another sweep's."""
        for platform, learner in self.profiles.learners.items():
            if self.in_use.get(platform) != learner.current:
                self.in_use[platform] = learner.current
                self.book.add(learner.profile)

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
                 pricing: Pricing | None = None, logs: Path | None = None, stop: StopFlag | None = None):
        self.queue = collections.deque(planned)
        self.running: list[Attempt] = []
        self.store, self.executor = store, executor
        self.retry_failed, self.manual_timeout = retry_failed, manual_timeout
        self.max_concurrent = max_concurrent or math.inf  # None: as many as the executor allows
        self.pricing = pricing or Pricing()
        self.logs, self.stop_flag = logs, stop or StopFlag()
        self.kept_profiles: set[str] = set()
        self.heartbeat = Heartbeat(store.path, HEARTBEAT_EVERY)  # beats each attempt from claim to close
        self.refits = Refits(self.pricing.profiles.learners)
        self.version = __version__
        self.summary = SweepSummary()
        self.progress = tqdm(total=len(planned), desc="jobs", unit="job", dynamic_ncols=True,
                             disable=not sys.stderr.isatty())

    def run(self) -> SweepSummary:
        try:
            with self.heartbeat:
                while self.queue or self.running:
                    self.stop_flag.check()
                    self.refit_when_free()
                    self.start_what_fits()
                    if not self.running:
                        self.refits.wait(POLL_EVERY)  # what holds the queue back, if anything: a refit
                        continue
                    for handle, outcome in self.executor.wait([a.handle for a in self.running], POLL_EVERY):
                        self.record(next(a for a in self.running if a.handle is handle), outcome)
                self.stop_flag.check()
                self.finish_refits()
        except BaseException as err:
            self.stop(err)
            raise
        finally:
            self.executor.close()
            self.progress.close()
        return self.summary

    def refit_when_free(self) -> None:
        """Price by what the last refit found; start a due one unless a job sharing the
        orchestrator's cores runs."""
        self.pricing.use_learned()
        if self.refits.pending and not any(self.shares_cores(a.item.job) for a in self.running):
            self.refits.start()

    def finish_refits(self) -> None:
        """The jobs are over: the refits due run, one after another, minding the stop flag."""
        while self.refits.pending:
            self.refits.start()
            self.refits.wait(POLL_EVERY)
            self.stop_flag.check()
        self.pricing.use_learned()

    def shares_cores(self, job: Job) -> bool:
        return self.pricing.book.for_job(job).shares_cores

    def start_what_fits(self) -> None:
        """Claim and start jobs in order while the cap and the executor allow, and no refit is
        due or running where the job would share its cores; a simulated job is recorded with its
        prediction and never started."""
        while self.queue and len(self.running) < self.max_concurrent:
            item = self.queue[0]
            simulated = item.job.platform == "sim"
            if not (item.unavailable or simulated) and (
                    not self.executor.can_start(item.job, [a.handle for a in self.running])
                    or self.refits.pending and self.shares_cores(item.job)):
                return
            if not item.unavailable and not self.profile_ready(item):
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
                if simulated:
                    self.refresh_simulated(item)
                continue
            self.heartbeat.hold(attempt_id)
            self.start(item, attempt_id)

    def profile_ready(self, item: PlannedJob) -> bool:
        """An Auto search job needs this machine's devices measured: once, right before the first
        such job that runs, with the devices idle (False: wait for the running jobs to end)."""
        platform = item.job.platform
        if not item.job.parallel.is_auto or self.pricing.profiles.has_measured(platform):
            return True
        if self.store.decide(item.key, self.retry_failed).action != "run":
            return True
        if self.running:
            return False
        self.pricing.profiles.measured_for(platform, self.stop_flag.check)
        return True

    def refresh_simulated(self, item: PlannedJob) -> None:
        """A simulated job already recorded is priced again when its profile, the config's links
        or the cost model changed since (nothing ran: the prediction is all it holds)."""
        for row in self.store.attempts_of(item.key, SIMULATED):
            try:
                now, profile = prediction(row, self.pricing.book, self.pricing.links)
            except Exception:  # the recorded prediction stays; the sweep goes on
                log.warning("could not price simulated attempt %d again:\n%s", row["id"], traceback.format_exc())
                continue
            if profile is not None and stale(row, now):
                self.store.reprice_simulated(row["id"], now)
                self.keep_profile(profile)
                self.summary.repriced += 1

    def start(self, item: PlannedJob, attempt_id: int) -> None:
        """Price the claimed job and start it (or record why it does not start)."""
        try:
            ready = self.pricing.prepare(item.job)
        except Exception:
            self.record(Attempt(item, attempt_id, None),
                        Outcome(FAILED, error=failure("pricing the job"), duration=0.0))
            return
        if ready.outcome is not None:
            self.record(Attempt(item, attempt_id, None, ready.prediction), ready.outcome)
            return
        if item.job.platform == "sim":
            self.record(Attempt(item, attempt_id, None, ready.prediction), simulated_outcome(item.job, ready))
            return
        log_path = self.logs / item.key / f"{attempt_id}.log" if self.logs else None
        if log_path:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        plans = [c.plan for c in ready.candidates]
        limits = by_device(plans[0], ready.candidates[0].estimate) if plans else {}
        handle = self.executor.start(item.job, job_timeout(item.job, self.manual_timeout), plans, log_path,
                                     [a.handle for a in self.running], self.queue[0].job if self.queue else None,
                                     power_limits=limits or None)
        self.running.append(Attempt(item, attempt_id, handle, ready.prediction, ready.candidates, log_path))
        for attempt in self.running:
            attempt.beside = max(attempt.beside, len(self.running) - 1)

    def record(self, attempt: Attempt, outcome: Outcome) -> None:
        """The one path every outcome takes into the DB; when the bookkeeping around it fails, the
        job's own outcome is recorded as it came, with the traceback beside its error."""
        if attempt in self.running:
            self.running.remove(attempt)
        came = copy.deepcopy(outcome)  # the bookkeeping adds to the outcome in place
        try:
            outcome, columns = self.closing(attempt, outcome)
            closed = self.store.finish(attempt.attempt_id, outcome, columns)
        except Exception:
            outcome = beside(came, failure(f"recording the job's {came.status} outcome"))
            log.warning("attempt %d: recording its outcome failed (%s); its measurements are kept beside the error",
                        attempt.attempt_id, outcome.error.strip().splitlines()[-1])
            closed = self.store.finish(attempt.attempt_id, outcome)
        self.heartbeat.release(attempt.attempt_id)
        if not closed:
            log.warning("attempt %d was closed by another orchestrator; its outcome %s is dropped",
                        attempt.attempt_id, outcome.status)
        else:
            self.learn(attempt, outcome)
        self.summary.statuses[outcome.status] += 1
        self.progress.update()
        log.info("job %s: %s%s", attempt.item.key[:12], outcome.status,
                 f" ({outcome.error.strip().splitlines()[-1]})" if outcome.error else "")

    def closing(self, attempt: Attempt, outcome: Outcome) -> tuple[Outcome, dict[str, Any]]:
        """The outcome as recorded: with its prediction, provenance and where it ran; columns of
        the plan the toolkit chose, as a manual spec fills them."""
        job = attempt.item.job
        outcome = self.pricing.with_trials(job, outcome, attempt.candidates)
        outcome.metrics = {**attempt.prediction, **outcome.metrics, "codesign_version": self.version}
        if attempt.handle is not None:
            outcome.metrics["jobs_beside"] = attempt.beside
        if attempt.log is not None and attempt.log.exists():
            outcome.metrics["log_path"] = str(attempt.log)
        if "profile_id" in outcome.metrics:
            priced = self.pricing.priced_by.get(outcome.metrics["profile_id"])
            self.keep_profile(priced or self.pricing.book.for_job(job))
        chosen = plan_columns(Plan.from_dict(outcome.chosen_plan), job.cluster.num_devices_per_host) \
            if outcome.chosen_plan else {}
        return outcome, chosen

    def learn(self, attempt: Attempt, outcome: Outcome) -> None:
        """The cost model learns from the recorded attempt; a failure to learn is logged and the sweep goes on."""
        try:
            if self.pricing.learn(attempt.item.job, outcome, f"{Path(self.store.path).resolve()}#{attempt.attempt_id}"):
                self.refits.added(attempt.item.job.platform)
        except Exception:
            log.warning("attempt %d: the cost model could not learn from it:\n%s", attempt.attempt_id,
                        traceback.format_exc())

    def keep_profile(self, profile: DeviceProfile) -> None:
        """The DB keeps a copy of every profile that priced one of its attempts."""
        pid = profile_id(profile)
        if pid not in self.kept_profiles:
            self.store.keep_profile(pid, profile.to_dict())
            self.kept_profiles.add(pid)

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
    kind = {"device_kind": job.cluster.device}
    if ready.candidates:
        plan = ready.candidates[0].plan
        return Outcome(SIMULATED, metrics=kind, plan=plan.describe(), chosen_plan=plan.to_dict(), duration=0.0)
    return Outcome(SIMULATED, metrics=kind, plan=make_plan(job).describe(), duration=0.0)


def run_sweep(planned: list[PlannedJob], store: Store, executor: Executor, retry_failed: bool,
              manual_timeout: float, max_concurrent: int | None = 1,
              pricing: Pricing | None = None, logs: Path | None = None, stop: StopFlag | None = None) -> SweepSummary:
    reaped = store.reap_stale()
    if reaped:
        log.warning("marked %d attempt(s) of stopped runs as interrupted", reaped)
    return Sweep(planned, store, executor, retry_failed, manual_timeout, max_concurrent, pricing, logs, stop).run()
