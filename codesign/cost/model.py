"""The cost model: seconds per iteration and peak bytes per device of any plan, before compiling.

Pure Python and numpy (no JAX): pricing a plan takes microseconds. Three parts, kept apart:
- the hardware's answers (hardware.device, through Workload.hw): a mixer call at measured rates
  or as its GEMMs, a memory pass, each collective, a transfer, a launch; what devices sharing
  cores add is one implementation of them (hardware.shared_cores);
- feeders: a `Workload` (cost.workload) holds what every plan of one (model, cluster,
  training, micro-batches) shares (per-layer counts from its model family's counts, the device profile, the
  links), and the per-stage
  functions (`stage_compute`, `stage_memory`) price a contiguous range of layers on a (dp, op)
  submesh, so a dynamic program over stage boundaries can call them directly; they also take
  arrays, to price many models at once (planner.fast_pass);
- `estimate(workload, plan)`: the whole plan. pp = 1 is gradient accumulation; pp > 1 is an
  event simulation of exactly the orders the pipeline engine dispatches (cost.timeline);
  its joules from what each device does and how long it idles (cost.power).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from codesign.errors import PlanError
from codesign.cost.formulas import (
    ACCUMULATE_TRAFFIC,
    ADAM_TRAFFIC,
    PARAM_BYTES,
    Compute,
    Estimate,
    Memory,
    StageCost,
    most,
)
from codesign.cost.plan import Plan, StagePlan, make_plan, stage_kind
from codesign.cost.power import Busy, iteration_joules
from codesign.cost.schedule import max_in_flight
from codesign.cost.timeline import simulate
from codesign.cost.workload import Submesh, Workload
from codesign.hardware.device import Devices
from codesign.hardware.profiles import ENCODER_PAIR, LAYER, DeviceProfile, ProfileBook
from codesign.config.loader import LinkSpec
from codesign.config.types import Job, Model
from codesign import families
from codesign.families.work import Gemm, Work
# Recorded on every attempt beside its prediction: bump it with every change to what the model predicts.
COST_MODEL_VERSION = "2026.11.29.1"
# The block-folded DOT's kernel traffic per call, in kernel-sized fp32 arrays: the forward reads
# the kernel and its mirror to fold the rows (and writes them); the backward writes the folded
# gradient's zero-filled square, reads it and its mirror and writes the kernel's gradient.
FOLD_FORWARD, FOLD_BACKWARD = 3, 4
# A layer's traffic is its forward's once and its backward's three times; remat adds a forward's.
REMAT_TRAFFIC = 5 / 4


# -- feeders ---------------------------------------------------------------------------------

def stage_compute(w: Workload, layers: Sequence[int], mesh: Submesh, remat: bool,
                  busy: int) -> tuple[float, float, dict[str, float]]:
    """Seconds of one micro-batch's (forward, backward) through these layers on this submesh,
    with `busy` devices of the cluster computing at once; and the collectives among them."""
    return finish(w.hw, mesh.op, remat, layers_compute(w, layers, mesh, busy))


def layers_compute(w: Workload, layers: Sequence[int], mesh: Submesh, busy: int) -> Compute:
    total = Compute()
    for i in layers:
        total = layer_compute(w, i, mesh, busy, total)
    return total


def layer_compute(w: Workload, i: int, mesh: Submesh, busy: int, into: Compute = Compute()) -> Compute:
    """Layer i's share of stage_compute, added to `into`.

    Batch on dp: each device takes micro_batch/dp samples; the "mlp" half of the work is split
    over op, and each sharded mixer all-reduces its output over op (forward and backward).
    Batch on op: each device takes micro_batch/op samples of all the work; the sharded weights
    are all-gathered over op and their gradients reduce-scattered."""
    hw = w.hw
    share, fixed_at = hw.share(busy), hw.fixed_share(busy, mesh.op)
    samples = w.micro_batch / mesh.batch_shards
    split = mesh.op if mesh.batch_axis == "dp" else 1
    fwd, bwd, fixed, overheads, comm = into.forward, into.backward, into.fixed, into.overheads, into.communication
    moved = into.traffic
    for kind, work in w.mixers[i]:
        if work.sharded_flops and mesh.op > 1:
            collective, seconds = op_collective(w, work, samples, mesh)
            comm[collective] += seconds
    for kind, work, gemms in engine_calls(w.mixers[i], w.gemms[i] if w.gemms else None):
        forward, backward, call = hw.mixer(kind, w.precision, work, gemms, samples, split, share, fixed_at)
        traffic = hw.activations(samples * w.activation_bytes * _split(work, split), share)
        fold = hw.memory(work.fold_kernel * PARAM_BYTES / mesh.op, share)
        fwd += forward + traffic + FOLD_FORWARD * fold
        bwd += backward + 3 * traffic + FOLD_BACKWARD * fold
        moved += 4 * traffic + (FOLD_FORWARD + FOLD_BACKWARD) * fold
        fixed += call
        overheads += 3 * call  # the forward's call, the backward's two
    own = w.own[i]
    forward, backward, call = hw.mixer(LAYER, w.precision, own, w.own_gemms[i] if w.own_gemms else (), samples, 1,
                                       share, fixed_at, backward_calls=1)
    traffic = hw.memory(samples * own.activations * w.activation_bytes, share)
    fwd += forward + traffic
    bwd += backward + 3 * traffic
    fixed += call
    overheads += 2 * call
    return Compute(fwd, bwd, fixed, overheads, comm["op all-reduce"], comm["op all-gather"], moved + 4 * traffic)


def finish(hw: Devices, op: int, remat: bool, c: Compute) -> tuple[Any, Any, dict[str, Any]]:
    """A stage's (forward, backward, collectives) from its layers' sum: op's collectives, half in
    each direction, and the compute slowed by lockstep where there are any; with remat the
    backward recomputes the forward."""
    collectives = c.all_reduce + c.all_gather
    slow = _where(collectives > 0, hw.lockstep(op), 1.0)
    half = c.all_reduce / 2 + c.all_gather / 2
    fwd, bwd = slow * c.forward + half, slow * c.backward + half
    if remat:
        bwd += fwd - hw.remat_fixed(slow * c.fixed)
    return fwd, bwd, c.communication


def _where(condition, yes, no):
    """`yes if condition else no`, elementwise where the condition is an array."""
    return np.where(condition, yes, no) if isinstance(condition, np.ndarray) else (yes if condition else no)



def engine_calls(mixers: Sequence[tuple[str, Work]], gemms: Sequence[tuple[Gemm, ...]] | None = None
                 ) -> list[tuple[str, Work, tuple[Gemm, ...]]]:
    """A layer's mixers as the engine calls them, with their matmuls: its ATTENTION mixers'
    encoders as one encoder vmapped over their stacked weights (network.ZhenBlock._encoded), one
    call of their summed work with one set of fixed costs, priced as a pair (ENCODER_PAIR) where
    there are several; the others one call each."""
    gemms = gemms or [()] * len(mixers)
    attention = [(work, g) for (kind, work), g in zip(mixers, gemms) if kind == "ATTENTION"]
    calls = [(kind, work, g) for (kind, work), g in zip(mixers, gemms) if kind != "ATTENTION"]
    if not attention:
        return calls
    kind = ENCODER_PAIR if len(attention) > 1 else "ATTENTION"
    works, shapes = zip(*attention)
    return calls + [(kind, sum(works[1:], works[0]), sum(shapes, ()))]


def _split(work: Work, op: int) -> float:
    """Activation elements per sample one device keeps when the sharded ones are split over op."""
    return work.activations - work.sharded_activations + work.sharded_activations / op


def op_collective(w: Workload, work: Work, samples: float, mesh: Submesh,
                  calls: Any = 1) -> tuple[str, Any]:
    """An op-sharded mixer's collectives per micro-batch (forward and backward); or of `calls`
    such mixers, `work` holding their sum."""
    if mesh.batch_axis == "dp":
        out = samples * work.reduced * w.activation_bytes
        return "op all-reduce", 2 * w.collective("all-reduce", out, mesh.op_group, calls)
    weights = work.sharded_params * PARAM_BYTES
    return "op all-gather", (w.collective("all-gather", weights, mesh.op_group, calls)
                             + w.collective("reduce-scatter", weights, mesh.op_group, calls))


def stage_params(w: Workload, layers: Sequence[int], op: int) -> float:
    """Parameters one device of the stage holds: the "mlp"-sharded ones split over op."""
    return sum(w.layers[i].params - w.layers[i].sharded_params + w.layers[i].sharded_params / op
               for i in layers)


def stage_grads(w: Workload, layers: Sequence[int], mesh: Submesh, zero: bool) -> Any:
    """Gradient bytes one device keeps (and accumulates): 1/dp of them under ZeRO-2."""
    params = stage_params(w, layers, mesh.op) * PARAM_BYTES
    return params / mesh.dp if zero else params


def gradient_sync(w: Workload, layers: Sequence[int], mesh: Submesh, zero: bool, busy: int) -> tuple[str, float]:
    """The gradient collective over dp (or over op when the batch is on op): once per step where
    the plan syncs once (Plan.syncs_once), else at the end of each micro-batch's backward (one
    all-reduce of all the gradients: XLA's combiner makes it a single tuple all-reduce). Under
    ZeRO-2 a GPU reduce-scatters; XLA:CPU all-reduces there too, then slices each array to the
    device's shard (read and written through the shared memory). XLA:CPU also copies (and
    transposes) the gradients around its all-reduce: profile.shared.sync_traffic of them through the
    memory system every busy device shares."""
    nbytes = stage_params(w, layers, mesh.op) * PARAM_BYTES
    group = mesh.dp_group if mesh.batch_axis == "dp" else mesh.op_group
    calls = w.collective_calls(layers)
    sharded = zero and mesh.batch_axis == "dp" and mesh.dp > 1
    if sharded and w.profile.combines_collectives:
        return "dp reduce-scatter", w.collective("reduce-scatter", nbytes, group, calls)
    seconds = w.collective("all-reduce", nbytes, group, calls)
    if len(group) > 1:
        seconds += w.hw.copies(w.profile.shared.sync_traffic * nbytes, busy)
    if sharded:
        seconds += w.hw.copies(2 * nbytes / mesh.dp, busy)
    return f"{mesh.batch_axis} all-reduce", seconds


def stage_update(w: Workload, layers: Sequence[int], mesh: Submesh, zero: bool,
                 busy: int) -> tuple[float, float]:
    """Adam's step on the stage: (seconds, of which the ZeRO-2 parameter all-gather). Under ZeRO-2
    each device updates its shard and the parameters are all-gathered over dp: one combined
    collective on a GPU; on XLA:CPU one per array, each a rendezvous of its devices as dear as
    that array's all-reduce (2 to 8 virtual devices: 0.7-1.6x its time per array), with the
    same copies through the shared memory."""
    param_bytes = stage_params(w, layers, mesh.op) * PARAM_BYTES
    share = w.hw.memory_share(busy)
    if not zero or mesh.dp == 1:
        return w.hw.memory(ADAM_TRAFFIC * param_bytes, share), 0.0
    calls = w.collective_calls(layers)
    if w.profile.combines_collectives:
        gather = w.collective("all-gather", param_bytes, mesh.dp_group, calls)
    else:
        gather = (w.collective("all-reduce", param_bytes, mesh.dp_group, calls)
                  + w.hw.copies(w.profile.shared.sync_traffic * param_bytes, busy))
    return w.hw.memory(ADAM_TRAFFIC * param_bytes / mesh.dp, share) + gather, gather


def stage_memory(w: Workload, layers: Sequence[int], groups: Sequence[Sequence[int]], mesh: Submesh,
                 remat: bool, zero: bool, in_flight: int, data_samples: tuple[bool, bool],
                 fused: bool = True) -> Memory:
    """Peak bytes per device of a stage: fp32 parameters, gradients and Adam's two moments
    (gradients and moments 1/dp under ZeRO-2), `in_flight` micro-batches' residuals (with remat,
    only each group's input carry), and workspace: the batch data the first (inputs) and last
    (targets) stage hold, plus scratch: one layer's backward working set or the update's scratch,
    whichever is larger (the update runs after the backward has freed the activations; a
    pipeline stage runs it apart), and, accumulating micro-batches or reducing under ZeRO-2, the
    whole gradients of a micro-batch beside the accumulator (or, under ZeRO-2, beside their
    shard); a pipeline stage's backward holds them beside the accumulated ones. Residuals and the
    working set are counted as XLA:CPU keeps them, times the profile's activation_share."""
    params = stage_params(w, layers, mesh.op) * PARAM_BYTES
    grads = stage_grads(w, layers, mesh, zero)
    samples = w.micro_batch / mesh.batch_shards
    split = mesh.op if mesh.batch_axis == "dp" else 1
    per_layer = {i: samples * w.activation_bytes * (_split(w.layers[i], split) + (0 if fused else w.layers[i].relu / split))
                 for i in layers}
    carry = {i: samples * w.activation_bytes * _carry_in(w.model, i) for i in layers}
    # The block-folded DOT (fold_dot): its folded rows, a residual of each micro-batch when a
    # stage's forward hands its residuals out of the program (pp > 1); with its gradient's
    # zero-filled square and the unfolded kernel gradient (two fp32 kernels), the backward's scratch.
    rows = {i: w.layers[i].fold_rows / mesh.op * w.activation_bytes for i in layers}
    folded = {i: 0.0 if fused else rows[i] for i in layers}
    backward = {i: rows[i] + 2 * w.layers[i].fold_kernel / mesh.op * PARAM_BYTES for i in layers}
    if remat:
        kept = sum(carry[g[0]] for g in groups)
        working = most(sum(per_layer[i] for i in g) + most(backward[i] for i in g) for g in groups)
    else:
        kept = sum(per_layer.values()) + carry[layers[0]] + sum(folded.values())
        working = most(per_layer[i] + backward[i] for i in layers)
    kept, working = (w.profile.activation_share * x for x in (kept, working))
    first, last = data_samples
    counts = families.counts(w.model)
    data = (w.global_batch / mesh.batch_shards) * 4 * (
        (counts.input_width(w.model) if first else 0) + (counts.output_width(w.model) if last else 0))
    activations = in_flight * kept
    update = w.profile.update_scratch * grads
    # A micro-batch's gradients as the backward computes them (whole, before any reduction),
    # beside the ones kept: the accumulated sum, or under ZeRO-2 their shard.
    local = params if (zero and mesh.dp > 1) or w.micro_batches > 1 else 0.0
    if fused:  # the update runs once the backward has freed the activations
        scratch = most((working, update - activations)) + local
    else:  # a stage's backward program computes a micro-batch's gradients, then adds them to the sum
        scratch = most((working + params, update))
    return Memory(params=params, grads=grads, adam=2 * grads, activations=activations, workspace=data + scratch)


def _carry_in(m: Model, i: int) -> int:
    counts = families.counts(m)
    return counts.input_width(m) if i == 0 else counts.carry_width(m, i - 1)


# -- the whole plan --------------------------------------------------------------------------

def estimate(w: Workload, plan: Plan) -> Estimate:
    """Price a plan (any stages, each with its own layers, devices, dp and op)."""
    pp, micro = len(plan.stages), plan.num_micro_batches
    busy = sum(len(s.device_ids) for s in plan.stages)
    stages = [plan_stage(w, plan, s, busy) for s in range(pp)]
    comm: dict[str, float] = {}
    for stage in stages:
        for kind, seconds in stage.communication.items():
            comm[kind] = comm.get(kind, 0.0) + seconds
    if pp == 1:
        seconds, bubble = one_program(w, plan, stages[0], busy), 0.0
    else:  # each stage at its own devices' speed, unless the devices share cores with the others
        alone = stages if not w.hw.shares_cores else [
            plan_stage(w, plan, s, len(stage.device_ids)) for s, stage in enumerate(plan.stages)]
        ends, pipeline_end, comm["stage transfers"], host = simulate(w, plan, alone)
        seconds = max(max(ends), w.hw.pipeline_floor(plan, stages, busy, host))
        bubble = max(0.0, pipeline_end - max(micro * (s.forward + s.backward) for s in alone))
    peak = max((s.memory for s in stages), key=lambda m: m.total)
    busy = tuple(stage_busy(plan, s, c, seconds if pp == 1 else None)
                 for s, c in zip(plan.stages, stages if pp == 1 else alone))
    devices = w.cluster.num_devices
    return Estimate(seconds=seconds, compute=tuple(micro * (s.forward + s.backward) for s in stages),
                    communication={k: v for k, v in comm.items() if v}, bubble=bubble,
                    optimizer=max(s.update for s in stages), memory=peak, device_memory=w.profile.memory,
                    energy=iteration_joules(w.hw, busy, seconds, devices), busy=busy, devices=devices)


def stage_busy(plan: Plan, stage: StagePlan, cost: StageCost, one_program_seconds: Any = None) -> Busy:
    """What the stage's devices do in an iteration (cost.power): its work (a single program:
    the step's seconds), less its collectives and its memory-bound seconds, is compute-bound."""
    work = plan.num_micro_batches * (cost.forward + cost.backward) + cost.update
    if one_program_seconds is not None:
        work = np.minimum(work, one_program_seconds)
    talk = sum(cost.communication.values())
    memory = np.minimum(cost.memory_bound, work - talk)
    return Busy(len(stage.device_ids), np.maximum(work - talk - memory, 0.0), memory, talk)


def plan_stage(w: Workload, plan: Plan, index: int, busy: int) -> StageCost:
    """stage_cost of the plan's stage `index`, kept in w.stage_costs under all that it reads."""
    key = (plan.stages[index], index, len(plan.stages), busy, plan.num_micro_batches, plan.batch_axis,
           plan.remat, plan.reduce_scatter, plan.schedule)
    if key not in w.stage_costs:
        w.stage_costs[key] = stage_cost(w, plan.stages[index], index, plan, busy)
    return w.stage_costs[key]


def one_program(w: Workload, plan: Plan, only: StageCost, busy: int) -> Any:
    """pp = 1: one program's launch, each micro-batch's forward and backward (the fixed costs a
    fused step pays once counted once, Devices.program_overheads), then the update."""
    repeated = (plan.num_micro_batches - 1) * w.hw.program_overheads(only.overheads)
    return w.hw.call_cost(busy) + plan.num_micro_batches * (only.forward + only.backward) - repeated + only.update


def stage_cost(w: Workload, stage: StagePlan, index: int, plan: Plan, busy: int, pp: int | None = None,
               in_flight: int | None = None, compute: Compute | None = None, peak: bool = True) -> StageCost:
    """Stage `index` of a pp-stage pipeline (default: the plan's length), holding in_flight
    micro-batches (default: as its schedule does). The plan gives the plan-wide choices
    (micro-batches, batch axis, remat, ZeRO-2, schedule); a search prices a stage before the
    other stages exist by passing pp and a plan of no stages; `compute`, its layers' sum where
    it was priced by composition (planner.fast_pass), replaces pricing them here; peak=False
    leaves the peak bytes unpriced (but the gradients, which accumulating reads), for callers
    that read only its seconds."""
    pp = len(plan.stages) if pp is None else pp
    mesh = Submesh.of(stage, plan.batch_axis)
    compute = compute or layers_compute(w, stage.layers, mesh, busy)
    fwd, bwd, comm = finish(w.hw, mesh.op, plan.remat, compute)
    sync_kind, sync = gradient_sync(w, stage.layers, mesh, plan.reduce_scatter, busy)
    update, gather = stage_update(w, stage.layers, mesh, plan.reduce_scatter, busy)
    micro = plan.num_micro_batches
    if in_flight is None:
        in_flight = 1 if pp == 1 else max_in_flight(plan.schedule, pp, index, micro)
    if not peak:
        memory = Memory(grads=stage_grads(w, stage.layers, mesh, plan.reduce_scatter))
    else:
        memory = stage_memory(w, stage.layers, stage.groups, mesh, plan.remat, plan.reduce_scatter, in_flight,
                              (index == 0, index == pp - 1), fused=pp == 1)
    if peak and pp > 1 and index > 0:  # the inputs it holds for each in-flight micro-batch
        held = in_flight * w.micro_batch / mesh.batch_shards * w.activation_bytes * _carry_in(w.model, stage.layers[0])
        memory = Memory(memory.params, memory.grads, memory.adam, memory.activations + held, memory.workspace)
    once = plan.syncs_once(pp)  # after the last micro-batch, else in each one's backward
    communication = {k: micro * v for k, v in comm.items()}
    communication[sync_kind] = communication.get(sync_kind, 0.0) + (1 if once else micro) * sync
    if np.any(gather):
        communication["dp all-gather (ZeRO-2)"] = gather
    accumulate = 0.0 if micro == 1 else w.hw.memory(ACCUMULATE_TRAFFIC * memory.grads, w.hw.memory_share(busy))
    traffic = (REMAT_TRAFFIC if plan.remat else 1.0) * compute.traffic + compute.overheads
    memory_bound = micro * (traffic + accumulate) + update - gather
    cost = (StageCost(fwd, bwd + accumulate, update + sync, communication, memory, compute.overheads, memory_bound)
            if once else
            StageCost(fwd, bwd + sync + accumulate, update, communication, memory, compute.overheads, memory_bound))
    layer = w.profile.calibration
    return cost.calibrated(layer.time_factor(stage_kind(pp, mesh.dp, mesh.op, micro)), layer.memory_factor)


def predict(job: Job, book: ProfileBook, links: Iterable[LinkSpec] = ()) -> dict[str, object]:
    """What an attempt records before anything is compiled: predicted_time (seconds per
    iteration), predicted_memory (peak bytes per device) and the breakdown; {} for a plan the
    engine would reject (Auto search included, until it chooses a plan)."""
    try:
        plan = make_plan(job)
    except PlanError:
        return {}
    profile = book.for_job(job)
    return recorded(estimate(Workload.of(job, profile, links), plan), profile)


def recorded(found: Estimate, profile: DeviceProfile) -> dict[str, object]:
    """An estimate as an attempt records it: predicted_time, predicted_memory, the breakdown."""
    energy = None if np.isnan(found.energy) else float(found.energy)
    return {"predicted_time": found.seconds, "predicted_memory": found.peak_bytes, "predicted_energy": energy,
            "prediction": {**found.breakdown(), "device_kind": profile.kind, "profile": profile.source}}

