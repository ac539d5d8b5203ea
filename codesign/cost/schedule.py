"""Pipeline schedules as pure code: the order each stage runs its micro-batches in.

The pipeline engine dispatches exactly these orders; the cost model simulates them.
"""

from __future__ import annotations

import collections
import functools

FORWARD, BACKWARD = "F", "B"
Op = tuple[str, int]  # (FORWARD | BACKWARD, micro-batch)


def stage_order(schedule: str, pp: int, stage: int, micro: int) -> list[Op]:
    """One stage's own order: GPipe runs all forwards then all backwards; 1F1B warms up with
    pp - stage - 1 forwards, then alternates one forward and one backward, then drains."""
    if schedule == "GPipe":
        return [(FORWARD, m) for m in range(micro)] + [(BACKWARD, m) for m in range(micro)]
    warmup = min(pp - stage - 1, micro)
    order = [(FORWARD, m) for m in range(warmup)]
    for m in range(micro - warmup):
        order += [(FORWARD, warmup + m), (BACKWARD, m)]
    return order + [(BACKWARD, m) for m in range(micro - warmup, micro)]


@functools.cache  # the cost model simulates it for every pipeline plan it prices
def dispatch_order(schedule: str, pp: int, micro: int) -> tuple[tuple[int, str, int], ...]:
    """All stages' orders interleaved, clock tick by clock tick, into one dependency-respecting order."""
    queues = [collections.deque(stage_order(schedule, pp, s, micro)) for s in range(pp)]
    done: set[tuple[int, str, int]] = set()
    order = []
    while any(queues):
        ready = [(s, *q[0]) for s, q in enumerate(queues) if q and _ready(s, *q[0], pp, done)]
        if not ready:
            raise RuntimeError(f"{schedule} schedule deadlocks at {[list(q)[:1] for q in queues]}")
        for s, kind, m in ready:
            queues[s].popleft()
            done.add((s, kind, m))
            order.append((s, kind, m))
    return tuple(order)


def _ready(s: int, kind: str, m: int, pp: int, done: set) -> bool:
    if kind == FORWARD:
        return s == 0 or (s - 1, FORWARD, m) in done
    return (s, FORWARD, m) in done and (s == pp - 1 or (s + 1, BACKWARD, m) in done)


def max_in_flight(schedule: str, pp: int, stage: int, micro: int) -> int:
    """Most micro-batches whose residuals the stage holds at once (forwarded, not yet backwarded)."""
    held = peak = 0
    for kind, _ in stage_order(schedule, pp, stage, micro):
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak
