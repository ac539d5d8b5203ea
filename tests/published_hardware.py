"""Published measurements the hardware model is held to (tests/test_hardware.py, docs/hardware.md).

None comes from the data that prices them (aiconfigurator-core's tables). Each row cites its
source: a public nccl-tests output, XLA's own H100 tables, a vendor's page. Collective rows are
nccl-tests' out-of-place time for its `size` (the bytes as nccl-tests counts them) unless noted;
GEMM rows are TFLOP/s. The collective launch (hardware.collectives.LAUNCH) was fitted to the one
row marked FITTED; every other row is a check.
"""

from __future__ import annotations

from dataclasses import dataclass

TOGETHER = "togethercomputer/together-nccl-tests@0492bede benchmarks/H100/results/20260305_220043/{}_nvls.out"
XXRJUN_1 = ("xxrjun/nccl-tests-cluster@455de4f8 benchmarks/example-cluster01/nccl-benchmark-results/single-node/"
            "runs/20260128-145017/without-debug/logs/nccl_N1_G8_cnode3-002.log")
XXRJUN_10 = ("xxrjun/nccl-tests-cluster@455de4f8 benchmarks/example-cluster01/nccl-benchmark-results/multi-node/"
             "runs/20260129-180219/without-debug/logs/nccl_N10_G8.log")
AZURE_H100 = "Azure/AI-benchmarking-guide@8fd0c6e1 Azure_Results/ND_H100_v5_results.md"
AZURE_A100 = "Azure/AI-benchmarking-guide@8fd0c6e1 Azure_Results/ND_A100_v4_results.md"
XLA_COLLECTIVES = "tensorflow/tensorflow@18c005b3 third_party/xla/xla/service/gpu/model/collective_interpolator_data.h (sm_90)"
XLA_MATMULS = "ROCm/xla@63ce2981 xla/service/gpu/model/matmul_interpolator_data.h (sm_90, b:1)"
SUPERBENCH = "microsoft/superbenchmark@700d6501 tests/data/nccl_{}.log"
AWS = "awslabs/awsome-distributed-ai@95b939cd micro-benchmarks/nccl-tests/README.md"
COREWEAVE = "coreweave/nccl-tests@fb4787cc README.md"
STAS = "stas00/ml-engineering@744d01e1 compute/accelerator/README.md"
FITTED = "fitted"


@dataclass(frozen=True)
class Collective:
    id: str
    device: str
    kind: str
    hosts: int
    per_host: int
    transport: str
    nbytes: int
    seconds: float
    source: str
    note: str = ""

    @property
    def band(self) -> tuple[float, float]:
        """(lowest, highest) predicted / published that the row accepts."""
        if self.nbytes < 64 * MiB:  # the small-message band: under 1 MiB, and up to 64 MiB alike
            return 0.5, 2.0
        return (0.85, 1.15) if self.hosts == 1 else (0.75, 1.25)


@dataclass(frozen=True)
class Gemm:
    id: str
    device: str
    m: int
    n: int
    k: int
    tflops: float
    source: str
    note: str = ""

    band = (0.7, 1.3)  # predicted / published seconds

    @property
    def seconds(self) -> float:
        return 2 * self.m * self.n * self.k / (self.tflops * 1e12)


GiB, MiB = 2**30, 2**20
COLLECTIVES = [
    # one host of 8 H100 SXM; MPI, one GPU per rank, NCCL 2.29.2
    Collective("A10", "H100", "all-reduce", 1, 8, "NVLink", 64 * MiB, 313.66e-6, XXRJUN_1 + " line 21"),
    Collective("A11", "H100", "all-reduce", 1, 8, "NVLink", GiB, 4000.82e-6, XXRJUN_1 + " line 25"),
    Collective("A12", "H100", "all-reduce", 1, 8, "NVLink", 8 * GiB, 31226.8e-6, XXRJUN_1 + " line 28"),
    Collective("A13", "H100", "all-gather", 1, 8, "NVLink", 8 * GiB, 20928.4e-6, XXRJUN_1 + " line 63"),
    Collective("A14", "H100", "reduce-scatter", 1, 8, "NVLink", 8 * GiB, 20799.7e-6, XXRJUN_1 + " line 98"),
    Collective("A15", "H100", "all-to-all", 1, 8, "NVLink", 64 * MiB, 215.51e-6, XXRJUN_1 + " line 126"),
    Collective("A16", "H100", "all-to-all", 1, 8, "NVLink", GiB, 2830.0e-6, XXRJUN_1 + " line 130"),
    Collective("A17", "H100", "all-to-all", 1, 8, "NVLink", 8 * GiB, 21708.4e-6, XXRJUN_1 + " line 133"),
    # Azure ND H100 v5: in-place bus bandwidth by rounded size label ("1G", "8G")
    Collective("A20", "H100", "all-reduce", 1, 8, "NVLink", GiB, 2 * 7 / 8 * GiB / 466.35e9, AZURE_H100 + " line 103",
               "busbw 466.35 GB/s"),
    Collective("A21", "H100", "all-reduce", 1, 8, "NVLink", 8 * GiB, 2 * 7 / 8 * 8 * GiB / 478.87e9,
               AZURE_H100 + " line 106", "busbw 478.87 GB/s"),
    # one process driving 8 GPUs (nccl-tests -g 8): a launch floor under every small size
    Collective("A01", "H100", "all-reduce", 1, 8, "NVLink", 8192, 35.29e-6, TOGETHER.format("all_reduce") + " line 28"),
    Collective("A02", "H100", "all-reduce", 1, 8, "NVLink", MiB, 42.19e-6, TOGETHER.format("all_reduce") + " line 35"),
    Collective("A05", "H100", "all-gather", 1, 8, "NVLink", 8192, 35.21e-6, TOGETHER.format("all_gather") + " line 28"),
    Collective("A06", "H100", "all-gather", 1, 8, "NVLink", MiB, 42.00e-6, TOGETHER.format("all_gather") + " line 35"),
    Collective("A08", "H100", "reduce-scatter", 1, 8, "NVLink", MiB, 43.67e-6,
               TOGETHER.format("reduce_scatter") + " line 35"),
    # XLA's own H100 table: an HLO collective's time (bytes / network_throughput_bytes_per_sec)
    Collective("A22", "H100", "all-reduce", 1, 8, "NVLink", 8192, 8192 / 253968253, XLA_COLLECTIVES, FITTED),
    Collective("A23", "H100", "all-gather", 1, 8, "NVLink", 8192, 8192 / 162539682, XLA_COLLECTIVES),
    Collective("A24", "H100", "reduce-scatter", 1, 8, "NVLink", 8192, 8192 / 277657266, XLA_COLLECTIVES),
    Collective("A25", "H100", "all-to-all", 1, 8, "NVLink", 8192, 8192 / 251226692, XLA_COLLECTIVES),
    Collective("A30", "H100", "all-reduce", 1, 8, "NVLink", 2 * GiB, 2 * GiB / 229968237690, XLA_COLLECTIVES),
    # one host of 8 A100-SXM4-40GB (nccl-tests -g 8)
    Collective("A34", "A100", "all-reduce", 1, 8, "NVLink", 8192, 35.91e-6, SUPERBENCH.format("allreduce") + " line 30"),
    Collective("A35", "A100", "all-reduce", 1, 8, "NVLink", MiB, 74.78e-6, SUPERBENCH.format("allreduce") + " line 37"),
    Collective("A36", "A100", "all-reduce", 1, 8, "NVLink", 64 * MiB, 584.5e-6, SUPERBENCH.format("allreduce") + " line 43"),
    Collective("A37", "A100", "all-reduce", 1, 8, "NVLink", GiB, 8159.5e-6, SUPERBENCH.format("allreduce") + " line 47"),
    Collective("A38", "A100", "all-reduce", 1, 8, "NVLink", 8 * GiB, 63896e-6, SUPERBENCH.format("allreduce") + " line 50"),
    Collective("A41", "A100", "all-gather", 1, 8, "NVLink", 64 * MiB, 379.7e-6, SUPERBENCH.format("allgather") + " line 43"),
    Collective("A42", "A100", "all-gather", 1, 8, "NVLink", 8 * GiB, 33646e-6, SUPERBENCH.format("allgather") + " line 50"),
    Collective("A45", "A100", "reduce-scatter", 1, 8, "NVLink", 8 * GiB, 32464e-6,
               SUPERBENCH.format("reducescatter") + " line 50"),
    Collective("A47", "A100", "all-to-all", 1, 8, "NVLink", MiB, 87.42e-6, SUPERBENCH.format("alltoall") + " line 36"),
    Collective("A48", "A100", "all-to-all", 1, 8, "NVLink", 64 * MiB, 396.8e-6, SUPERBENCH.format("alltoall") + " line 42"),
    Collective("A49", "A100", "all-to-all", 1, 8, "NVLink", 8 * GiB, 33508e-6, SUPERBENCH.format("alltoall") + " line 49"),
    # across hosts: 2 AWS p5.48xlarge (8 H100, 32 x 100 Gb/s EFA each)
    Collective("B01", "H100", "all-reduce", 2, 8, "EFAx32", 8192, 81.44e-6, AWS + " line 205"),
    Collective("B02", "H100", "all-reduce", 2, 8, "EFAx32", MiB, 123.2e-6, AWS + " line 212"),
    Collective("B03", "H100", "all-reduce", 2, 8, "EFAx32", 64 * MiB, 601.5e-6, AWS + " line 218"),
    Collective("B04", "H100", "all-reduce", 2, 8, "EFAx32", GiB, 4607.6e-6, AWS + " line 222"),
    Collective("B05", "H100", "all-reduce", 2, 8, "EFAx32", 8 * GiB, 33605e-6, AWS + " line 225"),
    Collective("B07", "H100", "all-reduce", 2, 8, "EFAx32", 2 * GiB, 9197.5e-6, AWS + " line 279", "another run (EKS)"),
    # 10 hosts of 8 H100 on InfiniBand (about 50 GB/s per GPU by its all-to-all): NDRx8
    Collective("B08", "H100", "all-reduce", 10, 8, "NDRx8", GiB, 6149.19e-6, XXRJUN_10 + " line 97"),
    Collective("B09", "H100", "all-reduce", 10, 8, "NDRx8", 8 * GiB, 53632.3e-6, XXRJUN_10 + " line 100"),
    Collective("B10", "H100", "all-gather", 10, 8, "NDRx8", 8589934080, 26724.4e-6, XXRJUN_10 + " line 207"),
    Collective("B11", "H100", "reduce-scatter", 10, 8, "NDRx8", 8589934080, 26865.0e-6, XXRJUN_10 + " line 314"),
    Collective("B12", "H100", "all-to-all", 10, 8, "NDRx8", 8589934080, 167847e-6, XXRJUN_10 + " line 421"),
    # CoreWeave HGX H100, NDR with SHARP: 96 ranks by its busbw / algbw (its README names a 64-GPU job)
    Collective("B13", "H100", "all-reduce", 12, 8, "NDRx8", 512 * MiB, 2984.6e-6, COREWEAVE + " line 106"),
    Collective("B14", "H100", "all-reduce", 12, 8, "NDRx8", 8 * GiB, 43980e-6, COREWEAVE + " line 110"),
    # 2 AWS p4de.24xlarge (8 A100, 4 x 100 Gb/s EFA each): EFAx4
    Collective("B26", "A100", "all-reduce", 2, 8, "EFAx4", 8192, 175.9e-6, AWS + " line 170"),
    Collective("B27", "A100", "all-reduce", 2, 8, "EFAx4", MiB, 309.4e-6, AWS + " line 177"),
    Collective("B28", "A100", "all-reduce", 2, 8, "EFAx4", 64 * MiB, 2644.6e-6, AWS + " line 183"),
    Collective("B29", "A100", "all-reduce", 2, 8, "EFAx4", 2 * GiB, 51406e-6, AWS + " line 188"),
]
GEMMS = [
    Gemm("C01", "H100", 1024, 1024, 1024, 252.76, XLA_MATMULS),
    Gemm("C02", "H100", 2048, 2048, 2048, 641.04, XLA_MATMULS),
    Gemm("C03", "H100", 4096, 4096, 4096, 780.19, XLA_MATMULS),
    Gemm("C04", "H100", 4096, 1024, 4096, 751.66, XLA_MATMULS),
    Gemm("C05", "H100", 1024, 4096, 4096, 751.92, XLA_MATMULS),
    Gemm("C06", "H100", 4096, 256, 4096, 398.86, XLA_MATMULS),
    Gemm("C07", "H100", 2048, 2048, 4096, 752.18, XLA_MATMULS),
    Gemm("C08", "H100", 1024, 1024, 4096, 472.60, XLA_MATMULS),
    Gemm("C09", "H100", 4096, 4096, 2048, 735.57, XLA_MATMULS),
    Gemm("C10", "H100", 2048, 2048, 13312, 794.5, STAS + " line 354", "the best shape of a sweep"),
    Gemm("C11", "A100", 1024, 1024, 1024, 119.4, AZURE_A100 + " line 23", "fp16, the same peak as bf16"),
    Gemm("C12", "A100", 2048, 2048, 2048, 221.8, AZURE_A100 + " line 24", "fp16"),
    Gemm("C13", "A100", 4096, 4096, 4096, 228.0, AZURE_A100 + " line 25", "fp16"),
    Gemm("C14", "A100", 8192, 8192, 8192, 253.7, AZURE_A100 + " line 26", "fp16"),
    Gemm("C15", "A100", 16384, 16384, 16384, 256.5, AZURE_A100 + " line 27", "fp16"),
    Gemm("C16", "A100", 1024, 2145, 1024, 132.8, AZURE_A100 + " line 29", "fp16"),
    Gemm("C17", "A100", 6144, 12288, 12288, 250.8, AZURE_A100 + " line 30", "fp16"),
    Gemm("C18", "A100", 802816, 192, 768, 157.8, AZURE_A100 + " line 31", "fp16"),
    Gemm("C19", "A100", 1024, 10240, 5120, 271.2, STAS + " line 351", "the best shape of a sweep"),
]


def predicted(row: Collective | Gemm) -> float:
    """The row's seconds as the cost model prices them: the same functions it calls."""
    from codesign.config.types import ClusterSpec
    from codesign.hardware.device import Devices
    from codesign.hardware.gemm import gemm_seconds
    from codesign.hardware.links import cluster_links
    from codesign.hardware.profiles import BUILTIN

    if isinstance(row, Gemm):
        return gemm_seconds(row.device, "bf16", row.m, row.n, row.k)[0]
    cluster = ClusterSpec(row.hosts, row.per_host, row.transport, "sim", row.device)
    profile = BUILTIN[row.device]
    hw = Devices.of(profile, cluster, *cluster_links(profile, cluster))
    return hw.collective(row.kind, row.nbytes, row.hosts, row.per_host)


def markdown() -> str:
    """The table of docs/hardware.md: every row, predicted against published."""
    lines = ["| id | device | what | published | predicted | predicted / published | band | source |",
             "|---|---|---|---|---|---|---|---|"]
    for row in COLLECTIVES + GEMMS:
        ratio = predicted(row) / row.seconds
        low, high = row.band
        inside = "yes" if low <= ratio <= high else "**no**"
        if isinstance(row, Gemm):
            what = f"GEMM {row.m}x{row.n}x{row.k} bf16"
            published, model = f"{row.tflops:.0f} TFLOP/s", f"{row.tflops / ratio:.0f} TFLOP/s"
        else:
            what = f"{row.kind} {_size(row.nbytes)}, {row.hosts} x {row.per_host} {row.transport}"
            published, model = f"{row.seconds * 1e6:,.1f} us", f"{row.seconds * ratio * 1e6:,.1f} us"
        note = f" ({row.note})" if row.note else ""
        lines.append(f"| {row.id} | {row.device} | {what} | {published} | {model} | {ratio:.2f} | "
                     f"{low}-{high}: {inside} | {row.source}{note} |")
    return "\n".join(lines) + "\n"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"
