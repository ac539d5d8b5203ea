"""Measured kernel tables for GPUs codesign does not have: NVIDIA's aiconfigurator-core.

The package ships, per GPU, GEMM latencies by (m, n, k, dtype), timed under CUDA graphs, and
nccl-tests collectives by message size on 2, 4 and 8 GPUs of one host. Its files are read where
the package is installed, at first use (kept as read in the user's cache directory, so the next
process skips Parquet), and none of its data is copied here. Units, checked
against its collector and rows: GEMM and NCCL `latency` in milliseconds; NCCL `message_size`
in elements of `nccl_dtype` (half at N matches int8 at 2N for small messages). Where the package
is absent (Python 3.14 and later: its wheels stop at 3.13) or lacks a GPU, `table()` says None
and the device prices from its data sheet.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import platformdirs

log = logging.getLogger(__name__)

DISTRIBUTION = "aiconfigurator-core"
# codesign's device kinds -> aiconfigurator-core's system, its collected GEMM set (the package's
# default version where it has one) and its collected NCCL version.
SYSTEMS = {"H100": ("h100_sxm", "trtllm/1.3.0rc20", "2.29.2"),
           "H200": ("h200_sxm", "trtllm/1.3.0rc20", "2.29.2"),
           "A100": ("a100_sxm", "sglang/0.5.10", "2.27.3")}
COLLECTIVES = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
               "all-to-all": "alltoall"}
HALF = 2  # bytes per element of the `half` rows: the ones for bf16 traffic (int8 all-reduces run slower)


@dataclass(frozen=True)
class GemmGrid:
    """One GPU's bf16 GEMM seconds on the table's (m, n, k) grid; NaN where it has no row."""

    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    seconds: np.ndarray  # [m, n, k]


@dataclass(frozen=True)
class NcclCurves:
    """One GPU's collectives: (collective, GPUs) -> (bytes ascending, seconds)."""

    curves: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({n for _, n in self.curves}))


@dataclass(frozen=True)
class Tables:
    gemm: GemmGrid | None
    nccl: NcclCurves | None
    source: str  # e.g. "aiconfigurator-core 0.12.0 h100_sxm": what every figure from it names


def system_of(kind: str) -> str | None:
    """The table key of a device kind such as "NVIDIA H100 80GB HBM3"."""
    return next((k for k in SYSTEMS if k.lower() in kind.lower()), None)


@functools.cache
def data_root() -> Path | None:
    try:
        import aiconfigurator_core  # its top level loads no Python dependency: only where its data lies
    except ImportError:
        return None
    root = Path(aiconfigurator_core.__file__).parent / "systems" / "data"
    return root if root.is_dir() else None


@functools.cache
def table(kind: str) -> Tables | None:
    """The measured tables of a device kind, read once per process; None where there are none."""
    key = system_of(kind)
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    if key is None:
        return None
    system, gemm_set, nccl_version = SYSTEMS[key]
    cached = Path(platformdirs.user_cache_dir("codesign")) / "tables" / (
        f"{system}-{version}-{gemm_set.replace('/', '-')}-{nccl_version}.npz")
    try:
        gemm, nccl = _load(cached)
    except (OSError, KeyError, ValueError):
        root = data_root()
        if root is None:
            return None
        base = root / system
        try:
            gemm = _gemm(base / "gemm" / gemm_set / "gemm_perf.parquet")
            nccl = _nccl(base / "comm" / "nccl" / nccl_version / "nccl_perf.parquet")
        except (OSError, ImportError, KeyError, ValueError) as error:
            log.warning("cannot read %s's tables for %s (%s); pricing it from its data sheet", DISTRIBUTION, kind, error)
            return None
        _save(cached, gemm, nccl)
    return Tables(gemm, nccl, f"{DISTRIBUTION} {version} {system}")


def _save(path: Path, gemm: GemmGrid, nccl: NcclCurves) -> None:
    """The tables as read, in the user's cache: the next process skips Parquet (a plan in a second)."""
    arrays = {"m": gemm.m, "n": gemm.n, "k": gemm.k, "seconds": gemm.seconds}
    for (kind, n), (size, seconds) in nccl.curves.items():
        arrays[f"nccl|{kind}|{n}|size"], arrays[f"nccl|{kind}|{n}|seconds"] = size, seconds
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.npz")
        np.savez(partial, **arrays)
        partial.replace(path)
    except OSError as error:  # an unwritable cache only costs the next process the read
        log.info("cannot keep the tables in %s: %s", path.parent, error)


def _load(path: Path) -> tuple[GemmGrid, NcclCurves]:
    with np.load(path) as data:
        curves = {}
        for name in data.files:
            if name.startswith("nccl|") and name.endswith("|size"):
                _, kind, n, _ = name.split("|")
                curves[kind, int(n)] = (data[name], data[f"nccl|{kind}|{n}|seconds"])
        return GemmGrid(data["m"], data["n"], data["k"], data["seconds"]), NcclCurves(curves)


def _columns(path: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq  # only where a table is read

    data = pq.read_table(path, columns=list(names))
    return {name: data.column(name).to_numpy() for name in names}


def _gemm(path: Path) -> GemmGrid:
    rows = _columns(path, ("gemm_dtype", "m", "n", "k", "latency"))
    bf16 = rows["gemm_dtype"] == "bfloat16"
    m, n, k = (rows[c][bf16].astype(np.int64) for c in "mnk")
    axes = [np.unique(a) for a in (m, n, k)]
    seconds = np.full([len(a) for a in axes], np.nan)
    seconds[tuple(np.searchsorted(a, v) for a, v in zip(axes, (m, n, k)))] = rows["latency"][bf16] * 1e-3
    return GemmGrid(*axes, seconds)


def _nccl(path: Path) -> NcclCurves:
    rows = _columns(path, ("op_name", "nccl_dtype", "num_gpus", "message_size", "latency"))
    half = rows["nccl_dtype"] == "half"
    curves = {}
    for name, op in COLLECTIVES.items():
        for n in np.unique(rows["num_gpus"][half]):
            pick = half & (rows["op_name"] == op) & (rows["num_gpus"] == n)
            size, ms = rows["message_size"][pick] * HALF, rows["latency"][pick]
            sizes = np.unique(size)  # some files hold each row twice: their mean
            mean = np.array([ms[size == s].mean() for s in sizes])
            if len(sizes):
                curves[name, int(n)] = (sizes.astype(float), mean * 1e-3)
    return NcclCurves(curves)
