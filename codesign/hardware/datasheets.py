"""GPUs as their vendors list them: what prices a GPU where nothing measured it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSheet:
    """A GPU as its vendor lists it: memory, dense peak FLOP/s (bf16, and TF32 for fp32), HBM B/s,
    board power (TDP) and the lowest power limit it accepts, and its idle draw as measured."""

    memory_gib: float
    bf16: float
    tf32: float
    bandwidth: float
    tdp: float
    lowest_limit: float
    idle: float


# TDP: NVIDIA's H100/H200 SXM data sheets (up to 700 W) and A100 SXM4 (400 W). Lowest limits:
# nvidia-smi's power-limit range (H100/H200 SXM 200 W, as power-capping studies of both sweep
# it, 200-700 W; A100 SXM4 100 W). Idle: an H200 SXM measured 80 W idle (alice GPU energy
# benchmark, 2026), taken for the H100 too; an A100 SXM4 idles near 50 W.
DATA_SHEETS = {"H100": DataSheet(80, 989e12, 495e12, 3.35e12, 700, 200, 80),
               "H200": DataSheet(141, 989e12, 495e12, 4.8e12, 700, 200, 80),
               "A100": DataSheet(80, 312e12, 156e12, 2.04e12, 400, 100, 50)}
# Where no table prices a GEMM: this share of the data sheet's peak, as the seed's flat model
# (fitted to the seed model's step on an H200 and an H100, bench/RESULTS.md).
GEMM_EFFICIENCY = 0.5
HBM_EFFICIENCY = 0.8  # of the data sheet's HBM bandwidth, what streaming kernels reach


def data_sheet(kind: str) -> DataSheet | None:
    """The data sheet of a device kind such as "NVIDIA H100 80GB HBM3" (None: none listed)."""
    return next((DATA_SHEETS[k] for k in DATA_SHEETS if k.lower() in kind.lower()), None)


def peak(sheet: DataSheet, precision: str) -> float:
    """Dense matmul FLOP/s in a precision: fp32 matmuls run as TF32 (JAX's default on GPUs)."""
    return sheet.bf16 if precision == "bf16" else sheet.tf32
