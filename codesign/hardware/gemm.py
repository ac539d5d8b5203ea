"""How long a GEMM takes on a GPU: from its measured table by shape, else from its data sheet.

A table (hardware.tables) times bf16 GEMMs on a grid of (m, n, k). Between grid points the time
is interpolated linearly in log m, log n, log k and log seconds; past the grid's largest m, n or
k it grows with the FLOPs (compute-bound), below its smallest it stays at the floor (launch- or
latency-bound). fp32 matmuls run as TF32, at the data sheet's TF32-to-bf16 ratio of the bf16
time. Vectorised: m, n and k may be arrays (the co-design ranking prices many shapes at once).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from codesign.hardware.datasheets import GEMM_EFFICIENCY, data_sheet, peak
from codesign.hardware.tables import GemmGrid, table

DATA_SHEET = "data sheet"


def gemm_seconds(kind: str, precision: str, m: Any, n: Any, k: Any) -> tuple[Any, str]:
    """Seconds of one (m x k) @ (k x n) GEMM on a device kind, and the source of the figure."""
    sheet = data_sheet(kind)
    tables = table(kind)
    if tables is None or tables.gemm is None or sheet is None:
        if sheet is None:
            raise KeyError(f"no data sheet and no table for device kind {kind!r}")
        flops = 2.0 * np.asarray(m, float) * n * k
        return flops / (GEMM_EFFICIENCY * peak(sheet, precision)), DATA_SHEET
    seconds = _interpolator(kind)(m, n, k)
    if precision != "bf16":
        seconds = seconds * sheet.bf16 / peak(sheet, precision)
    return seconds, f"{tables.source} gemm" + ("" if precision == "bf16" else " (bf16 at the TF32 ratio)")


@functools.lru_cache(maxsize=2**16)
def gemm_times(kind: str, precision: str, shapes: tuple[tuple[float, float, float], ...]) -> tuple[float, ...]:
    """gemm_seconds of each (m, n, k), in one lookup: a plan prices the same calls' shapes many times."""
    seconds, _ = gemm_seconds(kind, precision, *np.array(shapes, float).T)
    return tuple(np.atleast_1d(seconds).tolist())


@functools.cache
def _interpolator(kind: str):
    grid = table(kind).gemm
    axes = [np.log(a.astype(float)) for a in (grid.m, grid.n, grid.k)]
    log_seconds = np.log(_filled(grid))

    def seconds(m: Any, n: Any, k: Any) -> Any:
        shape = np.broadcast(m, n, k).shape
        x = [np.log(np.maximum(np.broadcast_to(np.asarray(v, float), shape).ravel(), 1.0)) for v in (m, n, k)]
        corners, beyond = [], 0.0
        for axis, values in zip(axes, x):
            inside = np.clip(values, axis[0], axis[-1])
            beyond = beyond + (values - inside).clip(min=0.0)  # past the grid: time grows with the FLOPs
            hi = np.clip(np.searchsorted(axis, inside), 1, len(axis) - 1)
            weight = (inside - axis[hi - 1]) / (axis[hi] - axis[hi - 1])
            corners.append((hi, weight))
        (mi, mw), (ni, nw), (ki, kw) = corners
        log_time = 0.0
        for dm, dn, dk in np.ndindex(2, 2, 2):
            w = (mw if dm else 1 - mw) * (nw if dn else 1 - nw) * (kw if dk else 1 - kw)
            log_time = log_time + w * log_seconds[mi - 1 + dm, ni - 1 + dn, ki - 1 + dk]
        result = np.exp(log_time + beyond).reshape(shape)
        return float(result) if result.ndim == 0 else result

    return seconds


def _filled(grid: GemmGrid) -> np.ndarray:
    """The grid's seconds with its holes (shapes the collector skipped: the largest m with the
    largest n or k, and the largest weights) filled from the nearest timed shape of the same
    (n, k), else of a smaller weight, grown with the FLOPs."""
    seconds = grid.seconds.copy()
    m, n, k = (a.astype(float) for a in (grid.m, grid.n, grid.k))
    empty = []
    for j, i in np.ndindex(seconds.shape[1:]):
        column = seconds[:, j, i]
        timed = np.flatnonzero(~np.isnan(column))
        if not len(timed):
            empty.append((j, i))
            continue
        last = timed[-1]
        column[last + 1:] = column[last] * m[last + 1:] / m[last]
        holes = np.isnan(column)
        column[holes] = np.interp(m[holes], m[timed], column[timed])
    for j, i in empty:
        near = max(((b, a) for b in range(j + 1) for a in range(i + 1) if (b, a) not in empty),
                   key=lambda ba: n[ba[0]] * k[ba[1]])
        seconds[:, j, i] = seconds[:, near[0], near[1]] * (n[j] * k[i]) / (n[near[0]] * k[near[1]])
    return seconds
