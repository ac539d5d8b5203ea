"""What every compiled stage program shares: its mesh, its shardings, and what it costs.

A stage is one (dp, op) submesh running a contiguous run of the model's layers; whatever is the
model's (its layers, batch and loss) comes from its family's `network` (codesign.families), so
every family runs through the same programs. pp = 1 runs one stage as a single fused step
(step.py); pp > 1 runs several as an MPMD pipeline (pipeline.py). Both place parameters by the
plan's logical-axis rules and, with `prefer_reduce_scatter`, shard gradients and Adam's moments
over dp (ZeRO-2).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from codesign import families
from codesign.config.types import Job, Model
from codesign.engine.options import EngineOptions, engine_options, run_once_options
from codesign.cost.plan import MESH_AXES, Plan, StagePlan

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
ParamSource = Callable[[Model, tuple[int, ...], int], dict]  # (model, a stage's layers, seed) -> {layer_i: ...}


class Training(Protocol):
    """A compiled training iteration and the state it runs on, whatever the number of stages."""

    compile_time: float
    memory: dict[str, Any]  # predicted bytes per device: "peak" (max over stages), "temp", ...
    shardings: tuple[dict[str, Any], ...]  # per stage, for all_configs

    def step(self) -> jax.Array:
        """One iteration (all micro-batches, one optimizer update); returns the loss, unsynchronised."""

    def synchronize(self) -> None:
        """Wait until the last step's update has landed on every device."""

    def first_moments(self) -> dict:
        """Adam's first moment of every parameter, merged over stages: after the first step it is
        (1 - b1) x the gradients that step applied, as the step's own program reduced them."""

    def params(self) -> dict:
        """Current parameters {layer_i: ...}, merged over stages."""


def stage_mesh(stage: StagePlan) -> Mesh:
    devices = np.array(jax.devices())[list(stage.device_ids)]
    return Mesh(devices.reshape(stage.dp, stage.op), MESH_AXES)


def batch_sharding(mesh: Mesh, plan: Plan, leading: int = 0) -> NamedSharding:
    """Batch dimension (after `leading` unsharded dims) on the plan's batch axis."""
    return NamedSharding(mesh, P(*([None] * leading), plan.batch_axis))


def stage_parameters(job: Job, plan: Plan, stage: StagePlan, mesh: Mesh) -> tuple[dict, dict]:
    """The stage's abstract parameters and their shardings from the rules table, both derived
    from one abstract initialisation (nothing allocated)."""
    network = families.network(job.model)
    boxed = jax.eval_shape(lambda k: network.init_params(job.model, k, layers=stage.layers), jax.random.key(0))
    return nn.meta.unbox(boxed), nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, plan.rules)


def initial_params(model: Model, layers: tuple[int, ...], seed: int) -> dict:
    """The initial parameters of a stage's layers, unsharded on one device: one program per
    model and stage whatever the plan, so a process compiles it once (and the persistent cache
    serves it to the next job). Its random draws unroll into ~500 fusions, so it compiles with
    run_once_options: much less to compile, for a program run once."""
    return _initial_params_program()(model, layers, seed)


@functools.cache
def _initial_params_program() -> Callable[[Model, tuple[int, ...], int], dict]:
    def initial(model: Model, layers: tuple[int, ...], seed: int) -> dict:
        return nn.meta.unbox(families.network(model).init_params(model, jax.random.key(seed), layers=layers))

    return jax.jit(initial, static_argnums=(0, 1, 2), compiler_options=run_once_options(jax.default_backend()))


def mesh_options(job: Job, mesh: Mesh, options: EngineOptions | None = None) -> EngineOptions:
    """`options`, or where none are given, engine_options' for the mesh's platform and the job's
    precision (a builder called without them builds what a job builds)."""
    return options or engine_options(mesh.devices.flat[0].platform, job.training.precision)


def init_state(job: Job, stage: StagePlan, optimizer: optax.GradientTransformation,
               shardings: tuple[Any, Any], view: Callable[[dict], Any] | None = None,
               initial: ParamSource = initial_params, zeros: Any = None) -> tuple[Any, ...]:
    """The stage's slice of the initial parameters (`initial`'s; the model's own are the same
    values under every plan), placed by the plan (replicated where `view` flattens them), then in
    one program as `view` holds them, Adam's state and, given `zeros` (abstract arrays, placed),
    zeros of those (a gradient sum). The whole slice sits on one device until it is placed."""
    params = initial(job.model, stage.layers, job.training.seed)
    # where `view` flattens them, every parameter is replicated, as each of its arrays is
    replicated = jax.tree.leaves(shardings[0])[0]
    placement = shardings[0] if view is None else jax.tree.map(lambda _: replicated, params)
    params = jax.device_put(params, placement)

    def init(params):
        params = params if view is None else view(params)
        state = (params, optimizer.init(params))
        return state if zeros is None else (*state, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zeros))

    placed = shardings if zeros is None else (*shardings, jax.tree.map(lambda a: a.sharding, zeros))
    return jax.jit(init, out_shardings=placed)(params)


def zero_sharding(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """ZeRO-2: add "dp" to the first unsharded dimension divisible by dp (unchanged if none)."""
    dp = sharding.mesh.shape["dp"]
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if dp == 1 or "dp" in spec:
        return sharding
    for i, (axis, size) in enumerate(zip(spec, shape)):
        if axis is None and size % dp == 0:
            spec[i] = "dp"
            return NamedSharding(sharding.mesh, P(*spec))
    return sharding


def gradient_shardings(plan: Plan, shardings: dict, params: dict) -> dict:
    """Where gradients are reduced to: scattered over dp with prefer_reduce_scatter, else like params."""
    if not plan.reduce_scatter:
        return shardings
    return jax.tree.map(lambda s, p: zero_sharding(s, p.shape), shardings, params)


def optimizer_shardings(optimizer: optax.GradientTransformation, params: dict, grad_shardings: dict,
                        mesh: Mesh) -> Any:
    """Adam's moments sharded like the gradients; scalars (the step count) replicated."""
    state = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, state, grad_shardings,
                                            transform_non_params=lambda _: replicated)


def describe_shardings(shardings: dict, grad_shardings: dict) -> dict[str, Any]:
    """For all_configs: each parameter's partition spec, and where its gradient and Adam moments live."""
    params = {_path(k): str(v.spec) for k, v in jax.tree_util.tree_leaves_with_path(shardings)}
    moments = {_path(k): str(v.spec) for k, v in jax.tree_util.tree_leaves_with_path(grad_shardings)}
    return {"params": params,
            "gradients_and_moments": {k: v for k, v in moments.items() if v != params[k]},
            "optimizer_state": "ZeRO-2: scattered over dp" if moments != params else "like params"}


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes of one compiled program, from XLA's memory analysis (empty if unknown)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    return {"arguments": int(stats.argument_size_in_bytes), "outputs": int(stats.output_size_in_bytes),
            "aliased": int(stats.alias_size_in_bytes), "temp": int(stats.temp_size_in_bytes),
            "peak": int(stats.argument_size_in_bytes + stats.output_size_in_bytes
                        + stats.temp_size_in_bytes - stats.alias_size_in_bytes)}


HLO_OPS = ("fusion", "gather", "scatter", "transpose", "copy", "dot", "convolution", "custom-call")
_HLO_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = .*?\s([a-z][a-z0-9-]*)\(", re.MULTILINE)


def compiled_op_counts(compiled) -> dict[str, int]:
    """Instructions of the optimized HLO by opcode, fused ones included, over HLO_OPS: what a
    step's memory traffic is judged by where no profiler is at hand (no gather, fewer copies)."""
    found = Counter(_HLO_OP.findall(compiled.as_text()))
    return {op: found[op] for op in HLO_OPS}


def placed_shapes(shapes: Any, shardings: Any) -> Any:
    """Abstract arrays of `shapes`, each placed by its sharding: what a program is lowered and
    compiled on before anything is allocated (the devices need not even be attached)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def batch_shapes(job: Job, micro_batches: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """Shapes of synthetic_batch's (inputs, targets), micro-batch leading: its family's draws,
    traced, not run."""
    m, b, network = job.model, job.global_batch, families.network(job.model)
    per, key = (micro_batches, b // micro_batches), jax.random.key(0)
    drawn = (jax.eval_shape(lambda: network.synthetic_inputs(m, key, b, DTYPES[job.training.precision])),
             jax.eval_shape(lambda: network.synthetic_targets(m, key, b)))
    return tuple(jax.ShapeDtypeStruct((*per, *a.shape[1:]), a.dtype) for a in drawn)


def synthetic_batch(job: Job, micro_batches: int, x_sharding: NamedSharding,
                    y_sharding: NamedSharding) -> tuple[jax.Array, jax.Array]:
    """Fixed random inputs and targets (micro-batch leading), identical for every plan of the job,
    drawn as the model's family draws them. Floating inputs come in the compute precision, as a
    bf16 data pipeline would feed them: the step does not convert them (the model casts its input
    to that precision first, so the values are the same)."""
    m, b, network = job.model, job.global_batch, families.network(job.model)

    def key(which: int) -> jax.Array:
        return jax.random.split(jax.random.key(job.training.seed + 1))[which]

    def inputs():
        x = network.synthetic_inputs(m, key(0), b, DTYPES[job.training.precision])
        return x.reshape(micro_batches, b // micro_batches, *x.shape[1:])

    def targets():
        y = network.synthetic_targets(m, key(1), b)
        return y.reshape(micro_batches, b // micro_batches, *y.shape[1:])

    options = run_once_options(jax.default_backend())
    return (jax.jit(inputs, out_shardings=x_sharding, compiler_options=options)(),
            jax.jit(targets, out_shardings=y_sharding, compiler_options=options)())


@dataclass(frozen=True)
class StartingValues:
    """Where a training's parameters and batch come from: for a job, the model's own
    initialisation and a fixed random batch (the same values under every plan); a profile's
    probe steps, timed and never compared, take any values of those shapes."""

    params: ParamSource = initial_params
    batch: Callable[[Job, int, NamedSharding, NamedSharding], tuple[Any, Any]] = synthetic_batch


JOB_VALUES = StartingValues()


def apply_groups(job: Job, groups: tuple[tuple[int, ...], ...], remat: bool, options: EngineOptions):
    """(params, carry) -> carry through the layer groups, each group a jax.checkpoint region with remat."""
    dtype, network = DTYPES[job.training.precision], families.network(job.model)

    def apply_group(layers, params, carry):
        return network.apply_layers(job.model, params, carry, layers, options, dtype, job.training.fold_dot)

    run = jax.checkpoint(apply_group, static_argnums=0) if remat else apply_group

    def apply(params, carry):
        for layers in groups:
            carry = run(layers, params, carry)
        return carry

    return apply


def input_carry(x: jax.Array, dtype) -> tuple[jax.Array, None]:
    """The first layer's carry: the batch's inputs, floating ones in the compute precision
    (integer ones, a transformer's token ids, as they are), and no previous layer's output."""
    return (x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x), None


def loss(job: Job, out: jax.Array, y: jax.Array) -> jax.Array:
    """The model's loss (its family's network.loss) of its output `out` against targets y."""
    return families.network(job.model).loss(out, y)


def varying_like(x: jax.Array, z: jax.Array) -> jax.Array:
    """x made to vary over the manual axes z varies over (inside shard_map): a custom VJP returns
    gradients as varying as its cotangent, and the sum over those axes then happens outside it,
    in the transpose of this cast, as it does for a differentiated broadcast."""
    varying = jax.typeof(z).manual_axis_type.varying - jax.typeof(x).manual_axis_type.varying
    return jax.lax.pcast(x, tuple(sorted(varying)), to="varying")


def varying(tree: Any, like: jax.Array) -> Any:
    """tree cast, leaf by leaf, to vary over the manual axes `like` varies over (varying_like):
    inside shard_map, so that gradients taken with respect to it stay the shard's own until an
    explicit psum."""
    return jax.tree.map(lambda a: varying_like(a, like), tree)


class DoesNotFit(Exception):
    """The compiled iteration needs more memory per device than the device has."""


def ensure_fits(memory: dict[str, Any]) -> None:
    stats = jax.local_devices()[0].memory_stats() or {}
    limit, need = stats.get("bytes_limit"), memory.get("peak")
    if limit and need and need > limit:
        raise DoesNotFit(f"the compiled step needs {need / 2**30:.2f} GiB per device, the device has "
                         f"{limit / 2**30:.2f} GiB: raise op or pp, add micro-batches or remat")
