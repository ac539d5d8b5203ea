"""The pipeline's timeline: an event simulation of exactly the orders the pipeline engine
dispatches (cost.schedule), over stage costs from cost.model."""

from __future__ import annotations

from typing import Any, Sequence

from codesign.cost.formulas import StageCost, most
from codesign.cost.plan import Plan
from codesign.cost.schedule import BACKWARD, FORWARD, dispatch_order
from codesign.cost.workload import Submesh, Workload
from codesign import families


def launches(kind: str, stage: int, pp: int) -> int:
    """Host launches of one pipeline call: the call, and the device_put of what it hands on."""
    moves = (kind == FORWARD and stage < pp - 1) or (kind == BACKWARD and stage > 0)
    return 2 if moves else 1


def transfer_time(w: Workload, plan: Plan, index: int) -> float:
    """Seconds to move one micro-batch's carry from stage index to index + 1 (or a cotangent back):
    each source device sends its batch shard; across hosts when the two stages share none."""
    src, dst = plan.stages[index], plan.stages[index + 1]
    nbytes = w.micro_batch * w.activation_bytes * families.counts(w.model).carry_width(w.model, src.layers[-1])
    shards = Submesh.of(src, plan.batch_axis).batch_shards
    return w.transfer(nbytes / shards, src.device_ids, dst.device_ids)


def simulate(w: Workload, plan: Plan, stages: list[StageCost],
             hops: Sequence[Any] | None = None) -> tuple[list[float], float, float, float]:
    """Event simulation of the pipeline engine: the host dispatches the schedule's dispatch_order
    (each call, and each device_put between stages, costs the stage's call_cost), each stage runs its
    calls in that order, a forward waits for the previous stage's activation, a backward for the
    next stage's cotangent; then one update per stage. Returns each stage's end time, when the
    last backward ended, the seconds spent in transfers and the host's seconds of launches. Stage
    times (and `hops`, the transfers' where given) may be arrays: it only adds and takes maxima."""
    pp, micro = len(plan.stages), plan.num_micro_batches
    dispatch = [w.hw.call_cost(len(stage.device_ids)) for stage in plan.stages]
    hops = [transfer_time(w, plan, s) for s in range(pp - 1)] if hops is None else hops
    host, free, done = 0.0, [0.0] * pp, {}
    for s, kind, m in dispatch_order(plan.schedule, pp, micro):
        host += dispatch[s] * launches(kind, s, pp)
        if kind == FORWARD:
            ready = done[s - 1, FORWARD, m] + hops[s - 1] if s > 0 else 0.0
            seconds = stages[s].forward
        else:
            ready = done[s, FORWARD, m]
            if s < pp - 1:
                ready = most((ready, done[s + 1, BACKWARD, m] + hops[s]))
            seconds = stages[s].backward
        done[s, kind, m] = free[s] = most((host, free[s], ready)) + seconds
    ends = []
    for s in range(pp):
        host += dispatch[s]
        ends.append(most((host, free[s])) + stages[s].update)
    return ends, most(free), 2 * micro * sum(hops), host
