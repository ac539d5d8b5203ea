"""Programs compiled side by side (XLA compiles outside the GIL), and how busy the cores were."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

log = logging.getLogger("codesign.profile")


def compile_side_by_side(compiles: Iterable[tuple[Any, Callable[[], Any]]]) -> dict[Any, Any]:
    """Each program compiled (`compiles`: (name, a lowered program's compile, options bound)), several
    at once: XLA compiles (and autotunes) outside the GIL, and on a GPU compiling is most of a
    profile's time.
    Each is compiled as soon as `compiles` yields it: the next is traced while it compiles."""
    start, cpu, spans = time.perf_counter(), cpu_seconds(), {}

    def compile_one(name: Any, compile_program: Callable[[], Any]) -> Any:
        begin = time.perf_counter()
        done = compile_program()
        spans[name] = (begin - start, time.perf_counter() - begin)
        return done

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(compile_one, name, program) for name, program in compiles}
        done = {name: future.result() for name, future in futures.items()}
    if done:
        wall = time.perf_counter() - start
        log.info("  (%d programs compiled side by side in %.1f s, %s; %s)", len(done), wall,
                 cores_busy(cpu_seconds() - cpu, wall), compile_spans(spans))
    return done


def cpu_seconds() -> float:
    """CPU seconds of this process's threads and its finished children (a compiler run as a subprocess)."""
    return sum(os.times()[:4])


def cores_busy(cpu: float, wall: float) -> str:
    """How busy the cores were over `wall`: at the core count, the compiles wait on the CPU; near one,
    on something else (a lock, or autotuning's timed runs on the one GPU)."""
    return f"{cpu:.0f} CPU-s: {cpu / max(wall, 1e-9):.1f} of {os.cpu_count()} cores busy"


def compile_spans(spans: dict[Any, tuple[float, float]]) -> str:
    """Each program's start and compile seconds, in the order they finished: programs that end one
    after another at even steps, each waiting from the start, say that their compiles were serialised."""
    ordered = sorted(spans.items(), key=lambda item: sum(item[1]))
    return "in the order done, start+seconds: " + ", ".join(
        f"{' '.join(name)} {begin:.1f}+{seconds:.1f}" for name, (begin, seconds) in ordered)
