"""Where a step's device time goes, read from a jax.profiler trace: top kernels, shares by kind,
idle time between kernels and launches per step.

Pure Python over the Chrome-trace JSON that `jax.profiler.trace(DIR)` writes next to its XPlane
(DIR/plugins/profile/<run>/<host>.trace.json.gz), so a trace fetched from a GPU machine can be
read anywhere. Kernels are, in order of preference: the events on a device's CUDA streams
(process "/device:GPU:N", threads "Stream #N(...)"), a device's "XLA Ops" line (TPU), or the
XLA:CPU runtime's thunks (host events carrying an `hlo_op`). Steps are the windows of
`jax.profiler.StepTraceAnnotation(step_name)`. The median step's wall time splits into kernels busy (covered
by at least one kernel), idle between its first and last kernel (launch gaps between small kernels)
and the time before its first and after its last kernel (dispatch and synchronisation); the host's
events in a step before its first kernel are listed by name (what that dispatch time is spent on),
and the host event open when the median step's first kernel starts (on an H200 the whole step ran
as one CUDA graph whose launch held the host 2 ms, the first kernel starting 0.38 ms into it).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# First match wins: collectives before "reduce" (reduce-scatter), matmuls before fusion (gemm_fusion).
KINDS = (
    ("collectives", (r"nccl|all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
                     r"|allreduce|allgather|reducescatter|all_reduce|all_gather|reduce_scatter")),
    ("matmul", r"gemm|cublas|cutlass|nvjet|xmma|cudnn|dot|matmul|convolution|ynn_|xnn_|onednn"),
    ("gather/scatter", r"gather|scatter"),
    ("reduction", r"reduce"),
    ("copy/transpose", r"transpose|copy|memcpy|memset"),
    ("fusion", (r"fusion|loop_|wrapped_|^(add|subtract|multiply|divide|convert|broadcast|concatenate"
                r"|slice|pad|select|exponential|maximum|minimum|negate|compare|bitcast|iota)\b")),
)
OTHER = "other"
# Thread-name prefix of a device's kernel lines -> the source named in the table, preferred first.
DEVICE_LINES = {"Stream": "device streams", "XLA Ops": "device's XLA Ops line"}
HOST = "host thunks (XLA:CPU)"
ROOF_COLUMN = 106  # where a kernel line's roofline columns start, past its longest kind
_PATTERNS = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KINDS)


def classify(name: str) -> str:
    """The kind of a kernel or XLA op, from its name (XLA names fusions after their leading ops)."""
    return next((kind for kind, pattern in _PATTERNS if pattern.search(name)), OTHER)


@dataclass(frozen=True)
class HostAtFirst:
    """When a step's first kernel starts, and the innermost host event open then (us from the step's start)."""

    lead: float
    event: str = ""  # "" where no host event spans it
    event_start: float = 0.0
    event_us: float = 0.0


@dataclass
class KernelTable:
    source: str  # where the kernels were found: one of DEVICE_LINES' values or HOST
    kernels: dict[str, tuple[float, int]]  # name -> (total us, calls) over all steps
    host_before: dict[str, float]  # host event name -> us of it inside a step before its first kernel, summed
    step_splits: list[tuple[float, float, float]]  # per step: (wall, kernels busy, first kernel to last) us:
    # the wall time (or the kernels' span without step annotations), the time covered by at least one kernel
    first_kernel: list[HostAtFirst] = field(default_factory=list)  # per step, where the steps are annotated

    @property
    def steps(self) -> int:
        return len(self.step_splits)

    @property
    def wall_us(self) -> float:
        return sum(wall for wall, _, _ in self.step_splits)

    @property
    def busy_us(self) -> float:
        return sum(busy for _, busy, _ in self.step_splits)

    @property
    def span_us(self) -> float:
        return sum(span for _, _, span in self.step_splits)

    def median_index(self) -> int:
        """The step of median wall time: a traced step now and then waits on the tracer (one of
        five H100 steps 16.4 ms against 11.1-12.8), which a mean would spread."""
        ordered = sorted(range(self.steps), key=lambda i: self.step_splits[i])
        return ordered[(len(ordered) - 1) // 2]

    def median_step(self) -> tuple[float, float, float]:
        return self.step_splits[self.median_index()] if self.step_splits else (0.0, 0.0, 0.0)

    @property
    def device_us(self) -> float:
        return sum(us for us, _ in self.kernels.values())

    def by_kind(self) -> dict[str, tuple[float, int]]:
        """Kind -> (total us, calls), every kind listed, OTHER last."""
        kinds = {kind: [0.0, 0] for kind, _ in KINDS} | {OTHER: [0.0, 0]}
        for name, (us, calls) in self.kernels.items():
            total = kinds[classify(name)]
            total[0] += us
            total[1] += calls
        return {kind: (us, calls) for kind, (us, calls) in kinds.items()}


def load_trace(log_dir: str | Path) -> dict:
    """The newest run's trace JSON under a jax.profiler log directory."""
    found = sorted(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {log_dir}")
    with gzip.open(found[-1], "rt") as f:
        return json.load(f)


def _names(events: list[dict]) -> tuple[dict, dict]:
    """Process names by pid and thread names by (pid, tid), from the trace's metadata events."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return processes, threads


def kernel_events(trace: dict) -> tuple[str, list[dict]]:
    """Where the trace's kernels are and their events: a device's streams, else its XLA Ops line,
    else the XLA:CPU thunks (a GPU trace without CUPTI's device events would fall back to host
    events: the source says so)."""
    events = trace.get("traceEvents", [])
    processes, threads = _names(events)
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    on_device = [e for e in complete if processes.get(e["pid"], "").startswith("/device:")]
    for line, source in DEVICE_LINES.items():
        found = [e for e in on_device if threads.get((e["pid"], e.get("tid")), "").startswith(line)]
        if found:
            return source, found
    return HOST, [e for e in complete if "hlo_op" in e.get("args", {})]


def step_windows(trace: dict, step_name: str) -> list[tuple[float, float]]:
    """(start, end) in us of each StepTraceAnnotation(step_name) in the trace, in time order."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in trace.get("traceEvents", [])
                  if e.get("ph") == "X" and e.get("name") == step_name and "step_num" in e.get("args", {}))


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals: kernels on several streams or threads overlap."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def build_table(trace: dict, step_name: str) -> KernelTable:
    """Aggregate the kernels that start inside the annotated steps (all kernels, as one step,
    where the trace has no such annotation)."""
    source, kernels = kernel_events(trace)
    windows = step_windows(trace, step_name)
    annotated = bool(windows)
    if not windows and kernels:
        windows = [(min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels))]
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    before: dict[str, float] = defaultdict(float)
    splits, at_first = [], []
    host = host_events(trace, step_name)
    for start, end in windows:
        inside = [(e["name"], e["ts"], min(e["ts"] + e["dur"], end)) for e in kernels if start <= e["ts"] < end]
        first = min((ts for _, ts, _ in inside), default=end)
        for e in host:
            overlap = min(e["ts"] + e["dur"], first) - max(e["ts"], start)
            if overlap > 0:
                before[e["name"]] += overlap
        at_first.append(host_at(host, first, start))
        for name, ts, stop in inside:
            totals[name][0] += stop - ts
            totals[name][1] += 1
        span = max((stop for *_, stop in inside), default=0.0) - min((ts for _, ts, _ in inside), default=0.0)
        splits.append((end - start, covered_us([(ts, stop) for _, ts, stop in inside]), span))
    return KernelTable(source, {k: (us, n) for k, (us, n) in totals.items()}, dict(before), splits,
                       at_first if annotated else [])


def host_at(host: list[dict], instant: float, start: float) -> HostAtFirst:
    """The innermost host event open at `instant` (the latest to start; of those, the shortest),
    times from `start`."""
    open_then = [e for e in host if e["ts"] <= instant < e["ts"] + e["dur"]]
    if not open_then:
        return HostAtFirst(instant - start)
    e = max(open_then, key=lambda e: (e["ts"], -e["dur"]))
    return HostAtFirst(instant - start, e["name"], e["ts"] - start, e["dur"])


def host_events(trace: dict, step_name: str) -> list[dict]:
    """The host's complete events (the step annotations and XLA:CPU's thunks aside): what the
    host does in a step before the device starts (the call, argument checks, launches), nested
    events each counted."""
    events = trace.get("traceEvents", [])
    processes, _ = _names(events)
    return [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("name") != step_name
            and not processes.get(e["pid"], "").startswith("/device:") and "hlo_op" not in e.get("args", {})]


def format_table(table: KernelTable, title: str, top: int = 15, rooflines: dict[str, float] | None = None) -> str:
    """The table as printed: per-step totals, shares by kind, then the top kernels by device time.
    With `rooflines` (seconds a call by kernel name, hlo_kernels.rooflines), each kernel found there
    is also given against its roofline: the kernels that lose the most time to it show."""
    steps, device = max(table.steps, 1), table.device_us or 1.0
    wall, busy, span = table.median_step()
    lines = [f"## kernels: {title}: {table.steps} steps traced, kernels from the {table.source}",
             (f"launches per step {sum(n for _, n in table.kernels.values()) / steps:.0f}; the median step: "
              f"wall {wall / 1e3:.3f} ms = kernels busy {busy / 1e3:.3f} ms "
              f"+ idle between kernels {(span - busy) / 1e3:.3f} ms "
              f"+ before the first and after the last kernel {(wall - span) / 1e3:.3f} ms (mean wall "
              f"{table.wall_us / steps / 1e3:.3f} ms); kernel time per step (summed over streams) "
              f"{table.device_us / steps / 1e3:.3f} ms"),
             f"{'kind':<16} {'ms/step':>9} {'share':>7} {'launches/step':>14}"]
    for kind, (us, calls) in table.by_kind().items():
        lines.append(f"{kind:<16} {us / steps / 1e3:>9.3f} {100 * us / device:>6.1f}% {calls / steps:>14.1f}")
    if table.host_before:
        lead = sorted(table.host_before.items(), key=lambda item: -item[1])[:6]
        lines.append("host events before the first kernel, us per step (nested events each counted): "
                     + "; ".join(f"{name[:60]} {us / steps:.0f}" for name, us in lead))
    if table.first_kernel:
        lines.append(_first_kernel_line(table))
    if rooflines is not None:
        lines.append(_roofline_summary(table, rooflines))
    lines.append(f"{'kernel':<60} {'ms/step':>9} {'share':>7} {'calls/step':>11} kind"
                 + (f"{'':<{ROOF_COLUMN - 95}}{'us/call':>10} {'roof us':>8} {'x roof':>7}" if rooflines is not None else ""))
    ranked = sorted(table.kernels.items(), key=lambda item: -item[1][0])[:top]
    for name, (us, calls) in ranked:
        short = name if len(name) <= 60 else name[:57] + "..."
        line = f"{short:<60} {us / steps / 1e3:>9.3f} {100 * us / device:>6.1f}% {calls / steps:>11.1f} {classify(name)}"
        if rooflines is not None and name in rooflines:
            roof = rooflines[name] * 1e6
            line = f"{line:<{ROOF_COLUMN}}{us / calls:>10.1f} {roof:>8.1f} {us / calls / max(roof, 1e-9):>6.2f}x"
        lines.append(line)
    return "\n".join(lines)


def _first_kernel_line(table: KernelTable) -> str:
    """When the median step's device starts and stops against its wall time, and what the host
    was doing as the first kernel started (a graph launch, a compile, a transfer)."""
    wall, _, span = table.median_step()
    at = table.first_kernel[table.median_index()]
    doing = (f", while the host is in {at.event[:60]} (from +{at.event_start:.0f} us, {at.event_us:.0f} us long)"
             if at.event else ", no host event open")
    return (f"the median step's first kernel starts {at.lead:.0f} us in{doing}; "
            f"its last kernel ends {wall - at.lead - span:.0f} us before the step does")


def _roofline_summary(table: KernelTable, rooflines: dict[str, float]) -> str:
    """How much of the kernel time has a roofline, and how far past it those kernels ran."""
    steps = max(table.steps, 1)
    found = {name: (us, calls) for name, (us, calls) in table.kernels.items() if name in rooflines}
    measured = sum(us for us, _ in found.values())
    floor = sum(rooflines[name] * 1e6 * calls for name, (_, calls) in found.items())
    lost = sorted(((us - rooflines[name] * 1e6 * calls) / steps, name) for name, (us, calls) in found.items())[::-1]
    return (f"against the optimized HLO's roofline: {len(found)} of {len(table.kernels)} kernels found by name "
            f"(XLA's fusions; library GEMMs are not), {measured / steps / 1e3:.3f} ms a step against "
            f"{floor / steps / 1e3:.3f} ms ({measured / max(floor, 1e-9):.2f}x); most time past it: "
            + ", ".join(f"{name} {us / 1e3:.3f} ms" for us, name in lost[:4]))


def main(argv: list[str] | None = None) -> int:
    """Print the table of a trace directory fetched from another machine, against the roofline of
    the optimized HLO bench_step wrote beside it when a device kind is given."""
    import argparse

    import hlo_kernels

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("trace", help="a bench_step.py --trace row directory (plugins/profile/..., optimized_hlo.txt)")
    parser.add_argument("--step-name", default="bench_step", help="the StepTraceAnnotation of a step")
    parser.add_argument("--device", choices=sorted(hlo_kernels.GPU_ROOFLINES), help="the GPU the trace was taken on")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    table = build_table(load_trace(args.trace), args.step_name)
    rooflines = hlo_kernels.gpu_rooflines((Path(args.trace) / "optimized_hlo.txt").read_text(),
                                          args.device) if args.device else None
    print(format_table(table, args.trace, args.top, rooflines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
