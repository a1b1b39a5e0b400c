"""A cache memory budget: `dcache.apply(pipe, method, max_cache_memory="4GiB")`.

Checked at a generation's first transformer call, against the call's real shapes and before the engine caches
anything: a forward pre-hook (it runs before the engine's own hook) estimates the bytes one branch will hold with
dcache.estimate (the same accounting handle.memory() reports) and projects

    projected = bytes per branch x branches,   branches = 2 when the pipeline runs split CFG
                (pipeline.do_classifier_free_guidance, or a second cache_context name), else 1

Over budget, the call is refused with the numbers and the options that fit: the method's forecast order lowered,
a coarser granularity (module -> block -> stack), each estimated the same way. The options are found from the
config's own fields (the one holding the schedule's forecast order, the one choosing its granularity), so no method
is named here. The estimate runs once per input shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .memory import format_bytes

_GRANULARITY_ORDER = ("module", "block", "stack")  # finer (more memory) to coarser


class MemoryBudgetError(ValueError):
    """The method's cache would exceed max_cache_memory (raised before anything is cached)."""


class Budget:
    def __init__(self, handle: Any, pipeline: Any, transformer: nn.Module, limit: int, method: Any, overrides: dict,
                 scope: str | None):
        self.handle, self.pipeline, self.transformer, self.limit = handle, pipeline, transformer, limit
        self.method, self.overrides, self.scope = method, overrides, scope
        self.per_branch: dict[tuple, int] = {}  # input shapes -> bytes of one branch
        self.remove = transformer.register_forward_pre_hook(self._check, with_kwargs=True).remove

    def _check(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        engine = self.handle.engine
        name = engine.tracker.context_name
        if engine.branches and (name is None or name in engine.branches):
            return  # not a branch's first call: its cache exists already and was checked
        key = tuple((k, tuple(v.shape)) for k, v in sorted(kwargs.items()) if hasattr(v, "shape"))
        if key not in self.per_branch:
            self.per_branch[key] = self._bytes(self.method, self.overrides, kwargs)
        branches = max(len(engine.branches) + 1, 2 if getattr(self.pipeline, "do_classifier_free_guidance", False)
                       else 1)
        projected = self.per_branch[key] * branches
        if projected <= self.limit:
            return
        options = self._options(kwargs, branches)
        fits = [f"{what}: {format_bytes(n)}" for what, n in options if n <= self.limit]
        others = [f"{what}: {format_bytes(n)}" for what, n in options if n > self.limit]
        raise MemoryBudgetError(
            f"the {self.handle.method} cache would hold {format_bytes(projected)} ({branches} branch(es) x "
            f"{format_bytes(self.per_branch[key])}) at these shapes, over max_cache_memory="
            f"{format_bytes(self.limit)}; nothing was cached. "
            + (f"Options that fit: {'; '.join(fits)}." if fits else "No option of this method fits.")
            + (f" Over budget too: {'; '.join(others)}." if others else "")
            + " Or raise max_cache_memory, lower the resolution / batch, or pick a method that caches less "
              "(`dcache estimate --cache all` lists them).")

    def _bytes(self, method: Any, overrides: dict, kwargs: dict) -> int:
        from .estimate import estimate

        est = estimate(self.transformer, method, kwargs, branches=("cond",), num_steps=2, scope=self.scope,
                       **overrides)
        return est.memory.peak_bytes

    def _options(self, kwargs: dict, branches: int) -> list[tuple[str, int]]:
        """(description, projected bytes) of the config changes that cache less, found from the config's fields."""
        config = getattr(self.handle.engine.schedule, "config", None)
        if not dataclasses.is_dataclass(config) or not isinstance(self.method, str):
            return []
        schedule = self.handle.engine.schedule
        out = []
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            low = f.metadata.get("low")
            choices = f.metadata.get("choices") or ()
            changes: list[Any] = []
            if isinstance(value, int) and not isinstance(value, bool) and value == schedule.forecast_order \
                    and value > 0 and f.name not in ("probe_blocks", "tail_blocks"):
                changes = [v for v in range(value - 1, -1, -1) if low is None or v >= low]
            elif value in _GRANULARITY_ORDER and set(choices) & set(_GRANULARITY_ORDER):
                start = _GRANULARITY_ORDER.index(value) + 1
                changes = [g for g in _GRANULARITY_ORDER[start:] if g in choices]
            for v in changes:
                try:
                    n = self._bytes(self.method, {**self.overrides, f.name: v}, kwargs) * branches
                except (ValueError, RuntimeError):
                    continue
                out.append((f"{f.name}={v!r}", n))
        return out
