"""Run jobs on a Ray cluster: one actor per host of a job, each running the job body.

A job asks for a placement group with one bundle per host (STRICT_SPREAD when it spans
hosts: one process per node, as on real multi-host clusters). Each bundle gets an actor
that starts the same job-body subprocess the LocalExecutor runs, so JAX's platform is set
before it imports, a kill takes the whole process group down, and a dead actor takes its job
along; for a multi-host job the
processes meet through `jax.distributed` with the coordinator on host 0. The orchestrator
drives everything from here and alone writes the DB; the actors only run and report.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from codesign.errors import UserError
from codesign.outcome import FAILED, INTERRUPTED, SUCCEEDED, TIMEOUT, Outcome
from codesign.cost.plan import Plan
from codesign.run.local import JobProcess, job_env
from codesign.config.types import Job

log = logging.getLogger(__name__)
STOP_GRACE = 10.0  # seconds the actors get to kill their job bodies before they are killed
PROBE_TIMEOUT = 10.0  # seconds to reach a Ray head before giving up
LOG_LIMIT = 1 << 20  # characters of a host's output shipped back for the job's log


def connect(address: str) -> None:
    """Join the Ray cluster at address, or start one on this machine for the run ("local")."""
    local = address == "local"
    if not local and address != "auto":
        _probe(address)
    try:
        ray.init(address=None if local else address, logging_level=logging.WARNING,
                 log_to_driver=False, **({"include_dashboard": False} if local else {}))
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise UserError(f"cannot connect to the Ray cluster at {address}: {err}") from None


def _probe(address: str) -> None:
    """Fail fast on a wrong HOST:PORT: ray.init retries an unreachable head for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"Ray address {address!r}: expected HOST:PORT, 'auto' or 'local'")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT).close()
    except OSError as err:
        raise UserError(f"cannot connect to the Ray cluster at {address}: {err}") from None


def disconnect() -> None:
    """Leave the cluster; a local one started by connect() stops with it."""
    ray.shutdown()


class HostShare:
    """One host's share of a job: the job body as a child process group on this node."""

    def __init__(self, job_module: str, cache_dir: str | None):
        self.job_module, self.cache_dir = job_module, cache_dir
        self.process: JobProcess | None = None

    def coordinator_address(self) -> str:
        """A free port on this node's IP, for jax.distributed's coordinator (host 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    def run(self, job: Job, process_id: int, num_processes: int, coordinator: str | None,
            plans: Sequence[Plan] = ()) -> Outcome:
        extra = {} if coordinator is None else {
            "CODESIGN_COORDINATOR": coordinator, "CODESIGN_NUM_PROCESSES": str(num_processes),
            "CODESIGN_PROCESS_ID": str(process_id)}
        env = job_env(job, self.cache_dir, job.cluster.num_devices_per_host, extra)
        self.process = JobProcess(job, env, self.job_module, plans)
        code = self.process.proc.wait()
        output = self.process.output_tail(LOG_LIMIT)
        outcome = self.process.result(code)
        if job.platform == "gpu":
            outcome.metrics["gpu_ids"] = [int(g) for g in ray.get_gpu_ids()]
        return outcome, output

    def stop(self) -> str:
        """Called from a second thread while run() waits: the job's group dies, run() returns;
        returns the job's output so far (a timed-out job's log)."""
        if self.process is None:
            return ""
        output = self.process.output_tail(LOG_LIMIT)  # before the kill lets run() remove the job's files
        self.process.kill()
        return output


_HostShare = ray.remote(max_concurrency=2)(HostShare)  # run() and stop() at the same time


@dataclass(eq=False)
class RayRun:
    """A job on the cluster: waiting for its placement group, then running on its actors."""

    job: Job
    timeout: float
    group: PlacementGroup
    ready: Any  # ObjectRef that resolves when the group's bundles are reserved
    submitted: float
    plans: Sequence[Plan] = ()  # chosen by the toolkit, best predicted first; none: the manual spec's
    log: Path | None = None  # where each host's output is written when it comes back
    started: float | None = None
    actors: list = field(default_factory=list)
    shares: dict = field(default_factory=dict)  # ObjectRef of a host's run() -> host index, until it returns
    nodes: dict[int, str] = field(default_factory=dict)  # host index -> Ray node id

    @property
    def pending(self) -> bool:
        return self.started is None

    @property
    def deadline(self) -> float:
        return float("inf") if self.started is None else self.started + self.timeout

    def waiting_on(self) -> list:
        return [self.ready] if self.pending else list(self.shares)


class RayExecutor:
    """Each job as a placement group of per-host actors on the connected Ray cluster."""

    def __init__(self, cache_dir: str | None = None, job_module: str = "codesign.engine.job"):
        self.cache_dir = cache_dir
        self.job_module = job_module

    def can_start(self, job: Job, running: Sequence[RayRun]) -> bool:
        """Start jobs until one has to wait for resources; Ray queues no more behind it."""
        return not any(run.pending for run in running)

    def start(self, job: Job, timeout: float, plans: Sequence[Plan] = (), log: Path | None = None,
              running: Sequence[RayRun] = (), then: Job | None = None,
              power_limits: Mapping[int, float] | None = None) -> RayRun:
        """power_limits are not applied on a Ray cluster yet: its jobs run at the limits they find."""
        bundle = {"CPU": 1, **({"GPU": job.cluster.num_devices_per_host} if job.platform == "gpu" else {})}
        strategy = "STRICT_SPREAD" if job.cluster.num_hosts > 1 else "PACK"
        group = placement_group([bundle] * job.cluster.num_hosts, strategy=strategy)
        return RayRun(job, timeout, group, group.ready(), time.monotonic(), tuple(plans), log)

    def wait(self, running: Sequence[RayRun], seconds: float) -> list[tuple[RayRun, Outcome]]:
        """Block until some host reports or a deadline passes (at most seconds); returns ended jobs."""
        now = time.monotonic()
        until = min([now + seconds] + [run.deadline for run in running])
        refs = [ref for run in running for ref in run.waiting_on()]
        if refs:
            ray.wait(refs, num_returns=1, timeout=max(0.0, until - now))
        else:
            time.sleep(max(0.0, until - now))
        idle = all(run.pending for run in running)  # nothing of ours holds resources
        return [(run, outcome) for run in running if (outcome := self._advance(run, idle)) is not None]

    def cancel(self, run: RayRun) -> None:
        self._release(run)

    def close(self) -> None:
        """Nothing outlives a job here: each one's actors go with it."""

    def _advance(self, run: RayRun, idle: bool) -> Outcome | None:
        if run.pending:
            if ray.wait([run.ready], timeout=0)[0]:
                self._launch(run)
            elif idle and time.monotonic() - run.submitted > run.timeout:
                return self._end(run, Outcome(FAILED, error=(
                    f"the Ray cluster did not provide {run.job.cluster.num_hosts} host(s) of "
                    f"{run.group.bundle_specs[0]} within {run.timeout:g} s while no other job ran")))
            return None
        done, _ = ray.wait(list(run.shares), num_returns=len(run.shares), timeout=0)
        for ref in done:
            outcome = self._share_result(run, ref, run.shares.pop(ref))
            if outcome is not None:
                return self._end(run, outcome)
        if time.monotonic() >= run.deadline:
            return self._end(run, Outcome(TIMEOUT, error=f"killed after the {run.timeout:g} s timeout"))
        return None

    def _launch(self, run: RayRun) -> None:
        """Resources are reserved: one actor per bundle, host 0 hosting the coordinator."""
        run.started = time.monotonic()
        hosts = run.job.cluster.num_hosts
        table = ray.util.placement_group_table(run.group)
        run.nodes = {int(i): node for i, node in table["bundles_to_node_id"].items()}
        log.info("job on %d host(s), nodes %s", hosts, [n[:12] for n in run.nodes.values()])
        gpus = run.job.cluster.num_devices_per_host if run.job.platform == "gpu" else 0
        run.actors = [_HostShare.options(
            num_cpus=1, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(run.group, placement_group_bundle_index=i),
        ).remote(self.job_module, self.cache_dir) for i in range(hosts)]
        coordinator = run.actors[0].coordinator_address.remote() if hosts > 1 else None
        run.shares = {actor.run.remote(run.job, i, hosts, coordinator, run.plans): i
                      for i, actor in enumerate(run.actors)}

    def _share_result(self, run: RayRun, ref: Any, host: int) -> Outcome | None:
        """Host 0's outcome ends the job; another host ends it only by failing."""
        try:
            outcome, output = ray.get(ref)
            _write_log(run, host, output)
        except RayActorError as err:
            return _actor_lost(run, host, err)
        except RayError as err:
            return Outcome(FAILED, error=f"host {host} of the job could not run it: {err}")
        if host == 0:
            return outcome
        if outcome.status != SUCCEEDED:
            outcome.error = f"host {host}: {outcome.error}"
            return outcome
        return None

    def _end(self, run: RayRun, outcome: Outcome) -> Outcome:
        self._release(run)
        outcome.duration = time.monotonic() - (run.started or run.submitted)
        return outcome

    def _release(self, run: RayRun) -> None:
        """Kill the job bodies, then their actors, and free the bundles for the next job."""
        stops = {actor.stop.remote(): host for host, actor in enumerate(run.actors) if host in run.shares.values()}
        if stops:
            done, _ = ray.wait(list(stops), num_returns=len(stops), timeout=STOP_GRACE)
            for ref in done:
                with contextlib.suppress(RayError):
                    _write_log(run, stops[ref], ray.get(ref))
        for actor in run.actors:
            ray.kill(actor)
        remove_placement_group(run.group)


def _write_log(run: RayRun, host: int, output: str) -> None:
    """A host's output, appended to the job's log beside the DB (this machine's disk)."""
    if run.log is None or not output:
        return
    with open(run.log, "a") as f:
        f.write(f"## host {host} (node {run.nodes.get(host, '?')[:12]})\n{output}")


def _actor_lost(run: RayRun, host: int, err: RayActorError) -> Outcome:
    """A lost node interrupts the job (a rerun retries it); a dead actor on a live node fails it."""
    node = run.nodes.get(host, "")
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if err.preempted or node not in alive:
        return Outcome(INTERRUPTED, error=f"node {node[:12]} of host {host} was lost: {err}")
    return Outcome(FAILED, error=f"the actor of host {host} died: {err}")
