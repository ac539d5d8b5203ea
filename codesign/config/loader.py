"""Load and validate a codesign TOML config into frozen specs.

Every check names the file, the table and the field, so a user can fix the file
from the message alone. Files of the earlier toolkit load unchanged.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codesign.errors import ConfigError
from codesign.families import PACKAGES
from codesign.config.types import (
    AUTO_SEARCH,
    MIXERS,
    OBJECTIVES,
    PLATFORMS,
    PRECISIONS,
    SCHEDULES,
    SHARDING_OPTIONS,
    TRANSPORTS,
    ClusterSpec,
    Model,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
    TransformerSpec,
)

DEFAULT_CONFIG = Path(__file__).parents[1] / "models" / "config.toml"
PP_DP_OP = "(pp, dp, op)"


@dataclass(frozen=True)
class RaySettings:
    """The optional [ray] table: where jobs run when no --ray-address is given."""

    address: str | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class LinkSpec:
    """A [links.NAME] table: one transport's bandwidth (bytes/s) and latency (s), overriding the
    cost model's defaults. Links price plans; they never change what runs (not in job keys)."""

    name: str
    bandwidth: float | None = None
    latency: float | None = None


@dataclass(frozen=True)
class Config:
    path: str
    training: TrainingSpec
    models: tuple[Model, ...]
    clusters: tuple[ClusterSpec, ...]
    parallels: tuple[ParallelSpec, ...]
    ray: RaySettings = RaySettings()
    links: tuple[LinkSpec, ...] = ()


class _Table:
    """One TOML table being read, so every error names where it came from."""

    def __init__(self, path: str, name: str, data: dict[str, Any], known: frozenset[str]):
        self.path, self.name, self.data = path, name, data
        unknown = sorted(set(data) - known)
        if unknown:
            self.fail(unknown[0], f"unknown key; expected one of {sorted(known)}")

    def fail(self, field: str | None, problem: str) -> None:
        raise ConfigError(self.path, self.name, field, problem)

    def has(self, field: str) -> bool:
        return field in self.data

    def int(self, field: str, default: int | None = None, minimum: int = 1) -> int:
        if field not in self.data:
            if default is None:
                self.fail(field, "is required")
            return default
        value = self.data[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(field, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def float(self, field: str, default: float | None, minimum_exclusive: bool = True) -> float | None:
        value = self.data.get(field, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                minimum_exclusive and value == 0):
            self.fail(field, f"expected a {'positive' if minimum_exclusive else 'non-negative'} "
                             f"number, got {value!r}")
        return float(value)

    def bool(self, field: str, default: bool) -> bool:
        value = self.data.get(field, default)
        if not isinstance(value, bool):
            self.fail(field, f"expected true or false, got {value!r}")
        return value

    def choice(self, field: str, choices: tuple[str, ...], default: str | None = None,
               any_case: bool = False) -> str:
        """One of choices; with any_case, spelt in any case (Alpa's "gpipe") and returned as listed."""
        value = self.data.get(field, default)
        if value is None:
            self.fail(field, "is required")
        if any_case and isinstance(value, str):
            value = next((c for c in choices if c.lower() == value.lower()), value)
        if value not in choices:
            self.fail(field, f"expected one of {list(choices)}, got {value!r}")
        return value

    def int_list(self, field: str, length: int | None = None) -> tuple[int, ...]:
        value = self.data.get(field)
        ok = (isinstance(value, list) and value
              and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))
        if not ok or (length is not None and len(value) != length):
            size = f"{length} " if length else "a non-empty list of "
            self.fail(field, f"expected {size}positive integers, got {value!r}")
        return tuple(value)


def load_config(path: str | Path) -> Config:
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(path, "file", None, "not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(path, "file", None, f"invalid TOML: {err}") from None
    top = _Table(path, "top level", raw, ACCEPTED_KEYS["top level"])
    for name in ("training_spec", "model", "cluster_spec", "parallel_spec"):
        if name not in raw:
            top.fail(name, "table is missing")
    keys = ACCEPTED_KEYS
    return Config(
        path=path,
        training=parse_training(_Table(path, "[training_spec]", raw["training_spec"], keys["training_spec"])),
        models=tuple(parse_model(path, f"[[model]] #{i + 1}", m) for i, m in enumerate(_array(top, "model"))),
        clusters=tuple(parse_cluster(_Table(path, f"[[cluster_spec]] #{i + 1}", c, keys["cluster_spec"]))
                       for i, c in enumerate(_array(top, "cluster_spec"))),
        parallels=tuple(parse_parallel(_Table(path, f"[[parallel_spec]] #{i + 1}", p, keys["parallel_spec"]))
                        for i, p in enumerate(_array(top, "parallel_spec"))),
        ray=parse_ray(top),
        links=parse_links(top),
    )


def _array(top: _Table, name: str) -> list[dict[str, Any]]:
    value = top.data[name]
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        top.fail(name, f"expected one or more [[{name}]] tables")
    return value


# The keys each TOML table accepts, in one place: the tables read them, and docs/configs.md
# lists every one (tests/test_docs.py compares the two).
ACCEPTED_KEYS: dict[str, frozenset[str]] = {
    "top level": frozenset({"training_spec", "model", "cluster_spec", "parallel_spec", "ray", "links"}),
    "training_spec": frozenset({"avg_batch_size_per_device", "global_batch_size", "num_iters", "learning_rate",
                                "seed", "precision", "fold_dot", "min_measured_seconds"}),
    "model": frozenset({"family", "num_features", "emb_dim", "output_per_emb", "num_zhen_layers", "tokens"}),
    "model.transformer": frozenset({"family", "num_layers", "hidden", "heads", "seq_len", "vocab",
                                                   "ffn", "causal"}),
    "cluster_spec": frozenset({"num_hosts", "num_devices_per_host", "transport", "platform", "device"}),
    "parallel_spec": frozenset({"description", "num_micro_batches", "num_auto_layers", "remat_layer", PP_DP_OP,
                                "physical_mesh_shape", "auto_sharding_option", "host_ids", "device_ids",
                                "pipeline_schedule", "auto_trials", "objective", "max_slowdown", "eta"}),
    "parallel_spec.auto_sharding_option": frozenset(SHARDING_OPTIONS),
    "ray": frozenset({"address", "max_concurrent"}),
    "links.NAME": frozenset({"bandwidth", "latency"}),
}


def parse_ray(top: _Table) -> RaySettings:
    if "ray" not in top.data:
        return RaySettings()
    if not isinstance(top.data["ray"], dict):
        top.fail("ray", "expected a [ray] table")
    t = _Table(top.path, "[ray]", top.data["ray"], ACCEPTED_KEYS["ray"])
    address = t.data.get("address")
    if address is not None and (not isinstance(address, str) or not address.strip()):
        t.fail("address", f"expected \"local\", \"auto\" or HOST:PORT, got {address!r}")
    max_concurrent = t.int("max_concurrent") if t.has("max_concurrent") else None
    return RaySettings(address, max_concurrent)


def parse_links(top: _Table) -> tuple[LinkSpec, ...]:
    """[links.NVLink], [links.EFAx4], [links.TCPx4]: bandwidth (bytes/s) and latency (s) overrides."""
    value = top.data.get("links", {})
    if not isinstance(value, dict):
        top.fail("links", "expected [links.NAME] tables")
    links = []
    for name, table in value.items():
        if name not in TRANSPORTS or not isinstance(table, dict):
            top.fail("links", f"unknown link {name!r}; expected [links.NAME] with NAME from {list(TRANSPORTS)}")
        t = _Table(top.path, f"[links.{name}]", table, ACCEPTED_KEYS["links.NAME"])
        links.append(LinkSpec(name, t.float("bandwidth", None), t.float("latency", None, minimum_exclusive=False)))
    return tuple(links)


def parse_training(t: _Table) -> TrainingSpec:
    both = t.has("avg_batch_size_per_device") and t.has("global_batch_size")
    if both or not (t.has("avg_batch_size_per_device") or t.has("global_batch_size")):
        t.fail("global_batch_size" if both else "avg_batch_size_per_device",
               "give one of avg_batch_size_per_device (samples per device) and global_batch_size "
               "(samples per iteration)" + (", not both" if both else ""))
    per_device = t.has("avg_batch_size_per_device")
    return TrainingSpec(avg_batch_size_per_device=t.int("avg_batch_size_per_device") if per_device else 0,
                        global_batch_size=0 if per_device else t.int("global_batch_size"),
                        num_iters=t.int("num_iters", minimum=2),
                        learning_rate=t.float("learning_rate", 1e-3),
                        seed=t.int("seed", default=0, minimum=0),
                        precision=t.choice("precision", PRECISIONS, "fp32"),
                        fold_dot=t.bool("fold_dot", False),
                        min_measured_seconds=t.float("min_measured_seconds", 0.0, minimum_exclusive=False))


def parse_model(path: str, name: str, data: dict[str, Any]) -> Model:
    """A [[model]] table: ZHEN unless it names another family."""
    family = data.get("family", "zhen")
    if family not in PACKAGES:
        _Table(path, name, {}, frozenset()).fail("family", f"expected one of {list(PACKAGES)}, got {family!r}")
    if family == "transformer":
        return parse_transformer(_Table(path, name, data, ACCEPTED_KEYS["model.transformer"]))
    return parse_zhen(_Table(path, name, data, ACCEPTED_KEYS["model"]))


def parse_transformer(t: _Table) -> TransformerSpec:
    hidden, heads = t.int("hidden"), t.int("heads")
    if hidden % heads:
        t.fail("heads", f"must divide hidden = {hidden}, got {heads}")
    ffn = t.int("ffn", default=4 * hidden)
    return TransformerSpec(num_layers=t.int("num_layers"), hidden=hidden, heads=heads, seq_len=t.int("seq_len"),
                           vocab=t.int("vocab", default=51200), ffn=0 if ffn == 4 * hidden else ffn,
                           causal=t.bool("causal", True))


def parse_zhen(t: _Table) -> ModelSpec:
    layers = t.int("num_zhen_layers")
    return ModelSpec(num_features=t.int("num_features"), emb_dim=t.int("emb_dim"),
                     output_per_emb=t.int("output_per_emb"), num_zhen_layers=layers,
                     tokens=_tokens(t, layers))


def _tokens(t: _Table, layers: int) -> tuple[tuple[str, ...], ...]:
    value = t.data.get("tokens")
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        per_layer = [value] * layers
    elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if len(value) != layers:
            t.fail("tokens", f"has {len(value)} per-layer lists but num_zhen_layers = {layers}")
        per_layer = value
    else:
        t.fail("tokens", "expected a list of mixers, or one non-empty list of mixers per layer")
    for layer in per_layer:
        bad = [m for m in layer if m not in MIXERS]
        if not layer or bad:
            t.fail("tokens", f"unknown or missing mixer {bad[:1] or layer}; expected from {list(MIXERS)}")
    return tuple(tuple(layer) for layer in per_layer)


def parse_cluster(t: _Table) -> ClusterSpec:
    cluster = ClusterSpec(num_hosts=t.int("num_hosts"),
                          num_devices_per_host=t.int("num_devices_per_host"),
                          transport=t.choice("transport", TRANSPORTS),
                          platform=t.choice("platform", PLATFORMS, "gpu"),
                          device=_device(t))
    if cluster.transport == "NVLink" and cluster.num_hosts != 1:
        t.fail("transport", f"NVLink connects one host, but num_hosts = {cluster.num_hosts}")
    if cluster.is_simulated and cluster.device is None:
        t.fail("device", 'is required with platform = "sim" (the device kind to price, e.g. "H100")')
    if cluster.device is not None and not cluster.is_simulated:
        t.fail("device", 'only a platform = "sim" cluster names its device kind')
    return cluster


def _device(t: _Table) -> str | None:
    value = t.data.get("device")
    if value is not None and (not isinstance(value, str) or not value.strip()):
        t.fail("device", f"expected a device kind such as \"H100\", got {value!r}")
    return value


def parse_parallel(t: _Table) -> ParallelSpec:
    description = t.data.get("description")
    if not isinstance(description, str) or not description:
        t.fail("description", "expected a non-empty string")
    auto = description == AUTO_SEARCH
    if not auto and not t.has(PP_DP_OP):
        t.fail(PP_DP_OP, f"is required unless description = {AUTO_SEARCH!r}")
    pp_dp_op = t.int_list(PP_DP_OP, 3) if t.has(PP_DP_OP) else None
    mesh_shape = t.int_list("physical_mesh_shape", 2) if t.has("physical_mesh_shape") else None
    if pp_dp_op and mesh_shape and mesh_shape[0] * mesh_shape[1] != pp_dp_op[1] * pp_dp_op[2]:
        t.fail("physical_mesh_shape", f"{list(mesh_shape)} holds {mesh_shape[0] * mesh_shape[1]} "
               f"devices but each stage needs dp * op = {pp_dp_op[1] * pp_dp_op[2]}")
    host_ids, device_ids = _placement(t, pp_dp_op)
    for field in ("auto_trials", "objective", "max_slowdown", "eta"):
        if t.has(field) and not auto:
            t.fail(field, f"applies only to description = {AUTO_SEARCH!r} (the toolkit chooses its plan); "
                   f"a manual plan runs as written")
    objective = t.choice("objective", OBJECTIVES, "time")
    eta = t.float("eta", 0.5, minimum_exclusive=False)
    if eta > 1:
        t.fail("eta", f"expected a weight between 0 and 1, got {eta!r}")
    return ParallelSpec(description=description,
                        num_micro_batches=t.int_list("num_micro_batches"),
                        num_auto_layers=t.int("num_auto_layers", default=1),
                        remat_layer=t.bool("remat_layer", False),
                        pp_dp_op=pp_dp_op, physical_mesh_shape=mesh_shape,
                        auto_sharding_option=_sharding_options(t),
                        host_ids=host_ids, device_ids=device_ids,
                        pipeline_schedule=t.choice("pipeline_schedule", SCHEDULES, "1F1B", any_case=True),
                        auto_trials=t.int("auto_trials", default=1), objective=objective,
                        max_slowdown=t.float("max_slowdown", None, minimum_exclusive=False), eta=eta)


def _sharding_options(t: _Table) -> tuple[tuple[str, Any], ...]:
    value = t.data.get("auto_sharding_option", {})
    if not isinstance(value, dict):
        t.fail("auto_sharding_option", "expected an inline table")
    unknown = sorted(set(value) - ACCEPTED_KEYS["parallel_spec.auto_sharding_option"])
    if unknown:
        t.fail("auto_sharding_option", f"unknown option {unknown[0]!r}; expected from {list(SHARDING_OPTIONS)}")
    dim = value.get("force_batch_dim_to_mesh_dim", 0)
    if isinstance(dim, bool) or dim not in (0, 1):
        t.fail("auto_sharding_option", f"force_batch_dim_to_mesh_dim must be 0 (dp) or 1 (op), got {dim!r}")
    if not isinstance(value.get("prefer_reduce_scatter", False), bool):
        t.fail("auto_sharding_option", "prefer_reduce_scatter must be true or false")
    return tuple(sorted(value.items()))


def _placement(t: _Table, pp_dp_op: tuple[int, int, int] | None):
    """host_ids: one host list per stage; device_ids: per stage, one device list per host."""
    if not (t.has("host_ids") or t.has("device_ids")):
        return None, None
    if not (t.has("host_ids") and t.has("device_ids")):
        t.fail("device_ids" if t.has("host_ids") else "host_ids", "host_ids and device_ids go together")
    host_ids, device_ids = t.data["host_ids"], t.data["device_ids"]
    stages = pp_dp_op[0] if pp_dp_op else None
    if not _nested_ints(host_ids, 2) or (stages and len(host_ids) != stages):
        t.fail("host_ids", f"expected {stages or 'one per stage'} lists of host ids, got {host_ids!r}")
    if not _nested_ints(device_ids, 3) or len(device_ids) != len(host_ids):
        t.fail("device_ids", "expected, per stage, one list of device ids per host in host_ids")
    for stage, (hosts, devices) in enumerate(zip(host_ids, device_ids)):
        if len(hosts) != len(devices):
            t.fail("device_ids", f"stage {stage} names {len(hosts)} hosts but {len(devices)} device lists")
        if pp_dp_op and sum(map(len, devices)) != pp_dp_op[1] * pp_dp_op[2]:
            t.fail("device_ids", f"stage {stage} holds {sum(map(len, devices))} devices, "
                   f"but dp * op = {pp_dp_op[1] * pp_dp_op[2]}")
    return (tuple(tuple(h) for h in host_ids),
            tuple(tuple(tuple(d) for d in stage) for stage in device_ids))


def _nested_ints(value: Any, depth: int) -> bool:
    if depth == 0:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return isinstance(value, list) and bool(value) and all(_nested_ints(v, depth - 1) for v in value)
