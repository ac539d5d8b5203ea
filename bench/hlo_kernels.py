"""Where a compiled step's memory traffic and matmul work go, read from its optimized HLO: one row
per kernel (each instruction of the entry computation that launches work), its bytes read and
written and its matmuls' FLOPs, by kind (kernel_table.classify, so the table lines up with a
trace's), and a roofline: each kernel at the HBM's pace or at its matmuls' rate, whichever is slower.

A roofline's other half, for machines without the device: `bench_step.py --target h100` compiles
the step for an H100 it only describes, and this table says what the GPU's kernels would move.
Bytes are the kernel's operands and outputs, except that an operand a fused computation only
slices (through converts, bitcasts and reshapes) counts as the slices it reads: the flat
parameter vector is read a slice at a time. Kernels inside while loops are not expanded (a
micro-batch scan counts once). The roofline is a floor, not a forecast: on an H100 the seed
step's kernels took 1.3-1.45x its roofline (bench/RESULTS.md); it ranks variants of a step.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import kernel_table

from codesign.hardware.datasheets import DATA_SHEETS

BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
NOT_KERNELS = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all", "partition-id",
               "replica-id"}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY )?%?(\S+) \(.*?\) -> .*? \{\n(.*?)^\}", re.MULTILINE | re.DOTALL)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*?)\)(.*)$")
_VIEWS = re.compile(r" (convert|bitcast|reshape)\(")
_SLICES = re.compile(r" (slice|dynamic-slice)\(")


# A GPU's roofline: HBM B/s (the data sheet's, profiles.DATA_SHEETS) and matmul FLOP/s by operand
# dtype: what `codesign profile` measured, not the data sheet's (H100s: bf16 6.97e14-7.55e14, fp32 as
# TF32 3.29e14-4.06e14; one H200, the same chip: 7.08e14-7.11e14 and 3.91e14-4.14e14; bench/RESULTS.md).
HOPPER_MATMUL = {"bf16": 7.0e14, "f32": 3.7e14}
GPU_ROOFLINES = {kind: (DATA_SHEETS[kind].bandwidth, HOPPER_MATMUL) for kind in ("H100", "H200")}


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: str
    read: int  # bytes
    written: int
    op_name: str  # the JAX operation it came from (its metadata), for finding it in the model
    flops: int = 0  # of its matmuls: 2 x output elements x the contracted size
    operand_dtype: str = ""  # its matmuls' left operand's, which sets their rate

    @property
    def moved(self) -> int:
        return self.read + self.written

    def roofline(self, bandwidth: float, rates: dict[str, float]) -> float:
        """Seconds at the device's pace: its bytes at `bandwidth` or its matmuls at their rate."""
        return max(self.moved / bandwidth, self.flops / rates.get(self.operand_dtype, math.inf))


def array_bytes(shape: str) -> int:
    """Bytes of every array in a shape string (a tuple's elements summed)."""
    return sum(_elements(dims) * BYTES[dtype] for dtype, dims in _ARRAY.findall(shape))


def _elements(dims: str) -> int:
    return math.prod(_ints(dims))


def _ints(dims: str) -> list[int]:
    return [int(d) for d in dims.split(",") if d]


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


def _shapes(lines: list[str]) -> dict[str, str]:
    return {m.group(1): m.group(2) for line in lines if (m := _INSTRUCTION.match(line))}


def _dims(shape: str) -> list[int]:
    arrays = _ARRAY.findall(shape)
    return _ints(arrays[0][1]) if arrays else []


def _matmul(lhs_shape: str, out_shape: str, contracting: str) -> tuple[int, str]:
    dims = _dims(lhs_shape)
    contracted = math.prod(dims[int(i)] for i in filter(None, contracting.replace('"', "").split(",")))
    return 2 * math.prod(_dims(out_shape)) * contracted, (_ARRAY.findall(lhs_shape) or [("", "")])[0][0]


def _fused_matmuls(body: list[str]) -> tuple[int, str]:
    """FLOPs of the dots in a fused computation (a GEMM fusion's), and their left operand's dtype."""
    shapes, flops, dtype = _shapes(body), 0, ""
    for line in body:
        match = _INSTRUCTION.match(line)
        if match and match.group(3) == "dot":
            lhs = match.group(4).split(",")[0].strip().lstrip("%")
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", match.group(5))
            more, dtype = _matmul(shapes.get(lhs, ""), match.group(2), contracting.group(1) if contracting else "")
            flops += more
    return flops, dtype


def _library_matmul(shape: str, operands: list[str], shapes: dict[str, str], attributes: str) -> tuple[int, str]:
    """FLOPs of a cuBLAS call (its dot dimensions in its backend config), and its left operand's dtype."""
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attributes)
    if "cublas" not in attributes or not contracting or not operands:
        return 0, ""
    out = _ARRAY.search(shape)
    return _matmul(shapes.get(operands[0], ""), out.group(0) if out else "", contracting.group(1))


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
        flops, dtype = _fused_matmuls(body) if body else _library_matmul(shape, names, shapes, attributes)
        kernels.append(Kernel(name, kernel_table.classify(name if op == "fusion" else f"{name} {op}"), read,
                              array_bytes(shape), op_name.group(1) if op_name else "", flops, dtype))
    return kernels


def rooflines(kernels: list[Kernel], bandwidth: float, rates: dict[str, float]) -> dict[str, float]:
    """Each kernel's roofline seconds a call, by the name a GPU trace gives its kernel (the fusion's, '.'
    as '_'). XLA launches identical fusions as one kernel of the same shapes, so their rooflines agree."""
    return {kernel.name.replace(".", "_"): kernel.roofline(bandwidth, rates) for kernel in kernels}


def gpu_rooflines(hlo: str, kind: str | None) -> dict[str, float] | None:
    """rooflines of the HLO's kernels on a GPU of `kind` (a GPU_ROOFLINES key); None for another kind."""
    known = GPU_ROOFLINES.get(kind or "")
    return rooflines(entry_kernels(hlo), *known) if known else None


def format_traffic(kernels: list[Kernel], title: str, bandwidth: float, rates: dict[str, float],
                   top: int = 12) -> str:
    """Kernels, bytes moved, matmul FLOPs and roofline time by kind, then the `top` kernels by
    roofline time (each at `bandwidth` B/s or its matmuls at `rates`, FLOP/s by operand dtype)."""
    by_kind: dict[str, list[Kernel]] = defaultdict(list)
    for kernel in kernels:
        by_kind[kernel.kind].append(kernel)
    moved, flops = sum(k.moved for k in kernels), sum(k.flops for k in kernels)
    total = sum(k.roofline(bandwidth, rates) for k in kernels)
    pace = ", ".join(f"{dtype} {rate:.3g}" for dtype, rate in rates.items())
    lines = [(f"# HLO traffic, {title}: {len(kernels)} kernels move {moved / 1e9:.3f} GB ({moved / bandwidth * 1e3:.2f}"
              f" ms at {bandwidth:.3g} B/s) and do {flops / 1e12:.3f} TFLOP of matmuls; roofline {total * 1e3:.2f} ms"
              f" (each kernel at that pace or its matmuls' FLOP/s: {pace})"),
             f"{'kind':>16} {'kernels':>8} {'GB':>8} {'TFLOP':>7} {'ms':>7} {'share':>6}"]
    for kind, group in sorted(by_kind.items(), key=lambda item: -sum(k.roofline(bandwidth, rates) for k in item[1])):
        seconds = sum(k.roofline(bandwidth, rates) for k in group)
        lines.append(f"{kind:>16} {len(group):>8} {sum(k.moved for k in group) / 1e9:>8.3f} "
                     f"{sum(k.flops for k in group) / 1e12:>7.3f} {seconds * 1e3:>7.3f} {seconds / max(total, 1e-12):>6.1%}")
    lines.append(f"{'us':>7} {'MB read':>9} {'written':>8} {'GFLOP':>7}  kernel (op_name)")
    for kernel in sorted(kernels, key=lambda k: -k.roofline(bandwidth, rates))[:top]:
        lines.append(f"{kernel.roofline(bandwidth, rates) * 1e6:>7.1f} {kernel.read / 1e6:>9.1f} "
                     f"{kernel.written / 1e6:>8.1f} {kernel.flops / 1e9:>7.1f}  {kernel.name} ({kernel.op_name[-70:]})")
    return "\n".join(lines)
