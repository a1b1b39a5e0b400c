"""The method registry: name -> config class, and named presets (name -> method + overrides).

The core never names a method: method packages register theirs when imported, and dcache.plugins imports every
package declared under the `dcache.methods` entry point (dcache.schedules is one) at the first lookup. Users register
their own the same way.
"""

from __future__ import annotations

import difflib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

from .config import MethodConfig
from .method_docs import with_args_section
from .plugins import load_method_packages, no_methods_hint

# What dcache.apply(pipe), `dcache generate` and `dcache estimate` run when no method is named: chosen on every
# bundled model (benchmarks/default_choice.py), where it is within 1 dB of the best tuned setting that computes no
# more; its decisions need no calibration (a preset of SeaCache, registered by schedules/seacache.py).
DEFAULT_METHOD = "cadence-2x"

_METHODS: dict[str, type[MethodConfig]] = {}
_PRESETS: dict[str, "Preset"] = {}
_TARGET_RESOLVER: list[Callable[..., Any]] = []  # dcache.apply(speed= / quality=), registered by a method package


@dataclass(frozen=True)
class Preset:
    name: str
    method: str
    overrides: dict[str, Any] = field(default_factory=dict)
    doc: str = ""
    scope: str | None = None  # the scope dcache.apply uses for it when given none ("call": whole calls reused)
    main_knob: tuple[str, tuple] | None = None  # (knob, sweep grid) for speed= / quality=; None: the method's


def register_method(config_cls: type[MethodConfig]) -> type[MethodConfig]:
    """Class decorator: make `config_cls.method` reachable from dcache.apply and the CLI."""
    if not config_cls.method:
        raise ValueError(f"{config_cls.__name__} must set the class attribute `method`.")
    _METHODS[config_cls.method] = config_cls
    return with_args_section(config_cls)  # the docstring gains the knobs' defaults and ranges


def register_preset(name: str, method: str, doc: str = "", *, scope: str | None = None,
                    main_knob: tuple[str, tuple] | None = None, **overrides: Any) -> Preset:
    """A named setting of `method`: its knob `overrides`, and optionally the scope it runs in and its own main knob
    (a preset that fixes the method's main knob sweeps another one for speed= / quality=)."""
    preset = _PRESETS[name] = Preset(name, method, dict(overrides), doc, scope, main_knob)
    return preset


def preset_scope(name: Any) -> str | None:
    """The scope a preset name declares (None for a method name, anything else, or a preset without one)."""
    if not isinstance(name, str):
        return None
    _load_builtins()
    preset = _PRESETS.get(name)
    return None if preset is None else preset.scope


def register_target_resolver(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn(target, method, *, speed, quality, calibration_run, num_steps, scope, overrides) -> (MethodConfig, sweep):
    what dcache.apply runs for a speed= / quality= target (dcache's own sweep is registered by its methods package)."""
    _TARGET_RESOLVER[:] = [fn]
    return fn


def method_class(name: str) -> type[MethodConfig] | None:
    """The config class of a method or preset name (a preset: its method's); None when the name is unknown. What
    the rest of dcache knows of a method it reads from there (`main_knob`, `title`, `calibrator`, ...)."""
    _load_builtins()
    preset = _PRESETS.get(name)
    return _METHODS.get(preset.method if preset is not None else name)


def knob_sweep(method: str) -> tuple[str, tuple] | None:
    """(main knob, its default sweep grid) of a method or preset name, as the method's config class declares it
    (`MethodConfig.main_knob`; a preset: its own `main_knob` if it declares one, else its method's); None when none
    is declared or the name is unknown."""
    config_cls = method_class(method)  # loads the built-in methods and presets
    preset = _PRESETS.get(method)
    if preset is not None and preset.main_knob is not None:
        return preset.main_knob
    return None if config_cls is None else config_cls.main_knob


def method_title(method: str) -> str:
    """The name messages use for a method (`MethodConfig.title`, else the method name)."""
    config_cls = method_class(method)
    return (config_cls.title or config_cls.method) if config_cls is not None else method


def calibrated_methods(kind: str) -> list[str]:
    """The methods whose config declares a calibrator of `kind` ("plan" or "table"; `MethodConfig.calibrator`),
    sorted."""
    _load_builtins()
    return sorted(name for name, cls in _METHODS.items() if cls.calibrator is not None and cls.calibrator[0] == kind)


def calibrator(method: str) -> tuple[str, Callable[..., Any]]:
    """(kind, function) of the calibrator `method` declares, its module imported now; a ValueError naming the
    methods that have one when `method` declares none."""
    config_cls = method_class(method)
    if config_cls is None or config_cls.calibrator is None:
        known = calibrated_methods("table") + calibrated_methods("plan")
        raise ValueError(f"{method!r:.80} has no calibration; choose one of {known}.")
    kind, reference = config_cls.calibrator
    return kind, pkgutil.resolve_name(reference)


def search_seeds() -> dict[str, tuple[str, tuple[dict[str, Any], ...]]]:
    """seed name -> (method, the knob overrides of each seed plan), as the methods declare them
    (`MethodConfig.search_seeds`)."""
    _load_builtins()
    return {seed: (name, tuple(dict(s) for s in settings)) for name, cls in sorted(_METHODS.items())
            for seed, settings in (cls.search_seeds or {}).items()}


def main_knob(method: str) -> str | None:
    """The main knob of `method` (a method or preset name), or None when it has none."""
    entry = knob_sweep(method)
    return entry[0] if entry else None


def target_resolver() -> Callable[..., Any]:
    _load_builtins()
    if not _TARGET_RESOLVER:
        raise RuntimeError(f"no target resolver is registered for speed= / quality=: {no_methods_hint()}")
    return _TARGET_RESOLVER[0]


def _load_builtins() -> None:
    load_method_packages()
    if not _METHODS:
        raise RuntimeError(no_methods_hint())


def methods() -> dict[str, type[MethodConfig]]:
    _load_builtins()
    return dict(_METHODS)


def presets() -> dict[str, Preset]:
    _load_builtins()
    return dict(_PRESETS)


def config_for(name: str, **overrides: Any) -> MethodConfig:
    """The config of a method or preset name, with overrides applied (validated)."""
    _load_builtins()
    if not isinstance(name, str):
        raise TypeError(f"a cache method is named by a str such as 'magcache', not {type(name).__name__} "
                        f"{name!r:.60}; dcache.methods() lists the names.")
    if name in _METHODS:
        return _METHODS[name].with_overrides(**overrides)
    if name in _PRESETS:
        preset = _PRESETS[name]
        return _METHODS[preset.method].with_overrides(**{**preset.overrides, **overrides})
    raise ValueError(f"unknown cache method {name!r:.80}.{_suggest(name, sorted(_METHODS) + sorted(_PRESETS))} "
                     f"Known methods and presets: {', '.join(sorted(_METHODS) + sorted(_PRESETS))}; or pass a plan "
                     f"file (*.json), a config object or a Plan.")


def config_from_dict(data: dict[str, Any]) -> MethodConfig:
    """A config from its JSON object (MethodConfig.to_dict()); the "method" key picks the config class."""
    _load_builtins()
    method = data.get("method") if isinstance(data, dict) else None
    if not isinstance(method, str) or method not in _METHODS:
        got = "no \"method\" key" if method is None else f"method {method!r:.80}"
        hint = _suggest(method, sorted(_METHODS)) if isinstance(method, str) else ""
        raise ValueError(f"a dcache config is a JSON object with a \"method\" key naming one of "
                         f"{', '.join(sorted(_METHODS))}; this one has {got}.{hint} Write configs with "
                         f"dcache.config_for(name, ...).to_json().")
    return _METHODS[method].from_dict(data)


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
