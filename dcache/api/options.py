"""`dcache.apply`'s grouped options: small frozen, validated objects, one per concern.

    dcache.apply(pipe, "taylorseer",
                 storage=dcache.Storage(dtype="bfloat16", device="cpu"),      # how the cache keeps its tensors
                 budget=dcache.Budget("8GiB", fit="auto"),                    # how much device memory it may hold
                 models=dcache.Models(experts={"transformer_2": None}, controlnet="follow"))  # what else is cached

Each group is checked when it is built: a bad field is a ValueError naming the group, the field and the fix. The
flat keywords (`cache_dtype=`, `cache_scale=`, `cache_device=`, `max_cache_memory=`, `fit=`, `experts=`,
`controlnet=`) are the shorthand for one field each; `options_of` folds them into their groups, and giving a field
both ways is refused. No torch or diffusers at import: the checks import what they need when they run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

# flat keyword of dcache.apply -> (group, field)
SHORTHANDS = {"cache_dtype": ("storage", "dtype"), "cache_scale": ("storage", "scale"),
              "cache_device": ("storage", "device"), "max_cache_memory": ("budget", "max_memory"),
              "fit": ("budget", "fit"), "experts": ("models", "experts"), "controlnet": ("models", "controlnet")}
# dcache.apply's keywords for a speed / quality target (dcache.tune's, passed through)
TARGET_KEYWORDS = ("speed", "quality", "calibration_run")


def _invalid(group: str, name: str, value: Any, problem: str, fix: str) -> ValueError:
    return ValueError(f"dcache.{group}: {name}={value!r:.80} {problem}; {fix}.")


class _Group:
    """What the three groups share: their set fields as a dict, and their flat shorthand names."""

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (not None), as a setup file holds them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}  # type: ignore[arg-type]

    def shorthand(self) -> dict[str, Any]:
        """The set fields under dcache.apply's flat keywords, e.g. {"cache_dtype": "bfloat16"}."""
        group = type(self).__name__.lower()
        names = {field: flat for flat, (g, field) in SHORTHANDS.items() if g == group}
        return {names[k]: v for k, v in self.to_dict().items()}


@dataclass(frozen=True)
class Storage(_Group):
    """How the cache keeps its tensors (dcache.memory.cache_codec).

    dtype:  "bfloat16", "float16" or "float8_e4m3fn" (restored to the compute dtype on use); None: the compute dtype.
    scale:  float8 only: "tensor" (default) or "token", the fp32 absmax scale stored beside each tensor.
    device: "cpu": host memory (pinned; on CUDA the next unit is copied back on a side stream), exact bit for bit;
            None: the compute device."""

    dtype: str | None = None
    scale: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        from ..memory.cache_codec import CACHE_DEVICES, CACHE_DTYPES, CACHE_SCALES

        dtype = self.dtype
        if dtype is not None and not isinstance(dtype, str) and type(dtype).__name__ == "dtype":  # a torch.dtype
            dtype = str(dtype).removeprefix("torch.")
            object.__setattr__(self, "dtype", dtype)
        if dtype is not None and dtype not in CACHE_DTYPES:
            raise _invalid("Storage", "dtype", dtype, "is not a cache dtype",
                           f"use one of {', '.join(map(repr, CACHE_DTYPES))} or None (the compute dtype)")
        if self.scale is not None and dtype != "float8_e4m3fn":
            raise _invalid("Storage", "scale", self.scale, "needs dtype='float8_e4m3fn'",
                           "a scale is what an 8-bit cache stores beside each tensor: set the dtype or drop scale")
        if self.scale is not None and self.scale not in CACHE_SCALES:
            raise _invalid("Storage", "scale", self.scale, "is not a scale",
                           f"use one of {', '.join(map(repr, CACHE_SCALES))} (one absmax per tensor or per token)")
        device = str(self.device) if self.device is not None else None
        if device is not None and device not in CACHE_DEVICES:
            raise _invalid("Storage", "device", self.device, "is not a cache device",
                           f"use {', '.join(map(repr, CACHE_DEVICES))} (host memory) or None (the compute device)")
        object.__setattr__(self, "device", device)

    def codec(self) -> Any:
        """The engine's cache codec for this storage (None: the compute dtype on the compute device)."""
        from ..memory.cache_codec import cache_codec

        return cache_codec(self.dtype, self.scale, self.device)


@dataclass(frozen=True)
class Budget(_Group):
    """A budget for the cached tensors on the compute device (dcache.memory.budget).

    max_memory: e.g. "4GiB", "512MB" or a number of bytes; checked at a generation's first call against its real
                shapes, before anything is cached; over budget the call raises MemoryBudgetError with the numbers
                and the config changes that fit.
    fit:        "auto": over budget, switch to the most accurate cache storage that fits (host memory, then
                bfloat16, then float8 per token, then per tensor) and say which (handle.fit_choice); None: refuse."""

    max_memory: str | int | float
    fit: str | None = None

    def __post_init__(self) -> None:
        from ..memory.report import parse_bytes

        try:
            parse_bytes(self.max_memory, "max_memory")
        except ValueError as exc:
            raise ValueError(f"dcache.Budget: {exc}") from None
        if self.fit not in (None, "auto"):
            raise _invalid("Budget", "fit", self.fit, "is not a fit mode", "use fit='auto' to let dcache pick a "
                           "cache storage that fits the budget, or leave it out (None) to be refused over budget")

    @property
    def limit(self) -> int:
        """max_memory in bytes."""
        from ..memory.report import parse_bytes

        return parse_bytes(self.max_memory, "max_memory")


_EXPERT_SETTINGS = "a dict of knobs, a method name, a config, a Plan, a plan path, or None (uncached)"


@dataclass(frozen=True)
class Models(_Group):
    """The pipeline's models besides `pipe.transformer` that are cached too.

    experts:    pipelines with a second denoising transformer (Wan 2.2's `transformer_2`, dcache.api.experts) cache
                it with the same method by default; per expert: {"transformer_2": {"warmup_steps": 2}} (knobs on
                top), {"transformer_2": "fbcache"} (another method, config, Plan or plan file) or
                {"transformer_2": None} (uncached).
    controlnet: ControlNet pipelines (dcache.api.controlnet; off by default): "follow" (the transformer's schedule
                decides), a method name, or {"method": "fixed_interval", "interval": 3} (its own schedule)."""

    experts: dict[str, Any] | None = None
    controlnet: Any = None

    def __post_init__(self) -> None:
        experts = self.experts
        if experts is None:
            return
        if not isinstance(experts, dict):
            raise _invalid("Models", "experts", experts, "is not a dict",
                           'give a setting per expert name, e.g. experts={"transformer_2": {"warmup_steps": 2}}')
        for name, setting in experts.items():
            if not isinstance(name, str):
                raise _invalid("Models", "experts", experts, "has a key that is not a name",
                               "name each expert by its pipeline component, e.g. 'transformer_2'")
            if setting is not None and not isinstance(setting, (str, dict, os.PathLike)) and \
                    not hasattr(setting, "build") and not hasattr(setting, "decide") and \
                    type(setting).__name__ != "Plan":
                raise _invalid("Models", f"experts[{name!r}]", setting, "is not an expert setting",
                               f"give {_EXPERT_SETTINGS}")


GROUPS = {"storage": Storage, "budget": Budget, "models": Models}


@dataclass(frozen=True)
class Options:
    """dcache.apply's groups, shorthands folded in, and what is left: the method's config fields and a target."""

    storage: Storage
    budget: Budget | None
    models: Models
    knobs: dict[str, Any]
    target: dict[str, Any]  # speed / quality / calibration_run as given (empty: no target)


def options_of(storage: Storage | None, budget: Budget | None, models: Models | None,
               keywords: dict[str, Any]) -> Options:
    """The groups given to dcache.apply with the flat shorthands among `keywords` folded in (a field given both
    ways is refused); the other keywords are config fields, or a speed / quality target."""
    given = {"storage": storage, "budget": budget, "models": models}
    for name, value in given.items():
        if value is not None and not isinstance(value, GROUPS[name]):
            raise TypeError(f"{name}={value!r:.80} must be a dcache.{GROUPS[name].__name__}, e.g. "
                            f"{name}=dcache.{GROUPS[name].__name__}(...); or use the flat shorthand keywords "
                            f"({', '.join(k for k, (g, _) in SHORTHANDS.items() if g == name)}).")
    fields_of: dict[str, dict[str, Any]] = {name: (g.to_dict() if g is not None else {}) for name, g in given.items()}
    knobs, target = {}, {}
    for key, value in keywords.items():
        if key in TARGET_KEYWORDS:
            if value is not None:
                target[key] = value
        elif key in SHORTHANDS:
            group, field = SHORTHANDS[key]
            if value is None:
                continue
            if given[group] is not None and field in fields_of[group]:
                raise ValueError(f"{key}= and {group}=dcache.{GROUPS[group].__name__}({field}=...) both set "
                                 f"{group}.{field}; give it one way.")
            fields_of[group][field] = value
        else:
            knobs[key] = value
    _check_shorthands(fields_of, {k for k in keywords if k in SHORTHANDS and keywords[k] is not None})
    budget_fields = fields_of["budget"]
    if budget_fields and "max_memory" not in budget_fields:
        raise ValueError("fit='auto' chooses among cache storages that fit max_cache_memory; give the budget too, "
                         "e.g. dcache.apply(pipe, 'taylorseer', budget=dcache.Budget('8GiB', fit='auto')) (or "
                         "max_cache_memory='8GiB', fit='auto').")
    return Options(storage=Storage(**fields_of["storage"]),
                   budget=Budget(**budget_fields) if budget_fields else None,
                   models=Models(**fields_of["models"]), knobs=knobs, target=target)


def _check_shorthands(fields_of: dict[str, dict[str, Any]], flat: set[str]) -> None:
    """Storage and budget values given as flat keywords, checked under those names (the groups' own checks name
    the group's fields)."""
    storage = fields_of["storage"]
    if flat & {"cache_dtype", "cache_scale", "cache_device"}:
        from ..memory.cache_codec import cache_codec

        cache_codec(storage.get("dtype"), storage.get("scale"), storage.get("device"))
    if "max_cache_memory" in flat:
        from ..memory.report import parse_bytes

        parse_bytes(fields_of["budget"]["max_memory"])
