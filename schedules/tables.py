"""Calibration tables keyed by model identity: published ones (FLUX.1-dev, ...) and the ones users calibrate.

A model's identity is its transformer class plus the config values that decide its size (block counts, width):
the same class at another size (the bundled tiny FLUX-class model vs FLUX.1-dev) must not share a table.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dcache.plugins import load_method_packages

# Config keys that tell model variants of one class apart.
_SIZE_KEYS = ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "hidden_size",
              "num_transformer_blocks", "depth", "num_blocks", "in_channels", "joint_attention_dim")

_TABLES: dict[tuple[str, str, str], Any] = {}


def model_identity(model: nn.Module) -> str:
    """'Class(k=v,...)' from the size-deciding config values."""
    return identity_from_config(type(model).__name__, dict(getattr(model, "config", {}) or {}))


def identity_from_config(class_name: str, config: dict) -> str:
    """The identity of a model from its class name and config dict (e.g. a config.json, no weights needed)."""
    parts = [f"{k}={config[k]}" for k in _SIZE_KEYS if k in config]
    return f"{class_name}({','.join(parts)})"


def register_table(kind: str, identity: str, table: Any, *, variant: str = "default") -> None:
    """Register e.g. a MagCache ratio table (kind "magcache") for a model identity."""
    _TABLES[(kind, identity, variant)] = table


def lookup_table(kind: str, model: nn.Module, variant: str = "default") -> Any | None:
    load_method_packages()  # and the registrations deferred to the first lookup (the bundled model's tables)
    return _TABLES.get((kind, model_identity(model), variant))


def known_identities(kind: str) -> list[str]:
    load_method_packages()
    return sorted({ident for (k, ident, _v) in _TABLES if k == kind})


def known_variants(kind: str, identity: str) -> list[str]:
    """Variants registered for one identity (e.g. "480p" / "720p" where one architecture has several tables)."""
    load_method_packages()
    return sorted(v for (k, ident, v) in _TABLES if k == kind and ident == identity)
