"""Published Megatron-LM training runs the cost model is held to (tests/test_transformer.py,
docs/transformers.md): GPT-3-style models (4h MLP, vocabulary 51,200, sequence 2048) in mixed
precision (bf16). None of these rows was used to fit anything.

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21 (arXiv 2104.04473), Table 1: DGX A100 80GB hosts (8 GPUs, 8 x 200 Gb/s HDR
  InfiniBand), full activation recomputation; layers, hidden, heads, tensor (t) and pipeline (p)
  sizes, GPUs, global batch and achieved TFLOP/s per GPU by the paper's equation 3. The table
  does not give micro-batch sizes; the check prices each row at the micro-batch size the cost
  model predicts best, as the authors tuned theirs.
- NVIDIA's DGX Cloud benchmark of NeMo Megatron (Megatron-Core) GPT-3 175B, BF16 table
  (github.com/NVIDIA/dgxc-benchmarking, nemo_megatron/README_175b.md at 8f5cbb3, NeMo 24.12):
  DGX H100 hosts (8 GPUs, 8 x 400 Gb/s NDR), t 4, p 8, micro-batch 1, no recomputation,
  interleaved schedule (12 virtual stages), sequence parallelism; the training step's seconds,
  as TFLOP/s per GPU by its FLOPs (three passes: `megatron_flops_per_sample(recompute=False)`).
"""

from __future__ import annotations

from dataclasses import dataclass

SC21 = "arXiv 2104.04473 Table 1"
DGXC = "NVIDIA dgxc-benchmarking nemo_megatron/README_175b.md (8f5cbb3), BF16"


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
    tflops: float  # achieved per GPU, as published (or from its published step time)
    source: str = SC21
    device: str = "A100"
    transport: str = "HDRx8"
    recompute: bool = True
    micro_batch_size: int | None = None  # None: not published

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

DGXC_175B_FLOPS = 2.20e15  # per sequence, as the source rounds it
DGXC_175B_STEPS = ((128, 256, 8.309), (256, 512, 8.408), (512, 1024, 8.42), (1024, 2048, 8.453),
                   (2048, 4096, 8.49))  # (GPUs, global batch, published seconds per step)
H100_GPT3_175B = tuple(
    MegatronRun(175.0, 96, 12288, 96, 4, 8, gpus, batch, DGXC_175B_FLOPS * batch / seconds / gpus / 1e12,
                DGXC, "H100", "NDRx8", False, 1)
    for gpus, batch, seconds in DGXC_175B_STEPS)
PUBLISHED = SC21_TABLE_1 + H100_GPT3_175B
