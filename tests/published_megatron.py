"""Published Megatron-LM training runs the cost model is held to (tests/test_transformer.py,
docs/transformers.md): GPT on DGX A100 80GB hosts (8 GPUs, 8 x 200 Gb/s HDR InfiniBand),
sequence 2048, vocabulary 51,200, mixed precision, full activation recomputation.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv 2104.04473), Table 1: layers, hidden, heads, tensor (t) and pipeline
(p) sizes, GPUs, global batch and achieved TFLOP/s per GPU by the paper's equation 3. Data
parallelism is GPUs / (t p). The table does not give micro-batch sizes; the check prices each row
at the micro-batch size the cost model predicts best, as the authors tuned theirs. None of
these rows was used to fit anything.
"""

from __future__ import annotations

from dataclasses import dataclass

SC21 = "arXiv 2104.04473 Table 1"


@dataclass(frozen=True)
class MegatronRun:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved per GPU, as published
    source: str = SC21

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


SC21_TABLE_1 = (
    MegatronRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
