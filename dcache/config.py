"""Method configs: frozen dataclasses, validated on construction, JSON round-trip with a version.

A method's config class subclasses `MethodConfig`, declares its fields with `knob(...)` (default, allowed range,
what it does), and implements `build(model) -> Schedule`. Validation errors name the field, the value, the
allowed range and what the field does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from torch import nn

from .schedule import Schedule

CONFIG_VERSION = 1


def knob(default: Any, *, low: float | None = None, high: float | None = None, choices: tuple | None = None,
         doc: str = "", types: tuple[type, ...] | None = None) -> Any:
    """A config field with its allowed range and meaning (kept in dataclass metadata for errors and docs)."""
    meta = {"low": low, "high": high, "choices": choices, "doc": doc, "types": types}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            self._check_field(f, getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """Cross-field checks; raise `self.invalid(...)`."""

    def _check_field(self, f: dataclasses.Field, value: Any) -> None:
        meta = f.metadata
        doc = meta.get("doc", "")
        types = meta.get("types")
        if types is None and f.default is not dataclasses.MISSING and f.default is not None:
            types = (float, int) if isinstance(f.default, float) else (type(f.default),)
        if types and value is not None and not (isinstance(value, types) and not (
                isinstance(value, bool) and bool not in types)):
            raise self.invalid(f.name, value, f"a {' or '.join(t.__name__ for t in types)}", doc)
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise self.invalid(f.name, value, f"one of {list(meta['choices'])}", doc)
        low, high = meta.get("low"), meta.get("high")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (low is not None and value < low) or (high is not None and value > high):
                lo = "-inf" if low is None else low
                hi = "inf" if high is None else high
                raise self.invalid(f.name, value, f"in [{lo}, {hi}]", doc)

    def invalid(self, name: str, value: Any, allowed: str, doc: str = "") -> ValueError:
        what = f" ({doc})" if doc else ""
        return ValueError(f"{type(self).__name__}.{name}={value!r} is invalid: it must be {allowed}{what}.")

    def build(self, model: nn.Module) -> Schedule:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "version": CONFIG_VERSION, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MethodConfig":
        data = dict(data)
        method = data.pop("method", cls.method)
        version = data.pop("version", CONFIG_VERSION)
        if method != cls.method:
            raise ValueError(f"config is for method {method!r}, not {cls.method!r}.")
        if version != CONFIG_VERSION:
            raise ValueError(f"config version {version} is not supported (this dcache reads {CONFIG_VERSION}).")
        return cls.with_overrides(**data)

    @classmethod
    def with_overrides(cls, **overrides: Any) -> "MethodConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {unknown}; its fields are {sorted(names)}.")
        return cls(**overrides)
