"""Probe steps: real training steps of the probe jobs, compiled in this process or in a child
that sees as many virtual devices as the step uses (idle virtual devices slow the busy ones),
timed in rounds as a sweep times a job."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding

from codesign.config.types import Job, ModelSpec
from codesign.engine.job import build_training, train_steps
from codesign.engine.programs import StartingValues, batch_shapes
from codesign.cost.calibration import probe_jobs
from codesign.cost.plan import make_plan
from codesign.run.device_env import device_env
from codesign.zhen import network

log = logging.getLogger("codesign.profile")
PROBE_SECONDS = 0.9  # each probe step's timed steps in all (ten short steps moved much between runs)
PROBE_ROUNDS = 3  # ... taken in rounds over all the probes of one process


class LocalProbes:
    """Probe steps compiled in this process, timed a round at a time, as a job times its steps."""

    def __init__(self, jobs: list[Job], repeats: int, pool: ThreadPoolExecutor | None = None):
        self.trainings = list((pool.map if pool else map)(warmed_training, jobs))
        self.steps = max(1, 2 * repeats // PROBE_ROUNDS)

    def round(self) -> list[list[float]]:
        """Each step's wall times over PROBE_SECONDS / PROBE_ROUNDS."""
        return [train_steps(training, self.steps, PROBE_SECONDS / PROBE_ROUNDS)[1] for training in self.trainings]


def warmed_training(job: Job) -> Any:
    """The job's training step compiled and run once (the first run's allocations, not timed)."""
    training = build_training(job, make_plan(job), PROBE_VALUES)
    train_steps(training, 1)
    return training


def probe_params(model: ModelSpec, layers: tuple[int, ...], seed: int) -> dict:
    """A stage's parameters drawn on the host, at their shapes and dtypes: the model's
    initialisation program (its random draws unroll into ~500 fusions) would be compiled per probe."""
    return drawn(jax.eval_shape(lambda: network.init_params(model, jax.random.key(0), layers=layers)), seed)


def probe_batch(job: Job, micro_batches: int, x_sharding: NamedSharding, y_sharding: NamedSharding
                ) -> tuple[jax.Array, jax.Array]:
    """synthetic_batch's shapes and placement, drawn on the host (its two programs compile per probe)."""
    x, y = drawn(batch_shapes(job, micro_batches), job.training.seed)
    return jax.device_put(x, x_sharding), jax.device_put(y, y_sharding)


PROBE_VALUES = StartingValues(probe_params, probe_batch)  # a probe step is timed, never compared


def drawn(shapes: Any, seed: int) -> Any:
    """Values for a tree of abstract (possibly boxed) arrays, drawn on the host: nothing compiled.
    NumPy arrays (placed on a sharded layout, a device array is sliced by a compiled program):
    place them before timing calls on them, or each call copies them in."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(a.dtype), nn.meta.unbox(shapes))


class ChildProbes:
    """own_probe_jobs(devices) compiled in a child process that sees that many CPU devices (as a
    sweep's job on them does), timed a round at a time when asked; between rounds it waits."""

    def __init__(self, devices: int, repeats: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "codesign.engine.probe", "--steps", str(repeats)],
                                     env=device_env(os.environ, "cpu", devices), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.devices = devices

    def ready(self) -> None:
        seen = self._reply()["devices"]
        if seen != self.devices:
            raise RuntimeError(f"the probe child saw {seen} devices, not {self.devices}")

    def round(self) -> list[list[float]]:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._reply()["times"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the probe child on {self.devices} device(s) exited with {self.proc.wait()}")
        return json.loads(line)


def probe_step_times(jobs: list[Job], local: LocalProbes, children: list[ChildProbes]) -> list[float]:
    """The probe steps' median seconds, every group compiled (`local`: the steps on all devices;
    each child's: those on the n it sees, as a sweep's job on n devices does). Every group is
    timed in PROBE_ROUNDS rounds, one group at a time, so that all of them see the same mix of
    the machine's drifting speed (probes timed after the others ran slower, and the fit read
    that as contention)."""
    groups: dict[int, LocalProbes | ChildProbes] = {len(jax.devices()): local}
    groups.update((child.devices, child) for child in children)
    pooled: dict[int, list[list[float]]] = {}
    for _ in range(PROBE_ROUNDS):
        for n, group in groups.items():
            times = group.round()
            pooled[n] = [a + b for a, b in zip(pooled.get(n, [[] for _ in times]), times)]
    medians = {n: iter(float(np.median(t)) for t in times) for n, times in pooled.items()}
    found = [next(medians[job.cluster.num_devices]) for job in jobs]
    for job, seconds in zip(jobs, found):
        log.info("  probe step on %d device(s), (pp, dp, op) = %s, %d micro-batch(es) of %d: %.3g s",
                 job.cluster.num_devices, job.parallel.pp_dp_op, job.num_micro_batches,
                 job.global_batch // job.num_micro_batches, seconds)
    return found


def own_probe_jobs(devices: int) -> list[Job]:
    return [j for j in probe_jobs(devices) if j.cluster.num_devices == devices]


def serve_probes(repeats: int) -> None:
    """The child's side of ChildProbes: compile, say how many devices it sees, then time a round
    for each line read until stdin closes."""
    probes = LocalProbes(own_probe_jobs(len(jax.devices())), repeats)
    print(json.dumps({"devices": len(jax.devices())}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"times": probes.round()}), flush=True)
