"""A plan in the manual spec's terms: the columns a hand-written plan fills, so a spreadsheet
compares plans the toolkit chose with hand-written ones side by side.

A manual spec says (pp, dp, op) once for all stages; a chosen plan's stages may differ. Where
they do, the column holds a per-stage list in the place that differs, and stays a plain value
where all stages agree:
- `pp_dp_op`: [pp, dp, op]; e.g. [2, [3, 1], 1] is stage 0 on dp 3 and stage 1 on dp 1, op 1 both.
- `physical_mesh_shapes`: each stage's [hosts, devices per host]; one pair when all stages have
  the same, else one per stage (null for a stage with unequal device counts on its hosts).
- `host_ids` / `device_ids`: always filled, exactly as a manual spec lists a placement (per stage,
  its hosts; per stage and host, its local devices, in the stage's (dp, op) device order), so they
  say every stage's devices even where the two columns above cannot.
- `num_auto_layers`: the plan's layer groups over all stages. Which groups each stage took is in
  `all_configs` (the plan's stages), as no column of the manual spec says it.
"""

from __future__ import annotations

import itertools
from typing import Any

from codesign.cost.plan import Plan


def plan_columns(plan: Plan, devices_per_host: int) -> dict[str, Any]:
    """The manual spec's columns (pp_dp_op, physical_mesh_shapes, host_ids, device_ids,
    num_auto_layers, remat_layer) for a plan; devices are numbered host-major."""
    hosts = [_by_host(stage.device_ids, devices_per_host) for stage in plan.stages]
    return {
        "pp_dp_op": [len(plan.stages), _per_stage([s.dp for s in plan.stages]),
                     _per_stage([s.op for s in plan.stages])],
        "physical_mesh_shapes": _per_stage([_shape(h) for h in hosts]),
        "host_ids": [[host for host, _ in stage] for stage in hosts],
        "device_ids": [[local for _, local in stage] for stage in hosts],
        "num_auto_layers": sum(len(s.groups) for s in plan.stages),
        "remat_layer": int(plan.remat),
    }


def _per_stage(values: list[Any]) -> Any:
    """The one value all stages share, else the list of each stage's."""
    return values[0] if all(v == values[0] for v in values) else values


def _by_host(device_ids: tuple[int, ...], per_host: int) -> list[tuple[int, list[int]]]:
    """(host, local device ids) for each run of consecutive devices on one host, in order."""
    return [(host, [d % per_host for d in run])
            for host, run in itertools.groupby(device_ids, key=lambda d: d // per_host)]


def _shape(hosts: list[tuple[int, list[int]]]) -> list[int] | None:
    """[hosts, devices per host] of a stage, or None when its hosts hold unequal shares."""
    sizes = {len(local) for _, local in hosts}
    return [len(hosts), sizes.pop()] if len(sizes) == 1 else None
