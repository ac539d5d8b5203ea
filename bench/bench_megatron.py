"""Price Megatron-LM's published GPT runs (SC'21 Table 1 on simulated DGX A100 clusters, NVIDIA's
NeMo Megatron GPT-3 175B on simulated DGX H100 clusters) and print each as TFLOP/s per GPU by
its source's formula, beside the published figure; with --auto, Auto search's plan for the rows
of at most --auto-max billion parameters, beside it.

    .venv/bin/python bench/bench_megatron.py [--auto] [--auto-max 40] [--groups 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codesign.config.types import AUTO_SEARCH, ClusterSpec, Job, ParallelSpec, TrainingSpec, TransformerSpec  # noqa: E402
from codesign.cost.model import Estimate, estimate  # noqa: E402
from codesign.cost.plan import make_plan  # noqa: E402
from codesign.cost.workload import Workload  # noqa: E402
from codesign.hardware.profiles import ProfileBook  # noqa: E402
from codesign.planner.auto import choose_plan  # noqa: E402
from codesign.transformer import counts  # noqa: E402
from tests.published_megatron import PUBLISHED, MegatronRun  # noqa: E402

MICRO_BATCH_SIZES = (1, 2, 4, 8)
SEQ_LEN, HOST_GPUS = 2048, 8


@dataclass(frozen=True)
class Priced:
    run: MegatronRun
    micro_batch_size: int
    estimate: Estimate

    @property
    def tflops(self) -> float:
        """Per GPU, by the source's FLOPs per iteration (SC'21's equation 3; three passes without recomputation)."""
        flops = counts.megatron_flops_per_sample(model(self.run), self.run.recompute) * self.run.batch
        return flops / self.estimate.seconds / self.run.gpus / 1e12

    @property
    def error(self) -> float:
        return self.tflops / self.run.tflops - 1


def model(run: MegatronRun) -> TransformerSpec:
    return TransformerSpec(run.layers, run.hidden, run.heads, SEQ_LEN)


def job(run: MegatronRun, parallel: ParallelSpec, micro_batches: int) -> Job:
    cluster = ClusterSpec(run.gpus // HOST_GPUS, HOST_GPUS, run.transport, "sim", run.device)
    training = TrainingSpec(0, 5, precision="bf16", global_batch_size=run.batch)
    return Job(model(run), cluster, training, parallel, micro_batches, "sim")


def published_plan(run: MegatronRun, micro_batch_size: int, book: ProfileBook) -> Priced | None:
    """The row's (p, d, t), with recomputation where it had it, one layer per group, at this micro-batch size."""
    micro = run.batch // (run.dp * micro_batch_size)
    if micro < 1 or run.batch % (run.dp * micro_batch_size):
        return None
    parallel = ParallelSpec("published", (micro,), run.layers, run.recompute, (run.pp, run.dp, run.tp))
    j = job(run, parallel, micro)
    return Priced(run, micro_batch_size, estimate(Workload.of(j, book.for_job(j)), make_plan(j)))


def best_published(run: MegatronRun, book: ProfileBook) -> Priced:
    """The published plan at its micro-batch size where published (whether or not the memory model
    fits it), else at the size the cost model predicts fastest, of those that fit."""
    if run.micro_batch_size is not None:
        return published_plan(run, run.micro_batch_size, book)
    priced = [p for p in (published_plan(run, b, book) for b in MICRO_BATCH_SIZES) if p and p.estimate.fits]
    return min(priced, key=lambda p: p.estimate.seconds)


def auto_plan(run: MegatronRun, book: ProfileBook, groups: int, micro_batch_size: int) -> Estimate:
    """Auto search's best plan for the row's cluster and batch, at the published plan's micro-batches."""
    micro = run.batch // (run.dp * micro_batch_size)
    j = job(run, ParallelSpec(AUTO_SEARCH, (micro,), groups), micro)
    return choose_plan(j, book).best().estimate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--auto", action="store_true", help="also run Auto search on the smaller rows")
    parser.add_argument("--auto-max", type=float, default=40.0, help="billions of parameters, at most")
    parser.add_argument("--groups", type=int, default=8, help="Auto search's layer groups")
    args = parser.parse_args()
    book = ProfileBook()
    errors = []
    print("device\tparams_b\tgpus\tt\tp\td\tbatch\tmicro_batch\tseconds\tbubble\tpeak_gb\ttflops\tpublished\terror"
          "\tauto_seconds\tauto_plan\tauto_vs_published")
    for run in PUBLISHED:
        best = best_published(run, book)
        errors.append(abs(best.error))
        auto = ""
        if args.auto and run.billions <= args.auto_max:
            start = time.perf_counter()
            found = auto_plan(run, book, args.groups, best.micro_batch_size)
            auto = (f"{found.seconds:.3f}\t({time.perf_counter() - start:.1f} s)\t"
                    f"{found.seconds / best.estimate.seconds - 1:+.1%}")
        print(f"{run.device}\t{run.billions}\t{run.gpus}\t{run.tp}\t{run.pp}\t{run.dp}\t{run.batch}\t{best.micro_batch_size}\t"
              f"{best.estimate.seconds:.3f}\t{best.estimate.bubble:.3f}\t{best.estimate.peak_bytes / 1e9:.0f}\t"
              f"{best.tflops:.0f}\t{run.tflops:.0f}\t{best.error:+.1%}\t{auto}", flush=True)
    within = sum(e <= 0.25 for e in errors) / len(errors)
    print(f"within 25%: {within:.0%}; median |error| {statistics.median(errors):.1%}", file=sys.stderr)


if __name__ == "__main__":
    main()
