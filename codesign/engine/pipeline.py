"""pp > 1: an MPMD pipeline, each stage its own compiled programs on its own (dp, op) submesh.

A model's layers differ (ZHEN's from one another, a transformer's first and last from the
rest), so stages are not one SPMD loop: every stage compiles, before step 0,
- forward(params, inputs) -> (out, residuals): its layer groups under `jax.vjp` (the last stage's
  out is its micro-batch's share of the loss). The residuals are the vjp's saved arrays minus those
  the caller holds anyway (parameters, the stage's inputs), so no micro-batch keeps a weight copy,
  and minus broadcasts (saved_residual), which the backward makes again;
- backward(params, inputs, residuals, cotangent, grads) -> (grads, input cotangent): the vjp
  applied without recomputation (beyond remat and the broadcasts), gradients accumulated into a donated buffer;
  with the batch on dp (dp > 1, not ZeRO-2) and several micro-batches, each batch shard keeps
  its own sum, and nothing is reduced until the update (deferred_axis);
- update(params, opt_state, grads) -> (params, opt_state, zeroed grads): one Adam step per
  iteration; Adam is elementwise, so per-stage updates equal the single-program one.
The host dispatches these in the schedule's order (dispatch is asynchronous, so that order is the
schedule) and moves activations and their cotangents between submeshes with `jax.device_put`.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from codesign.engine import programs
from codesign.engine.options import EngineOptions
from codesign.cost.plan import Plan, StagePlan
from codesign.cost.schedule import FORWARD, dispatch_order, max_in_flight
from codesign.config.types import Job

log = logging.getLogger(__name__)

@dataclass
class Stage:
    forward: Callable
    backward: Callable
    update: Callable
    params: dict
    opt_state: Any
    grads: dict
    inputs: NamedSharding  # where activations and cotangents arriving at this stage live
    memory: dict[str, Any]
    shardings: dict[str, Any]


@dataclass
class Pipeline:
    stages: list[Stage]
    xs: list[jax.Array]  # stage 0's input, per micro-batch
    ys: list[jax.Array]  # the last stage's target, per micro-batch
    one: jax.Array  # the loss cotangent, on the last stage
    order: tuple[tuple[int, str, int], ...]
    compile_time: float
    memory: dict[str, Any]
    shardings: tuple[dict[str, Any], ...]

    def step(self) -> jax.Array:
        loss = self._accumulate()
        for stage in self.stages:
            stage.params, stage.opt_state, stage.grads = stage.update(stage.params, stage.opt_state, stage.grads)
        return loss

    def first_moments(self) -> dict:
        return {k: v for stage in self.stages for k, v in optax.tree_utils.tree_get(stage.opt_state, "mu").items()}

    def params(self) -> dict:
        return {k: v for stage in self.stages for k, v in stage.params.items()}

    def synchronize(self) -> None:
        jax.block_until_ready(self.params())

    def _accumulate(self) -> jax.Array:
        """Every micro-batch forward and backward, in schedule order; gradients land in stage.grads."""
        last = len(self.stages) - 1
        inputs: dict[tuple[int, int], tuple] = {(0, m): (x,) for m, x in enumerate(self.xs)}
        saved: dict[tuple[int, int], list] = {}
        cotangents: dict[tuple[int, int], Any] = {}
        losses = []
        for s, kind, m in self.order:
            stage = self.stages[s]
            if kind == FORWARD:
                out, saved[s, m] = stage.forward(stage.params, inputs[s, m])
                if s == last:
                    losses.append(out)
                else:
                    carry = jax.device_put(out, self.stages[s + 1].inputs)
                    inputs[s + 1, m] = (carry, self.ys[m]) if s + 1 == last else (carry,)
                continue
            cotangent = self.one if s == last else cotangents.pop((s, m))
            stage.grads, back = stage.backward(stage.params, inputs.pop((s, m)), saved.pop((s, m)),
                                               cotangent, stage.grads)
            if s > 0:
                cotangents[s - 1, m] = jax.device_put(back, self.stages[s - 1].inputs)
        return sum(losses[1:], losses[0])


class _VjpLayout:
    """The vjp's pytree structure, recorded while tracing the forward, so the backward can rebuild it
    from residuals plus the arrays the caller still holds."""

    def __init__(self):
        self.treedef: Any = None
        self.sources: list[tuple[bool, int]] = []  # per leaf: (held by the caller?, index)

    def split(self, vjp, held: list) -> list:
        leaves, self.treedef = jax.tree.flatten(vjp)
        residuals, self.sources = [], []
        for leaf in leaves:
            j = next((j for j, h in enumerate(held) if leaf is h), None)
            self.sources.append((j is not None, len(residuals) if j is None else j))
            if j is None:
                residuals.append(leaf)
        return residuals

    def join(self, residuals: list, held: list):
        leaves = [held[i] if is_held else residuals[i] for is_held, i in self.sources]
        return self.treedef.unflatten(leaves)


def stage_programs(job: Job, plan: Plan, index: int, activations: NamedSharding,
                   grad_shardings: dict, options: EngineOptions) -> tuple[Callable, Callable]:
    """The stage's (forward, backward) functions, to be jitted; see the module docstring. Where
    the stage syncs once (deferred_axis), each batch shard runs them on its own samples
    (_per_shard): its gradients accumulate apart, on a leading axis, until the update."""
    stage, last = plan.stages[index], index == len(plan.stages) - 1
    apply = programs.apply_groups(job, stage.groups, plan.remat, options)
    if not plan.remat:  # remat keeps each group's input alone: a policy around it would save the rest again
        apply = jax.checkpoint(apply, policy=saved_residual)
    dtype = programs.DTYPES[job.training.precision]
    layout = _VjpLayout()
    axis = deferred_axis(plan, index)
    shards = 1 if axis is None else activations.mesh.shape[axis]

    def placed(tree, shardings):  # per shard (axis), XLA is not told where the whole goes
        return tree if axis or tree is None else jax.lax.with_sharding_constraint(tree, shardings)

    def run(params, diff, const):
        carry = diff[0] if index > 0 else programs.input_carry(const[0], dtype)
        out = apply(params, carry)
        if last:  # a shard's mean over its samples, a 1/shards share of the micro-batch's
            return programs.loss(job, out[1], const[-1]) / (plan.num_micro_batches * shards)
        return placed(out, activations)

    def split(inputs):  # (differentiable, constant): stage 0 takes x; the last also takes y
        return (inputs[:0], inputs) if index == 0 else (inputs[:1], inputs[1:])

    def forward(params, inputs):
        diff, const = split(inputs)
        out, vjp = jax.vjp(lambda p, d: run(p, d, const), params, diff)
        return out, layout.split(vjp, jax.tree.leaves((params, inputs)))

    def backward(params, inputs, residuals, cotangent, grads):
        vjp = layout.join(residuals, jax.tree.leaves((params, inputs)))
        dparams, ddiff = vjp(cotangent)
        grads = jax.tree.map(jnp.add, grads, dparams)
        return placed(grads, grad_shardings), placed(ddiff[0] if ddiff else None, activations)

    if axis is None:
        return forward, backward
    return _per_shard(forward, backward, activations.mesh, axis, last)


def saved_residual(primitive: Any, *_, **__) -> bool:
    """What a stage's forward hands its backward (jax.checkpoint's policy): every value the vjp
    needs but a broadcast, which the backward makes again from what it broadcast (a ReLU's zeros,
    LayerNorm's per-sample statistics, a constant column). Saved, they were program outputs at
    their full size: a constant's whole on each device of a dp stage, where XLA had nothing to
    shard it by; recomputed, they roughly halved a dp stage's peak on H100s (bench/RESULTS.md)."""
    return primitive is not lax.broadcast_in_dim_p


def deferred_axis(plan: Plan, index: int) -> str | None:
    """The batch's mesh axis where stage `index` reduces its gradients once per step
    (Plan.syncs_once) over more than one device, else None."""
    return plan.batch_axis if plan.syncs_once(len(plan.stages)) and plan.stages[index].dp > 1 else None


def _per_shard(forward: Callable, backward: Callable, mesh, axis: str, last: bool) -> tuple[Callable, Callable]:
    """forward and backward as each batch shard's own (shard_map over the batch axis; XLA still
    splits the op axis), parameters cast to varying so that their gradients stay the shard's;
    residuals and the gradient sum carry a leading axis of one entry per shard. Left to XLA,
    every micro-batch's backward all-reduced its gradients (the accumulator held them whole),
    and XLA:CPU added them through transposing copies."""
    batch, manual, varying = P(axis), manual_axes(mesh, axis), programs.varying

    def local_forward(params, inputs):
        like = jax.tree.leaves(inputs)[0]
        out, residuals = forward(varying(params, like), inputs)
        return (jax.lax.psum(out, axis) if last else out), [r[None] for r in residuals]

    def local_backward(params, inputs, residuals, cotangent, grads):
        like = jax.tree.leaves(inputs)[0]
        grads, back = backward(varying(params, like), inputs, [r[0] for r in residuals],
                               varying(cotangent, like), jax.tree.map(lambda g: g[0], grads))
        return jax.tree.map(lambda g: g[None], grads), back

    def sharded_forward(params, inputs):
        return jax.shard_map(local_forward, mesh=mesh, in_specs=(P(), batch),
                             out_specs=(P() if last else batch, batch), axis_names=manual)(params, inputs)

    def sharded_backward(params, inputs, residuals, cotangent, grads):
        return jax.shard_map(local_backward, mesh=mesh, in_specs=(P(), batch, batch, P() if last else batch, batch),
                             out_specs=(batch, batch), axis_names=manual)(params, inputs, residuals, cotangent, grads)

    return sharded_forward, sharded_backward


def summed_gradients(mesh, axis: str | None) -> Callable:
    """The accumulator's gradients, summed over its leading per-shard axis where the stage
    defers its sync (one psum of all of them), else as they are."""
    if axis is None:
        return lambda grads: grads
    return jax.shard_map(lambda grads: jax.lax.psum(jax.tree.map(lambda g: g[0], grads), axis), mesh=mesh,
                         in_specs=P(axis), out_specs=P(), axis_names=manual_axes(mesh, axis))


def manual_axes(mesh, axis: str) -> set[str]:
    """The batch axis and every axis of one device: the mesh's others (op > 1) stay XLA's to
    split. With op = 1 left automatic, XLA:CPU's forward had 9 more transposes."""
    return {axis} | {name for name, size in mesh.shape.items() if size == 1}


def build_pipeline(job: Job, plan: Plan, values: programs.StartingValues = programs.JOB_VALUES,
                   options: EngineOptions | None = None) -> Pipeline:
    """Compile every stage (forward, backward, update), check that the plan fits, then place and
    initialise the stages' state: a plan that cannot fit fails before anything is allocated."""
    built = compile_pipeline(job, plan, [programs.stage_mesh(s) for s in plan.stages], options)
    programs.ensure_fits(built.memory)
    first, last = built.stages[0], built.stages[-1]
    x, y = values.batch(job, plan.num_micro_batches, *built.batch)
    xs = jax.jit(list, out_shardings=first.inputs)(x)
    ys = jax.jit(list, out_shardings=last.inputs)(y)
    one = jax.device_put(jnp.ones((), jnp.float32), NamedSharding(last.inputs.mesh, P()))
    stages = [_placed_stage(job, plan.stages[part.index], part, built.optimizer, values.params)
              for part in built.stages]
    return Pipeline(stages, xs, ys, one, dispatch_order(plan.schedule, len(stages), plan.num_micro_batches),
                    built.compile_time, built.memory, tuple(s.shardings for s in stages))


@dataclass
class CompiledStage:
    """A stage's three programs, compiled on abstract arrays, and where its state lives."""

    index: int
    forward: Any
    backward: Any
    update: Any
    shardings: tuple[Any, Any, Any]  # params, opt_state, the gradient sum
    accumulator: Any  # the gradient sum's abstract arrays, placed (a leading per-shard axis where the stage defers its sync)
    inputs: NamedSharding  # where activations and cotangents arriving at the stage live
    memory: dict[str, Any]
    described: dict[str, Any]  # programs.describe_shardings of its parameters and their gradients


@dataclass
class CompiledPipeline:
    stages: list[CompiledStage]
    optimizer: optax.GradientTransformation
    batch: tuple[NamedSharding, NamedSharding]  # x's (on stage 0) and y's (on the last), micro-batch leading
    compile_time: float
    memory: dict[str, Any]


def compile_pipeline(job: Job, plan: Plan, meshes: list[Mesh], options: EngineOptions | None = None
                     ) -> CompiledPipeline:
    """Every stage compiled on abstract arrays, beside the others (the meshes' devices need not be
    attached: bench/target_plans.py compiles for GPUs it only describes), with its predicted peak."""
    options = programs.mesh_options(job, meshes[0], options)
    last = len(meshes) - 1
    optimizer = optax.adam(job.training.learning_rate)
    activations = [programs.batch_sharding(mesh, plan) for mesh in meshes]
    batch = (programs.batch_sharding(meshes[0], plan, leading=1), programs.batch_sharding(meshes[last], plan, leading=1))
    x, y = programs.placed_shapes(programs.batch_shapes(job, plan.num_micro_batches), batch)
    lowered, arriving = [], (_micro_batch(x, activations[0]),)
    for index, mesh in enumerate(meshes):
        inputs = arriving + ((_micro_batch(y, activations[last]),) if index == last else ())
        lowered.append(_lower_stage(job, plan, index, mesh, activations[index], inputs, optimizer, options))
        if index < last:
            arriving = (_on(lowered[-1].forward.out_info[0], activations[index + 1]),)
    one = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(meshes[last], P()))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(lowered)) as pool:
        stages = list(pool.map(lambda part: _compile_stage(part, one if part.index == last else None), lowered))
    compile_time = time.perf_counter() - start + sum(part.lowering for part in lowered)
    data = {0: device_bytes(x), last: device_bytes(y)}
    for index, stage in enumerate(stages):
        stage.memory = _stage_peak(stage.memory, plan, index, data.get(index, 0))
    memory = {"peak": max(s.memory["peak"] for s in stages),
              "temp": max(s.memory["temp"] for s in stages),
              "stages": [s.memory for s in stages]}
    log.info("compiled %d stages in %.1f s; predicted peak %.1f MiB per device", len(stages),
             compile_time, memory["peak"] / 2**20)
    return CompiledPipeline(stages, optimizer, batch, compile_time, memory)


@dataclass
class LoweredStage:
    """A stage's forward lowered (the next stage's input is its output's shape), the rest still to compile."""

    index: int
    state: tuple[Any, Any, Any]  # params, opt_state, the gradient sum: abstract, placed
    inputs: tuple
    activations: NamedSharding
    forward: Any  # jax.stages.Lowered
    lowering: float  # seconds lowering the forward took (counted as compile time)
    backward: Callable
    update: Callable
    described: dict[str, Any]


def _lower_stage(job: Job, plan: Plan, index: int, mesh: Mesh, activations: NamedSharding, inputs: tuple,
                 optimizer: optax.GradientTransformation, options: EngineOptions) -> LoweredStage:
    stage = plan.stages[index]
    abstract, shardings = programs.stage_parameters(job, plan, stage, mesh)
    grad_shardings = programs.gradient_shardings(plan, shardings, abstract)
    opt_shardings = programs.optimizer_shardings(optimizer, abstract, grad_shardings, mesh)
    axis = deferred_axis(plan, index)
    accumulator, sum_shardings = (abstract, grad_shardings) if axis is None else _per_shard_sum(abstract, shardings, axis)
    state = programs.placed_shapes((abstract, jax.eval_shape(optimizer.init, abstract), accumulator),
                                   (shardings, opt_shardings, sum_shardings))
    forward, backward = stage_programs(job, plan, index, activations, grad_shardings, options)
    summed = summed_gradients(mesh, axis)

    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(summed(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.tree.map(jnp.zeros_like, grads)

    start = time.perf_counter()
    lowered = jax.jit(forward).lower(state[0], inputs)
    return LoweredStage(index, state, inputs, activations, lowered, time.perf_counter() - start, backward, update,
                        programs.describe_shardings(shardings, grad_shardings))


def _per_shard_sum(abstract: dict, param_shardings: dict, axis: str) -> tuple[dict, dict]:
    """A gradient sum with one entry per batch shard on a leading axis, each placed like its
    parameter: its abstract arrays and their shardings."""
    shards = jax.tree.leaves(param_shardings)[0].mesh.shape[axis]
    return (jax.tree.map(lambda p: jax.ShapeDtypeStruct((shards, *p.shape), p.dtype), abstract),
            jax.tree.map(lambda s: NamedSharding(s.mesh, P(axis, *s.spec)), param_shardings))


def _compile_stage(part: LoweredStage, one: jax.ShapeDtypeStruct | None) -> CompiledStage:
    """One stage's programs, compiled in a thread beside the other stages' (XLA compiles outside
    the GIL; a stage's backward needs its compiled forward's residual shardings, not the other
    stages')."""
    params, opt_state, grads = part.state
    shardings = tuple(jax.tree.map(lambda a: a.sharding, tree) for tree in part.state)
    fwd = part.forward.compile()
    out, residuals = fwd.out_info
    cotangent = one if one is not None else _on(out, part.activations)
    bwd = jax.jit(part.backward, donate_argnums=(4,)).lower(params, part.inputs, residuals, cotangent, grads).compile()
    upd = jax.jit(part.update, donate_argnums=(0, 1, 2), out_shardings=shardings).lower(params, opt_state, grads).compile()
    memory = {"forward": programs.compiled_memory(fwd), "backward": programs.compiled_memory(bwd),
              "update": programs.compiled_memory(upd),
              "inputs": device_bytes(part.inputs[:1]) if part.index > 0 else 0, "residuals": device_bytes(residuals)}
    return CompiledStage(part.index, fwd, bwd, upd, shardings, grads, part.activations, memory, part.described)


def _placed_stage(job: Job, stage: StagePlan, part: CompiledStage, optimizer: optax.GradientTransformation,
                  initial: programs.ParamSource) -> Stage:
    """The compiled stage with its state: the initial parameters, Adam's, a zeroed gradient sum."""
    params, opt_state, grads = programs.init_state(job, stage, optimizer, part.shardings[:2], initial=initial,
                                                   zeros=part.accumulator)
    return Stage(part.forward, part.backward, part.update, params, opt_state, grads, part.inputs, part.memory,
                 part.described)


def _micro_batch(batch: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """One micro-batch of a batch (micro-batch leading), placed by sharding."""
    return jax.ShapeDtypeStruct(batch.shape[1:], batch.dtype, sharding=sharding)


def _on(tree, sharding: NamedSharding):
    """Abstract arrays of tree's shapes, placed by sharding (what a device_put there produces)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def device_bytes(tree) -> int:
    """Bytes one device holds of these (abstract or concrete) sharded arrays."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


def _stage_peak(memory: dict[str, Any], plan: Plan, index: int, data: int) -> dict[str, Any]:
    """Predicted peak bytes per device of a stage: its state (params, Adam, gradients), the inputs
    and residuals of the micro-batches it holds at once under the schedule, its batch data, and
    the largest scratch space of its three programs."""
    in_flight = max_in_flight(plan.schedule, len(plan.stages), index, plan.num_micro_batches)
    state = memory["update"].get("arguments", 0)
    temp = max(memory[k].get("temp", 0) for k in ("forward", "backward", "update"))
    held = in_flight * (memory["inputs"] + memory["residuals"])
    return {**memory, "in_flight": in_flight, "state": state, "temp": temp,
            "peak": state + held + data + temp}
