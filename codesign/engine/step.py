"""pp = 1: one fused program on one (dp, op) mesh, micro-batches accumulated in a scan.

The step is lowered and compiled on abstract arrays first, so a plan that cannot fit fails
before anything is allocated on the devices.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from codesign.config.types import Job
from codesign.engine import programs
from codesign.engine.options import EngineOptions
from codesign.cost.plan import Plan


@dataclass(frozen=True)
class FlatView:
    """A stage's parameters, where all of them are replicated, as one fp32 vector of its small
    leaves and its large leaves whole (EngineOptions.whole_leaf): the step takes and returns a few
    arrays each for parameters and Adam's two moments, and a count, instead of one per leaf (whose
    host call left a GPU idle), and Adam updates the vector in one pass. The model reads the small
    leaves as slices (which fuse into their consumers); their gradients are concatenated back in one
    copy (custom_vjp: the transpose of ~150 slices would add as many zero-padded full vectors)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    whole: tuple[int, ...]  # indices of the leaves kept whole, in leaf order

    @staticmethod
    def of(params: dict, whole_leaf: float = math.inf) -> FlatView:
        leaves, treedef = jax.tree.flatten(params)
        return FlatView(treedef, tuple(tuple(leaf.shape) for leaf in leaves),
                        tuple(i for i, leaf in enumerate(leaves) if math.prod(leaf.shape) >= whole_leaf))

    def flatten(self, tree: dict) -> tuple[jax.Array, ...]:
        """(the small leaves as one vector, *the whole leaves)."""
        leaves = jax.tree.leaves(tree)
        small = [leaf.reshape(-1) for i, leaf in enumerate(leaves) if i not in self.whole]
        return (jnp.concatenate(small) if small else jnp.zeros((0,), jnp.float32), *(leaves[i] for i in self.whole))

    def leaves(self, state: tuple[jax.Array, ...]) -> dict:
        flat, whole = state[0], iter(state[1:])
        offset, leaves = 0, []
        for i, shape in enumerate(self.shapes):
            if i in self.whole:
                leaves.append(next(whole))
            else:
                size = math.prod(shape)
                leaves.append(flat[offset:offset + size].reshape(shape))
                offset += size
        return self.treedef.unflatten(leaves)

    @functools.cached_property
    def tree(self) -> Callable[[tuple[jax.Array, ...]], dict]:
        """leaves, compiled once (params() and first_moments() read the tree back through it)."""
        return jax.jit(self.leaves)

    def abstract(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        small = sum(math.prod(shape) for i, shape in enumerate(self.shapes) if i not in self.whole)
        return (jax.ShapeDtypeStruct((small,), jnp.float32),
                *(jax.ShapeDtypeStruct(self.shapes[i], jnp.float32) for i in self.whole))

    def loss(self, loss: Callable) -> Callable:
        """loss(params tree, ...) as loss(flat state, ...), the vector's gradient one concatenation."""
        @jax.custom_vjp
        def unflatten(state):
            return self.leaves(state)

        unflatten.defvjp(lambda state: (self.leaves(state), None), lambda _, grads: (self.flatten(grads),))
        return lambda state, *args: loss(unflatten(state), *args)


def replicated(shardings: dict) -> bool:
    """Whether every array is whole on every device: its spec names no mesh axis of more than one device."""
    def devices(sharding: NamedSharding, axis: str | tuple[str, ...] | None) -> int:
        return math.prod(sharding.mesh.shape[name] for name in (axis if isinstance(axis, tuple) else (axis,)) if name)

    return all(devices(s, axis) == 1 for s in jax.tree.leaves(shardings) for axis in s.spec)


@dataclass
class SingleStage:
    """pp = 1: one fused program (micro-batches accumulated in a scan, one update) on one mesh."""

    compiled: Callable  # (params, opt_state, xs, ys) -> (params, opt_state, loss)
    state: tuple[Any, Any]  # (params, opt_state); params as FlatView.flatten holds them where `view` is set
    x: jax.Array
    y: jax.Array
    compile_time: float
    memory: dict[str, Any]
    shardings: tuple[dict[str, Any], ...]
    view: FlatView | None = None

    def step(self) -> jax.Array:
        params, opt_state, loss = self.compiled(*self.state, self.x, self.y)
        self.state = (params, opt_state)
        return loss

    def synchronize(self) -> None:
        jax.block_until_ready(self.state)

    def first_moments(self) -> dict:
        return self._tree(optax.tree_utils.tree_get(self.state[1], "mu"))

    def params(self) -> dict:
        return self._tree(self.state[0])

    def _tree(self, values: Any) -> dict:
        return values if self.view is None else self.view.tree(values)


def loss_fn(job: Job, groups: tuple[tuple[int, ...], ...], remat: bool, options: EngineOptions) -> Callable:
    """The model's loss (its family's) of the model applied group by group, each group optionally
    rematerialised."""
    apply = programs.apply_groups(job, groups, remat, options)

    def loss(params, x, y):
        _, out = apply(params, programs.input_carry(x, programs.DTYPES[job.training.precision]))
        return programs.loss(job, out, y)

    return loss


def accumulate(loss: Callable, grad_shardings: Any = None, per_shard: tuple[Mesh, str, dict] | None = None) -> Callable:
    """Loss and gradients averaged over micro-batches (leading axis), one sync per step.

    With grad_shardings (ZeRO-2), each micro-batch's gradients are reduce-scattered into them.
    With per_shard (mesh, batch axis, parameter shardings), the scan keeps each batch shard's
    gradients apart, on its own devices, and reduces them once after it: left to place the
    reduction, XLA:CPU all-reduced inside the loop, once per pair of micro-batches it unrolls.
    One micro-batch too: left to XLA, each gradient was all-reduced as its dot made it, before the
    transpose to its parameter's layout, and Adam's update read it transposed, and the
    convolutions' sums became many all-gathers of 2 floats.
    """

    def place(grads):
        return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

    def value_and_grad(params, xs, ys):
        if per_shard is not None:
            return _deferred(loss, per_shard, params, xs, ys)
        value, grads = _summed(loss, params, xs, ys, place)
        n = xs.shape[0]
        return value / n, jax.tree.map(lambda g: g / n, grads)

    return value_and_grad


def _summed(loss: Callable, params, xs, ys, place: Callable = lambda g: g, start: Callable = lambda t: t):
    """Loss and gradients summed over the micro-batches (leading axis): one call for one, else a
    scan whose sum starts from start(zeros)."""
    if xs.shape[0] == 1:
        value, grads = jax.value_and_grad(loss)(params, xs[0], ys[0])
        return value, place(grads)

    def body(acc, batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        return jax.tree.map(jnp.add, acc, (value, place(grads))), None

    zeros = start((jnp.zeros((), jnp.float32), place(jax.tree.map(jnp.zeros_like, params))))
    return jax.lax.scan(body, zeros, (xs, ys))[0]


def _deferred(loss: Callable, per_shard: tuple[Mesh, str, dict], params, xs, ys):
    """The scan over micro-batches with each batch shard's loss and gradients kept on a leading
    axis sharded over the batch's mesh axis (no communication inside the loop), summed once."""
    mesh, axis, shardings = per_shard
    if replicated(shardings):
        return _deferred_whole(loss, mesh, axis, params, xs, ys)
    shards = mesh.shape[axis]

    def split(a):  # (batch, ...) -> (shards, batch / shards, ...), the shard axis where the batch was
        a = a.reshape(shards, a.shape[0] // shards, *a.shape[1:])
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(axis)))

    def stacked(tree):
        return jax.lax.with_sharding_constraint(
            tree, jax.tree.map(lambda s: NamedSharding(mesh, P(axis, *s.spec)), shardings))

    per = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, 0))

    def body(acc, batch):
        values, grads = per(params, *map(split, batch))
        return jax.tree.map(jnp.add, acc, (values, stacked(grads))), None

    zeros = (jnp.zeros((shards,), jnp.float32),
             stacked(jax.tree.map(lambda p: jnp.zeros((shards, *p.shape), p.dtype), params)))
    (values, grads), _ = jax.lax.scan(body, zeros, (xs, ys))
    n = xs.shape[0] * shards
    return jnp.sum(values) / n, jax.tree.map(lambda g: jnp.sum(g, axis=0) / n, grads)


def _deferred_whole(loss: Callable, mesh: Mesh, axis: str, params, xs, ys):
    """_deferred where every parameter is whole on every device: each device sums its own batch
    shard's micro-batches as one device alone would (shard_map), then one psum. The vmapped form
    made each weight gradient as a batched dot, in the transpose of its parameter's layout, and
    XLA:CPU added it into the sum through a transposing copy, several times one device's add."""
    def local(params, xs, ys):  # params varying: their gradients stay this device's until the psum
        return jax.lax.psum(_summed(loss, programs.varying(params, xs), xs, ys,
                                    start=lambda zeros: programs.varying(zeros, xs)), axis)

    value, grads = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, axis), P(None, axis)),
                                 out_specs=P())(params, xs, ys)
    n = xs.shape[0] * mesh.shape[axis]
    return value / n, jax.tree.map(lambda g: g / n, grads)


@dataclass(frozen=True)
class CompiledStage:
    """A single-stage step compiled on abstract arrays, before anything is placed on a device."""

    compiled: Any
    compile_time: float
    shardings: tuple[Any, Any]  # (params, opt_state)
    batch: NamedSharding
    described: dict[str, Any]
    view: FlatView | None
    optimizer: optax.GradientTransformation


def compile_single_stage(job: Job, plan: Plan, mesh: Mesh, options: EngineOptions | None = None) -> CompiledStage:
    """Shard parameters by the plan's rules, then lower and compile the step on abstract arrays
    (the mesh's devices need not be attached: bench_step compiles for a GPU it only describes)."""
    options = programs.mesh_options(job, mesh, options)
    stage = plan.stages[0]
    abstract, shardings = programs.stage_parameters(job, plan, stage, mesh)
    described = programs.describe_shardings(shardings, programs.gradient_shardings(plan, shardings, abstract))
    loss = loss_fn(job, stage.groups, plan.remat, options)
    flat = options.flat_state and replicated(shardings) and not plan.reduce_scatter
    view = FlatView.of(abstract, options.whole_leaf) if flat else None
    if view is not None:
        abstract, loss = view.abstract(), view.loss(loss)
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    grad_shardings = programs.gradient_shardings(plan, shardings, abstract)
    optimizer = optax.adam(job.training.learning_rate)
    opt_shardings = programs.optimizer_shardings(optimizer, abstract, grad_shardings, mesh)
    batch = programs.batch_sharding(mesh, plan, leading=1)
    grad_fn = accumulate(loss, grad_shardings if plan.reduce_scatter else None, deferred_sync(plan, mesh, shardings))

    def step(params, opt_state, xs, ys):
        loss, grads = grad_fn(params, xs, ys)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = (abstract, jax.eval_shape(optimizer.init, abstract))
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1),
                       out_shardings=(shardings, opt_shardings, NamedSharding(mesh, P()))
                       ).lower(*programs.placed_shapes(state, (shardings, opt_shardings)),
                               *programs.placed_shapes(programs.batch_shapes(job, plan.num_micro_batches), (batch, batch))
                               ).compile()
    return CompiledStage(compiled, time.perf_counter() - start, (shardings, opt_shardings), batch, described,
                         view, optimizer)


def build_single_stage(job: Job, plan: Plan, values: programs.StartingValues = programs.JOB_VALUES,
                       options: EngineOptions | None = None) -> SingleStage:
    """The step compiled first, so a plan that cannot fit fails before anything is allocated on
    the devices; then its starting state and batch placed."""
    stage = plan.stages[0]
    built = compile_single_stage(job, plan, programs.stage_mesh(stage), options)
    memory = programs.compiled_memory(built.compiled)
    programs.ensure_fits(memory)
    params, opt_state = programs.init_state(job, stage, built.optimizer, built.shardings,
                                            built.view.flatten if built.view else None, values.params)
    x, y = values.batch(job, plan.num_micro_batches, built.batch, built.batch)
    return SingleStage(built.compiled, (params, opt_state), x, y, built.compile_time, memory, (built.described,),
                       built.view)


def deferred_sync(plan: Plan, mesh: Mesh, shardings: dict) -> tuple[Mesh, str, dict] | None:
    """accumulate's per_shard where the plan reduces its gradients once per step (Plan.syncs_once)."""
    return (mesh, plan.batch_axis, shardings) if plan.syncs_once(1) and mesh.shape[plan.batch_axis] > 1 else None

