"""A method's documentation from its config class: the class docstring (what it does, the paper, when to use it,
an example) followed by an `Args:` section generated from the knobs (default, allowed range, meaning), so the
ranges in the docs are the ones validation enforces.

    summary(MagCacheConfig)   -> "MagCache: skip whole steps while ..."     (the docstring's first line)
    describe(MagCacheConfig)  -> the full text (`dcache methods magcache`, help(MagCacheConfig))
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

ARGS_HEADER = "Args:"


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _range(meta: dict) -> str:
    if meta.get("choices") is not None:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    low, high = meta.get("low"), meta.get("high")
    if low is None and high is None:
        return ""
    return f"{'-inf' if low is None else f'{low:g}'} to {'inf' if high is None else f'{high:g}'}"


def args_section(config_cls: type) -> str:
    """`Args:` with one entry per knob: name (default; range): meaning."""
    lines = [ARGS_HEADER]
    for field in dataclasses.fields(config_cls):
        meta = dict(field.metadata)
        facts = "; ".join(part for part in [f"default {_default(field)!r}", _range(meta)] if part)
        lines.append(f"    {field.name} ({facts}): {meta.get('doc') or 'see the method'}")
    return "\n".join(lines)


def _own_doc(config_cls: type) -> str:
    """The class's hand-written docstring, without a generated Args section (and without dataclass's signature
    stand-in when the class has none)."""
    doc = config_cls.__dict__.get("__doc__") or ""
    if doc.startswith(config_cls.__name__ + "("):  # dataclass's default: the signature, not documentation
        return ""
    doc = inspect.cleandoc(doc)
    return doc.split("\n" + ARGS_HEADER + "\n", 1)[0].rstrip()


def summary(config_cls: type) -> str:
    """One line: the docstring's first line, or the first line of the module's docstring."""
    doc = _own_doc(config_cls)
    if not doc:
        module = inspect.getmodule(config_cls)
        doc = inspect.cleandoc(module.__doc__ or "") if module else ""
    return doc.splitlines()[0] if doc else config_cls.__name__


def describe(config_cls: type, presets: dict | None = None) -> str:
    """The full text: docstring, generated Args, and the presets built on the method."""
    parts = [_own_doc(config_cls) or summary(config_cls), args_section(config_cls)]
    mine = sorted((name, p) for name, p in (presets or {}).items() if p.method == config_cls.method)
    if mine:
        parts.append("Presets:\n" + "\n".join(f"    {name}: {p.doc or ''} {p.overrides}".rstrip()
                                              for name, p in mine))
    return "\n\n".join(parts)


def with_args_section(config_cls: type) -> type:
    """Append the generated Args section to the class docstring (help() and IDEs show the ranges)."""
    own = _own_doc(config_cls)
    if own:
        config_cls.__doc__ = own + "\n\n" + args_section(config_cls) + "\n"
    return config_cls
