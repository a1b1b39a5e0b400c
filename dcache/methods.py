"""The method registry: name -> config class, and named presets (name -> method + overrides).

The core never names a method; `dcache.schedules` registers them on import. Users register their own the same way.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any

from .config import MethodConfig

_METHODS: dict[str, type[MethodConfig]] = {}
_PRESETS: dict[str, "Preset"] = {}


@dataclass(frozen=True)
class Preset:
    name: str
    method: str
    overrides: dict[str, Any] = field(default_factory=dict)
    doc: str = ""


def register_method(config_cls: type[MethodConfig]) -> type[MethodConfig]:
    """Class decorator: make `config_cls.method` reachable from dcache.apply and the CLI."""
    if not config_cls.method:
        raise ValueError(f"{config_cls.__name__} must set the class attribute `method`.")
    _METHODS[config_cls.method] = config_cls
    return config_cls


def register_preset(name: str, method: str, doc: str = "", **overrides: Any) -> Preset:
    preset = _PRESETS[name] = Preset(name, method, dict(overrides), doc)
    return preset


def _load_builtins() -> None:
    importlib.import_module("dcache.schedules")


def methods() -> dict[str, type[MethodConfig]]:
    _load_builtins()
    return dict(_METHODS)


def presets() -> dict[str, Preset]:
    _load_builtins()
    return dict(_PRESETS)


def config_for(name: str, **overrides: Any) -> MethodConfig:
    """The config of a method or preset name, with overrides applied (validated)."""
    _load_builtins()
    if name in _METHODS:
        return _METHODS[name].with_overrides(**overrides)
    if name in _PRESETS:
        preset = _PRESETS[name]
        return _METHODS[preset.method].with_overrides(**{**preset.overrides, **overrides})
    known = sorted(_METHODS) + sorted(_PRESETS)
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"unknown cache method {name!r}.{hint} Known methods and presets: {', '.join(known)}; "
                     f"or pass a plan file (*.json), a config object or a Plan.")
