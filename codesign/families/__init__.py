"""Model families: what every stage asks of a model, answered by its family's modules.

A `[[model]]` table is ZHEN unless it says `family = "transformer"`. Each family is a package
with the same three modules, so the planner, the cost model, the engine and the search never
test which family they hold:

- `counts` (pure): per-layer `Work` and `Gemm`s (codesign.families.work), widths of what a
  layer hands on, parameters and FLOPs, and the widths op must divide;
- `network` (JAX): the Flax layers, their logical axes for op, the synthetic batch and the loss;
- `search` (pure): the family's co-design search space.

This module imports no family until one is asked for, and never JAX.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

PACKAGES = {"zhen": "codesign.zhen", "transformer": "codesign.transformer"}


@functools.cache  # the cost model asks per stage it prices: a lookup, not an import, each time
def _module(family: str, part: str) -> ModuleType:
    return importlib.import_module(f"{PACKAGES[family]}.{part}")


def counts(model: Any) -> ModuleType:
    """The model's family's analytical counts (pure)."""
    return _module(model.family, "counts")


def network(model: Any) -> ModuleType:
    """The model's family's Flax network (imports JAX)."""
    return _module(model.family, "network")
