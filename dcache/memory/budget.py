"""A cache memory budget: `dcache.apply(pipe, method, budget=dcache.Budget("4GiB"))` (or max_cache_memory="4GiB").

Checked at a generation's first transformer call, against the call's real shapes and before the engine caches
anything: a forward pre-hook (it runs before the engine's own hook) estimates the bytes one branch will hold with
dcache.memory.estimate (the same accounting handle.memory() reports) and projects

    projected = bytes per branch x branches,   branches = 2 when the pipeline runs split CFG
                (pipeline.do_classifier_free_guidance, or a second cache_context name), else 1

Over budget, the call is refused with the numbers and the options that fit: the method's forecast order lowered,
a coarser granularity (module -> block -> stack), each estimated the same way. The options are found from the
config's own fields (the one holding the schedule's forecast order, the one choosing its granularity), so no method
is named here, plus the cache storages: host memory (cache_device="cpu", when the model runs on an accelerator)
and the narrower cache dtypes. The estimate runs once per input shape.

The budget counts the compute device's memory: an offloaded cache holds none there between reads (one unit is
copied back at a time). On a CPU, host memory is the compute device's, so offloading saves nothing and is not offered.

fit="auto": over budget, the first storage of FIT_ORDER that fits is switched on before anything is cached (the
engines build their caches at a branch's first call) and named in a CacheFitChoice warning and `handle.fit_choice`.
The order is by accuracy: offloading is exact; bfloat16 keeps 8 exponent bits (no overflow where float16 would) at
a relative error ~1e-4 on the test models; float8 per token then per tensor (~2e-3). Config changes (a lower forecast
order, a coarser unit) change the decisions, so auto never makes them: they stay in the error when nothing fits.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Iterator

from torch import nn

from .report import format_bytes

if TYPE_CHECKING:  # a handle attaches its budget check
    from ..api.handle import Handle

_GRANULARITY_ORDER = ("module", "block", "stack")  # finer (more memory) to coarser


# cache storages fit="auto" tries, most accurate first (the codec fields of dcache.apply)
FIT_ORDER = ({"cache_device": "cpu"}, {"cache_dtype": "bfloat16"},
             {"cache_dtype": "float8_e4m3fn", "cache_scale": "token"},
             {"cache_dtype": "float8_e4m3fn", "cache_scale": "tensor"})
_CODEC_FIELDS = ("cache_dtype", "cache_scale", "cache_device")


class MemoryBudgetError(ValueError):
    """The method's cache would exceed max_cache_memory (raised before anything is cached)."""


class CacheFitChoice(UserWarning):
    """fit="auto" switched the cache storage to fit max_cache_memory (the message says which and the bytes)."""


class BudgetCheck:
    """The budget's forward pre-hook on the transformer (dcache.apply(budget=dcache.Budget(...)) attaches it to its
    handle with handle.attach_budget)."""

    def __init__(self, handle: Handle, pipeline: Any, transformer: nn.Module, limit: int, method: Any, overrides: dict,
                 scope: str | None, fit: str | None = None):
        self.handle, self.pipeline, self.transformer, self.limit = handle, pipeline, transformer, limit
        self.method, self.overrides, self.scope, self.fit = method, overrides, scope, fit
        self.per_branch: dict[tuple, int] = {}  # input shapes -> device bytes of one branch
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
        storages = self._storages(kwargs, branches) if not engine.branches else iter(())
        tried = []
        for fields, n in storages:  # estimated one at a time: fit="auto" stops at the first that fits
            if self.fit == "auto" and n <= self.limit:
                self._switch(fields, n, projected)
                self.per_branch = {}  # estimated again with the new storage
                return
            tried.append((_describe(fields), n))
        options = self._options(kwargs, branches) + tried
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
        """Compute-device bytes one branch will hold (none when offloaded from an accelerator)."""
        from .estimate import estimate

        codec = {k: overrides[k] for k in _CODEC_FIELDS if k in overrides}
        offloaded = codec.pop("cache_device", None) is not None and self._on_accelerator()
        est = estimate(self.transformer, method, kwargs, branches=("cond",), num_steps=2, scope=self.scope,
                       memory_only=True, **{k: v for k, v in overrides.items() if k not in _CODEC_FIELDS}, **codec)
        return 0 if offloaded else est.memory.peak_bytes

    def _on_accelerator(self) -> bool:
        param = next(self.transformer.parameters(), None)
        return param is not None and param.device.type not in ("cpu", "meta")

    def _storages(self, kwargs: dict, branches: int) -> Iterator[tuple[dict, int]]:
        """(codec fields, projected device bytes) of the cache storages in FIT_ORDER that change the current one."""
        current = {k: self.overrides.get(k) for k in _CODEC_FIELDS}
        for fields in FIT_ORDER:
            if "cache_device" in fields and not self._on_accelerator():
                continue  # a CPU's host memory is its device memory: offloading saves nothing
            merged = {**current, **fields}
            if merged == current:
                continue
            overrides = {**self.overrides, **{k: v for k, v in merged.items() if v is not None}}
            try:
                n = self._bytes(self.method, overrides, kwargs) * branches
            except (ValueError, RuntimeError):
                continue
            yield fields, n

    def _switch(self, fields: dict, projected_bytes: int, before: int) -> None:
        """Use the storage `fields` for every engine of the handle (before any branch has built its cache)."""
        from .cache_codec import cache_codec

        self.overrides = {**self.overrides, **fields}
        codec = cache_codec(*(self.overrides.get(k) for k in _CODEC_FIELDS))
        handles = [self.handle, *self.handle.experts.values()]
        for h in handles:
            h.engine.cache_codec = codec
        choice = (f"{_describe(fields)}: the {self.handle.method} cache projects {format_bytes(projected_bytes)} on "
                  f"the device instead of {format_bytes(before)}, within max_cache_memory={format_bytes(self.limit)}")
        self.handle.fit_choice = choice
        warnings.warn(f"dcache: fit='auto' chose {choice}.", CacheFitChoice, stacklevel=2)

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


def _describe(fields: dict) -> str:
    return " ".join(f"{k}={v!r}" for k, v in fields.items())
