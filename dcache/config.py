"""Method configs: frozen dataclasses, validated on construction, JSON round-trip with a version.

A method's config class subclasses `MethodConfig`, declares its fields with `knob(...)` (default, allowed range,
what it does), and implements `build(model) -> Schedule`. Validation errors name the field, the value, the
allowed range and what the field does.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from .schedule import Schedule

if TYPE_CHECKING:  # an annotation only: `import dcache` and `dcache methods` do not need torch for it
    from torch import nn

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
    # (field, default grid): the knob that speed= / quality= targets and `dcache estimate` sweep, declared by the
    # method's config class in its own file; None: the method has no single main knob
    main_knob: ClassVar[tuple[str, tuple] | None] = None
    # The name messages use for the method ("BAC", "ERTACache"); "" means the method name itself.
    title: ClassVar[str] = ""
    # (kind, "module:function") of what `dcache calibrate --method <method>` runs; the function lives in the tuning
    # layer (it runs the model), so the reference is a string, imported when a calibration runs (dcache.methods.
    # calibrator). kind "plan": function(target, run_fn, *, num_steps=None, **config overrides) -> Plan, a plan the
    # method's build replays; kind "table": function(target, run_fn, *, path=None) -> dict, a table merged into a
    # calibration file. None: the method has nothing to calibrate.
    calibrator: ClassVar[tuple[str, str] | None] = None
    # A "table" method's check of its calibration-file table (dcache.schedules.calibration_file reads files with
    # it): table -> [(field, what it must be)] for each invalid field, [] when the table is valid.
    check_calibration_table: ClassVar[Callable[[Any], list[tuple[str, str]]] | None] = None
    # Knob values that stand in for what a calibration provides, so that `dcache estimate` can build the method
    # for a bare model config (cache memory and FLOPs do not depend on them; the compute ratio does).
    estimate_placeholder: ClassVar[dict[str, Any] | None] = None
    # Settings of the method that seed a plan search's population (`dcache search --method ecad`): seed name ->
    # the knob overrides of each seed plan (the name is the method's, or a variant such as "magcache-forecast").
    search_seeds: ClassVar[dict[str, tuple[dict[str, Any], ...]] | None] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            self._check_field(f, value)
            if isinstance(value, list):  # JSON gives lists back: store tuples so a round trip compares equal
                object.__setattr__(self, f.name, tuple(value))
        self.check()

    def check(self) -> None:
        """Cross-field checks; raise `self.invalid(...)`."""

    def _check_field(self, f: dataclasses.Field, value: Any) -> None:
        meta = f.metadata
        doc = meta.get("doc", "")
        types = meta.get("types")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if types is None and default is not dataclasses.MISSING and default is not None:
            types = (float, int) if isinstance(default, float) else (type(default),)
        nullable = default is None  # None means "not set" only where that is the default
        if types and not (value is None and nullable) and not (isinstance(value, types) and not (
                isinstance(value, bool) and bool not in types)):
            raise self.invalid(f.name, value, " or ".join(_a(t.__name__) for t in types), doc)
        if not _all_finite(value):  # range checks let NaN through (every comparison is False); JSON has no NaN/inf
            raise self.invalid(f.name, value, "finite (no NaN or infinity)", doc)
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
        f = {f.name: f for f in dataclasses.fields(self)}.get(name)
        default = f.default if f is not None else dataclasses.MISSING
        fix = f" Leave it out to use the default {default!r}." if default is not dataclasses.MISSING else ""
        return ValueError(f"{type(self).__name__}.{name}={_short(value)} is invalid: it must be {allowed}{what}.{fix}")

    def build(self, model: nn.Module) -> Schedule:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "version": CONFIG_VERSION, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MethodConfig":
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}.from_dict needs the JSON object that to_dict() / to_json() write, "
                            f"e.g. {{\"method\": {cls.method!r}, \"version\": {CONFIG_VERSION}, ...}}; got "
                            f"{type(data).__name__}.")
        data = dict(data)
        method = data.pop("method", cls.method)
        version = data.pop("version", CONFIG_VERSION)
        if method != cls.method:
            raise ValueError(f"this config is for method {_short(method)}, not {cls.method!r}; read it with "
                             f"dcache.config_from_dict(data), which picks the method's config class.")
        if type(version) is not int or version != CONFIG_VERSION:  # noqa: E721 - True == 1 must not pass
            raise ValueError(f"config version {_short(version)} is not supported: this dcache reads version "
                             f"{CONFIG_VERSION}. Re-create the config with this dcache (dcache.config_for("
                             f"{cls.method!r}, ...).to_json()) or use the dcache version that wrote it.")
        return cls._from_fields(data)

    @classmethod
    def with_overrides(cls, **overrides: Any) -> "MethodConfig":
        return cls._from_fields(overrides)

    @classmethod
    def _from_fields(cls, overrides: dict[Any, Any]) -> "MethodConfig":
        """cls(**overrides) after naming unknown keys (a file's keys need not even be strings)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names, key=str)
        if unknown:
            close = [c for u in unknown if isinstance(u, str) for c in difflib.get_close_matches(u, names, n=1)]
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{cls.__name__} has no field(s) {', '.join(_short(u) for u in unknown)}.{hint} Its "
                             f"fields are {sorted(names)}.")
        return cls(**overrides)


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: a corrupted file can hold a huge value, the message stays readable."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _all_finite(value: Any) -> bool:
    """No NaN / infinity anywhere in a (nested) field value."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    return True
