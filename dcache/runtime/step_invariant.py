"""Step-invariant work outside the blocks, computed once per generation instead of once per call.

A block cache removes block compute only; what a transformer call does around its blocks stays. Part of that is the
same at every step: Flux's RoPE tables (`pos_embed(cat[txt_ids, img_ids])`: 3 axes of float64 sin/cos over every
token), Wan's and HunyuanVideo's rotary tables (a function of the latent shape only). On a small model at batch 1
that is about half of what a fully skipped call still costs (bundled tiny Flux: ~0.2 of ~0.4 ms), so it caps the
speed-up of every block cache; on large models it is small but never worth recomputing. The engine memoises such a
module's output when the adapter declares it step-invariant (`Adapter.invariants`):

    Invariant(module, key="inputs")      output = f(the module's own arguments); tensors compared by identity (of
                                         the base tensor for views) and in-place version (the pipeline passes the
                                         same `img_ids` every step; Flux2's pos_embed gets views of them)
    Invariant(module, key="shapes")      output = f(shapes, dtypes and devices of its tensor arguments, values of
                                         the others) (Wan / HunyuanVideo RoPE read hidden_states.shape only)
    Invariant(module, depends_on=(...))  output = f(these transformer-forward arguments), by identity and version
                                         (Flux: pos_embed of an `ids` tensor built inside forward from
                                         `img_ids` / `txt_ids`)

A hit returns the very tensors of the first call (RoPE tables are read, never written: a cached output whose
in-place version changed is recomputed). Exact by construction: a key that matches means the same inputs. No host
sync (identity and version are Python-side), nothing under torch.compile (a compiled graph computes the tables
itself), nothing with grad enabled and nothing under `torch.inference_mode()`: inference tensors carry no in-place
version counter, so a key could not prove that the tensors were not written since (the modules then run every call,
as without dcache; outputs stay bit-identical). The memo keeps the last few keys (Flux2 calls its pos_embed twice per
forward, for image and text ids) and holds references to the keyed tensors, so an id can never be recycled.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..compat.diffusers import original_forward
from ..compat.torch import tensor_version, view_base
from ..model.adapters import Invariant, submodule

_SLOTS = 4  # distinct keys kept per module (e.g. image and text ids, CFG branches with other text lengths)


def _identity(value: Any) -> Any:
    """Key part of one argument compared by identity. A tensor is (its base tensor, in-place version, storage
    offset, shape, stride, dtype): a view taken afresh every call (Flux2's `img_ids[0]`) still matches."""
    if isinstance(value, torch.Tensor):
        if value.is_inference():
            raise _Unversioned
        base = view_base(value)
        root = base if base is not None else value
        return (root, tensor_version(value), value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
    return value


class _Unversioned(Exception):
    """A key tensor is an inference tensor (created under torch.inference_mode): it has no version counter."""


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype, value.device
    return value


def _same(a: tuple, b: tuple) -> bool:
    """Key equality: tensors by identity (never by value: that would be a host sync), the rest by ==."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor):
            if not (isinstance(y, tuple) and len(y) == len(x) and y[0] is x[0] and y[1:] == x[1:]):
                return False
        else:
            try:
                if not bool(x == y):
                    return False
            except Exception:  # values without a plain truth value: not provably the same
                return False
    return True


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class _MemoHook(ModelHook):
    def __init__(self, spec: Invariant, call_args: Callable[[], dict[str, Any] | None]):
        super().__init__()
        self.spec = spec
        self.call_args = call_args  # the current transformer call's arguments by name (depends_on)
        self.entries: list[tuple[tuple, Any, list[tuple[torch.Tensor, int]]]] = []  # (key, output, versions)
        self.hits = 0

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        """A flat tuple of tensor identities (`_identity`) or (shape, dtype, device), kwarg names, plain values."""
        spec = self.spec
        if spec.depends_on:
            bound = self.call_args()
            if bound is None:
                return None
            key = []
            for name in spec.depends_on:  # forward arguments themselves (no views): object and in-place version
                value = bound.get(name)
                if isinstance(value, torch.Tensor) and value.is_inference():
                    return None
                key.append((value, tensor_version(value)) if isinstance(value, torch.Tensor) else value)
            return tuple(key)
        part = _shape if spec.key == "shapes" else _identity
        try:
            key = [part(a) for a in args]
            for name in sorted(kwargs):
                key += [name, part(kwargs[name])]
        except _Unversioned:
            return None
        return tuple(key)

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        forward = original_forward(self)
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return forward(*args, **kwargs)
        key = self._key(args, kwargs)
        if key is None:
            return forward(*args, **kwargs)
        for entry_key, out, versions in self.entries:
            if _same(entry_key, key) and all(tensor_version(t) == v for t, v in versions):
                self.hits += 1
                return out
        out = forward(*args, **kwargs)
        if any(t.is_inference() for t in _tensors(out)):  # no version counter to prove it unwritten later
            return out
        self.entries.insert(0, (key, out, [(t, tensor_version(t)) for t in _tensors(out)]))
        del self.entries[_SLOTS:]
        return out

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.entries.clear()
        return module


def install_memos(transformer: torch.nn.Module, invariants: tuple[Invariant, ...], hook_name: str,
                  call_args: Callable[[], dict[str, Any] | None]) -> list[_MemoHook]:
    """Hook every declared invariant module that exists in `transformer`; returns the hooks (for their hit counts).
    They are removed with the engine's other hooks (same name, recursive removal from the transformer)."""
    hooks = []
    for spec in invariants:
        module = submodule(transformer, spec.module)
        if not isinstance(module, torch.nn.Module):
            continue
        hook = _MemoHook(spec, call_args)
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, hook_name)
        hooks.append(hook)
    return hooks
