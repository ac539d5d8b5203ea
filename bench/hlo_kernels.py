"""Where a compiled step's memory traffic goes, read from its optimized HLO: one row per kernel
(each instruction of the entry computation that launches work), its bytes read and written, by
kind (kernel_table.classify, so the table lines up with a trace's).

A roofline's other half, for machines without the device: `bench_step.py --target h100` compiles
the step for an H100 it only describes, and this table says what the GPU's kernels would move.
Bytes are the kernel's operands and outputs, except that an operand a fused computation only
slices (through converts, bitcasts and reshapes) counts as the slices it reads: the flat
parameter vector is read a slice at a time. Kernels inside while loops are not expanded (a
micro-batch scan counts once). An estimate of traffic, not of time: matmuls are bound by their
FLOPs, small kernels by their launch.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import kernel_table

BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
NOT_KERNELS = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all", "partition-id",
               "replica-id"}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY )?%?(\S+) \(.*?\) -> .*? \{\n(.*?)^\}", re.MULTILINE | re.DOTALL)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*?)\)(.*)$")
_VIEWS = re.compile(r" (convert|bitcast|reshape)\(")
_SLICES = re.compile(r" (slice|dynamic-slice)\(")


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: str
    read: int  # bytes
    written: int
    op_name: str  # the JAX operation it came from (its metadata), for finding it in the model

    @property
    def moved(self) -> int:
        return self.read + self.written


def array_bytes(shape: str) -> int:
    """Bytes of every array in a shape string (a tuple's elements summed)."""
    return sum(_elements(dims) * BYTES[dtype] for dtype, dims in _ARRAY.findall(shape))


def _elements(dims: str) -> int:
    count = 1
    for dim in filter(None, dims.split(",")):
        count *= int(dim)
    return count


def computations(hlo: str) -> tuple[list[str], dict[str, list[str]]]:
    """The entry computation's lines and every other computation's, by name."""
    entry, others = [], {}
    for match in _COMPUTATION.finditer(hlo):
        lines = match.group(3).splitlines()
        if match.group(1):
            entry = lines
        else:
            others[match.group(2)] = lines
    return entry, others


def _users(body: list[str], name: str) -> list[str]:
    used = re.compile(r"[(,] ?%" + re.escape(name) + r"[,)]")
    return [line for line in body if used.search(line.split(" = ", 1)[-1])]


def _sliced_elements(body: list[str], name: str, depth: int = 0) -> int | None:
    """Elements the computation reads of value `name` if it only slices it (through views), else None."""
    users = _users(body, name)
    if not users or depth > 8:
        return None
    total = 0
    for line in users:
        target, rest = line.split(" = ", 1)
        if _SLICES.search(line):
            total += sum(_elements(dims) for _, dims in _ARRAY.findall(rest.split(" ", 1)[0]))
            continue
        inner = _sliced_elements(body, target.strip().removeprefix("ROOT ").lstrip("%"), depth + 1) \
            if _VIEWS.search(line) else None
        if inner is None:
            return None
        total += inner
    return total


def _operand_bytes(body: list[str], index: int, shape: str) -> int:
    parameter = re.compile(rf"%(\S+) = \S+ parameter\({index}\)")
    name = next((m.group(1) for line in body if (m := parameter.search(line))), None)
    sliced = _sliced_elements(body, name) if name else None
    arrays = _ARRAY.findall(shape)
    return array_bytes(shape) if sliced is None or len(arrays) != 1 else sliced * BYTES[arrays[0][0]]


def entry_kernels(hlo: str) -> list[Kernel]:
    """The kernels of an optimized HLO module's entry computation, in program order."""
    entry, others = computations(hlo)
    shapes: dict[str, str] = {}
    kernels = []
    for line in entry:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, op, operands, attributes = match.groups()
        shapes[name] = shape
        if op in NOT_KERNELS:
            continue
        called = re.search(r"calls=%?([\w.\-]+)", attributes)
        body = others.get(called.group(1), []) if called else []
        names = [o.strip().lstrip("%") for o in re.sub(r"/\*.*?\*/", "", operands).split(",") if o.strip()]
        read = sum(_operand_bytes(body, i, shapes.get(o, "")) for i, o in enumerate(names))
        op_name = re.search(r'op_name="([^"]+)"', attributes)
        kernels.append(Kernel(name, kernel_table.classify(name if op == "fusion" else f"{name} {op}"), read,
                              array_bytes(shape), op_name.group(1) if op_name else ""))
    return kernels


def format_traffic(kernels: list[Kernel], title: str, bandwidth: float, top: int = 12) -> str:
    """Kernels and bytes moved by kind, each at `bandwidth` B/s, then the `top` kernels by bytes."""
    by_kind: dict[str, list[Kernel]] = defaultdict(list)
    for kernel in kernels:
        by_kind[kernel.kind].append(kernel)
    total = sum(k.moved for k in kernels)
    lines = [(f"# HLO traffic, {title}: {len(kernels)} kernels move {total / 1e9:.3f} GB "
              f"({total / bandwidth * 1e3:.2f} ms at {bandwidth:.3g} B/s)"),
             f"{'kind':>16} {'kernels':>8} {'GB':>8} {'ms':>7} {'share':>6}"]
    for kind, group in sorted(by_kind.items(), key=lambda item: -sum(k.moved for k in item[1])):
        moved = sum(k.moved for k in group)
        lines.append(f"{kind:>16} {len(group):>8} {moved / 1e9:>8.3f} {moved / bandwidth * 1e3:>7.3f} "
                     f"{moved / max(total, 1):>6.1%}")
    lines.append(f"{'MB read':>9} {'written':>8}  kernel (op_name)")
    for kernel in sorted(kernels, key=lambda k: -k.moved)[:top]:
        lines.append(f"{kernel.read / 1e6:>9.1f} {kernel.written / 1e6:>8.1f}  {kernel.name} ({kernel.op_name[-80:]})")
    return "\n".join(lines)
