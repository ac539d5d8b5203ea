"""Frozen specs parsed once from TOML; every later stage reads only these."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

MIXERS = ("DOT", "LINEAR", "ATTENTION", "CONVOLUTION")
TRANSPORTS = ("NVLink", "NDRx8", "HDRx8", "EFAx32", "EFAx4", "TCPx4")  # their figures: hardware.links
PLATFORMS = ("gpu", "cpu", "auto", "sim")
PRECISIONS = ("fp32", "bf16")
SCHEDULES = ("1F1B", "GPipe")
AUTO_SEARCH = "Auto search"
SHARDING_OPTIONS = ("force_batch_dim_to_mesh_dim", "prefer_reduce_scatter")
OBJECTIVES = ("time", "energy", "cost")  # what Auto search minimises (planner.objective)


@dataclass(frozen=True)
class ModelSpec:
    num_features: int
    emb_dim: int
    output_per_emb: int
    num_zhen_layers: int
    tokens: tuple[tuple[str, ...], ...]  # one tuple of mixers per layer

    family: ClassVar[str] = "zhen"  # not a field: ZHEN's job keys and all_configs stay as they were

    @property
    def num_layers(self) -> int:
        return self.num_zhen_layers

    @property
    def is_homogeneous(self) -> bool:
        return len(set(self.tokens)) == 1

    def summary(self) -> str:
        mixers = "/".join("".join(m[0] for m in layer) for layer in self.tokens)
        return (f"F{self.num_features} D{self.emb_dim} O{self.output_per_emb} "
                f"L{self.num_zhen_layers} [{mixers}]")

    def to_toml(self) -> dict[str, Any]:
        """The `[[model]]` table users write: a flat token list when every layer is alike."""
        tokens: list = list(self.tokens[0]) if self.is_homogeneous else [list(t) for t in self.tokens]
        return {"num_features": self.num_features, "emb_dim": self.emb_dim,
                "output_per_emb": self.output_per_emb,
                "num_zhen_layers": self.num_zhen_layers, "tokens": tokens}

    def result_columns(self) -> dict[str, Any]:
        """The earlier toolkit's model columns of table `results`."""
        return {"num_zhen_layers": self.num_zhen_layers, "token_mixer": json.dumps(self.to_toml()["tokens"]),
                "input_features": self.num_features, "emb_dimensions": self.emb_dim,
                "output_per_ensemble": self.output_per_emb}


@dataclass(frozen=True)
class TransformerSpec:
    """A GPT-style decoder (causal) or BERT-style encoder: num_layers blocks of self-attention
    and an MLP, between a token embedding and the vocabulary's logits."""

    num_layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int = 51200
    ffn: int = 0  # the MLP's hidden width; 0: 4 x hidden
    causal: bool = True
    family: str = dataclasses.field(default="transformer", init=False)  # in to_dict, for from_dict

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def summary(self) -> str:
        kind = "GPT" if self.causal else "BERT"
        ffn = f" F{self.ffn}" if self.ffn else ""
        return f"{kind} L{self.num_layers} H{self.hidden} A{self.heads} S{self.seq_len}{ffn}"

    def to_toml(self) -> dict[str, Any]:
        table: dict[str, Any] = {"family": self.family, "num_layers": self.num_layers, "hidden": self.hidden,
                                 "heads": self.heads, "seq_len": self.seq_len, "vocab": self.vocab}
        if self.ffn:
            table["ffn"] = self.ffn
        return {**table, "causal": self.causal}

    def result_columns(self) -> dict[str, Any]:
        """Table `results`' model columns: the layers and width where ZHEN's are, the whole
        [[model]] table in `token_mixer`, none for ZHEN's features."""
        return {"num_zhen_layers": self.num_layers, "token_mixer": json.dumps(self.to_toml()),
                "input_features": None, "emb_dimensions": self.hidden, "output_per_ensemble": None}


Model = ModelSpec | TransformerSpec


@dataclass(frozen=True)
class ClusterSpec:
    num_hosts: int
    num_devices_per_host: int
    transport: str
    platform: str = "gpu"
    device: str | None = None  # device kind a "sim" cluster is priced as (a built-in or profiled kind)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.num_devices_per_host

    @property
    def is_simulated(self) -> bool:
        return self.platform == "sim"

    def summary(self) -> str:
        where = f"sim {self.device}" if self.is_simulated else self.platform
        return f"{self.num_hosts}x{self.num_devices_per_host} {self.transport} ({where})"


@dataclass(frozen=True)
class TrainingSpec:
    avg_batch_size_per_device: int
    num_iters: int
    learning_rate: float = 1e-3
    seed: int = 0
    precision: str = "fp32"
    fold_dot: bool = False  # DOT mixers over the Gram's upper blocks: same function, fewer FLOPs
    # The measured steps go on past num_iters until they add up to at least this many seconds:
    # a few millisecond steps on shared cores are too noisy to compare plans by
    min_measured_seconds: float = 0.0
    global_batch_size: int = 0  # samples per iteration, in place of avg_batch_size_per_device (0: that)

    @property
    def warmup_iters(self) -> int:
        """Iterations excluded from the latency figures (compilation, caches)."""
        return 2 if self.num_iters >= 5 else 1


@dataclass(frozen=True)
class ParallelSpec:
    description: str
    num_micro_batches: tuple[int, ...]
    num_auto_layers: int = 1
    remat_layer: bool = False
    pp_dp_op: tuple[int, int, int] | None = None
    physical_mesh_shape: tuple[int, int] | None = None
    auto_sharding_option: tuple[tuple[str, Any], ...] = ()
    host_ids: tuple[tuple[int, ...], ...] | None = None
    device_ids: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    pipeline_schedule: str = "1F1B"
    auto_trials: int = 1  # Auto search: measure this many of the best predicted plans, run the fastest
    objective: str = "time"  # Auto search: what its best plan minimises (OBJECTIVES)
    max_slowdown: float | None = None  # Auto search, energy or cost: at most this share slower than the fastest
    eta: float = 0.5  # Auto search, cost: the weight of energy against time

    @property
    def is_auto(self) -> bool:
        return self.description == AUTO_SEARCH

    @property
    def sharding_options(self) -> dict[str, Any]:
        return dict(self.auto_sharding_option)

    @property
    def zero2(self) -> bool:
        """Gradients and Adam's moments sharded over dp (Alpa's prefer_reduce_scatter)."""
        return bool(self.sharding_options.get("prefer_reduce_scatter", False))

    def summary(self) -> str:
        if self.is_auto:
            trials = f" trials={self.auto_trials}" if self.auto_trials > 1 else ""
            goal = f" objective={self.objective}" if self.objective != "time" else ""
            return f"{AUTO_SEARCH} groups={self.num_auto_layers}{trials}{goal}"
        pp, dp, op = self.pp_dp_op
        remat = " remat" if self.remat_layer else ""
        return f"pp{pp} dp{dp} op{op} groups={self.num_auto_layers}{remat}"


@dataclass(frozen=True)
class Job:
    """One run: a model on a cluster under one parallel plan and one micro-batch count."""

    model: Model
    cluster: ClusterSpec
    training: TrainingSpec
    parallel: ParallelSpec
    num_micro_batches: int
    platform: str  # resolved: "gpu", "cpu" or "sim" (priced, never run)

    @property
    def global_batch(self) -> int:
        if self.training.global_batch_size:
            return self.training.global_batch_size
        return self.training.avg_batch_size_per_device * self.cluster.num_devices

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        """The job of to_dict(); other keys (all_configs also holds the plan and losses) are ignored."""
        return cls(model=_model_from_dict(data["model"]),
                   cluster=ClusterSpec(**data["cluster"]),
                   training=TrainingSpec(**data["training"]),
                   parallel=_parallel_from_dict(data["parallel"]),
                   num_micro_batches=data["num_micro_batches"],
                   platform=data["platform"])


def _tuplify(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_tuplify(v) for v in value)
    return value


def _model_from_dict(data: dict[str, Any]) -> Model:
    if data.get("family") == "transformer":
        return TransformerSpec(**{k: v for k, v in data.items() if k != "family"})
    return ModelSpec(**{**data, "tokens": _tuplify(data["tokens"])})


def _parallel_from_dict(data: dict[str, Any]) -> ParallelSpec:
    fields = {k: _tuplify(v) for k, v in data.items()}
    fields["auto_sharding_option"] = tuple(tuple(kv) for kv in fields["auto_sharding_option"])
    return ParallelSpec(**fields)
