"""Per-unit compute cost, counted from shapes by torch's FlopCounterMode the first time a unit runs on a shape.

Ideal speed-up = (block FLOPs of an uncached call) / (block FLOPs actually computed); module units carry their
own count, taken from the same measurement. Counted once per (unit, input shape) for the engine's lifetime.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


class FlopBook:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.costs: dict[tuple[Any, tuple], float] = {}
        self.by_unit: dict[Any, float] = {}  # last known cost of each unit (any shape)

    def known(self, unit: Any, shape: tuple) -> bool:
        return (unit, shape) in self.costs

    def start(self, unit: Any, shape: tuple) -> FlopCounterMode | None:
        """Open a FLOP counter for `unit` unless its cost is known (or compiling / disabled); pair with `stop`."""
        if not self.enabled or self.known(unit, shape) or _compiling():
            return None
        counter = FlopCounterMode(display=False)
        counter.__enter__()
        return counter

    def stop(self, counter: FlopCounterMode | None, unit: Any, shape: tuple | None) -> None:
        """Close a counter from `start`; `unit` None discards the count (the forward raised)."""
        if counter is None:
            return
        counter.__exit__(None, None, None)
        if unit is not None:
            self.costs[(unit, shape)] = float(counter.get_total_flops())
            self.by_unit[unit] = self.costs[(unit, shape)]

    def cost(self, unit: Any, shape: tuple) -> float | None:
        return self.costs.get((unit, shape), self.by_unit.get(unit))


def _compiling() -> bool:
    return bool(getattr(torch, "compiler", None) and torch.compiler.is_compiling())
