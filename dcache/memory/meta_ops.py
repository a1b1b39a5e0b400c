"""Meta-tensor forwards without re-deriving what is already known: every op's output metadata, remembered.

An estimate runs the transformer on meta tensors (dcache.memory.estimate). Torch derives most meta outputs in Python
(the ops' decompositions into prims and their shape rules), ~0.1-1 ms per op, so one meta call of a 40-block,
5120-wide video transformer takes 1.5-2.5 s, and `dcache estimate --cache all` runs two per method. On meta tensors an
op's output is a pure function of its inputs' metadata (shape, stride, dtype, device) and its other arguments: there
are no values. So the second time an op sees the same inputs (the next of 40 identical blocks, the next method),
its outputs are new meta tensors of the remembered shapes and strides, made without running it.

Only functional ops are remembered: an op that writes to an argument (`add_`, `out=`) or returns a view of one
(`view`, `transpose`: cheap, and the caller may rely on the aliasing) always runs, as does any op that sees a tensor
not on the meta device or an argument that cannot be a dictionary key. Another dispatch mode active inside this one
(FlopCounterMode, counting FLOPs from the shapes) still sees every op: modes pushed later handle an op first and reach
this one when they run it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.torch import DispatchMode, op_is_functional


class _Unkeyable(Exception):
    """An argument that cannot be part of a dictionary key: the op runs instead."""


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key_of(value: Any) -> Any:
    """A hashable stand-in for one argument: a meta tensor's metadata, a plain value, or a list / tuple of them."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            raise _Unkeyable
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.requires_grad)
    if value is None or isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key_of(v) for v in value))
    raise _Unkeyable


def _outputs_of(result: Any) -> tuple[bool, list[tuple]] | None:
    """(was a tuple, metadata per tensor) of an op's result: one meta tensor or a tuple of them (None: not kept)."""
    many = isinstance(result, tuple)
    tensors = result if many else (result,)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.storage_offset() == 0 for t in tensors):
        return None
    return many, [(tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in tensors]


def _new(meta: tuple) -> torch.Tensor:
    shape, stride, dtype, requires_grad = meta
    out = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return out.requires_grad_(requires_grad) if requires_grad else out


_FUNCTIONAL: dict[Any, bool] = {}


def _functional(func: Any) -> bool:
    """No argument written and no output aliasing an input (views, in-place and out= ops run every time)."""
    known = _FUNCTIONAL.get(func)
    if known is None:
        known = _FUNCTIONAL[func] = op_is_functional(func)
    return known


class MetaOpMemo(DispatchMode):
    """Remembers (op, input metadata) -> output metadata for functional ops on meta tensors; `known` is shared by
    the uses of one model (`for_model`), so a second method estimated on it runs almost nothing."""

    def __init__(self, known: dict | None = None) -> None:
        super().__init__()
        self.known: dict = {} if known is None else known
        self.hits = self.misses = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "MetaOpMemo":
        return cls(model.__dict__.setdefault("_dcache_meta_ops", {}))  # plain attribute: no submodule, no state

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _functional(func):
            return func(*args, **kwargs)
        try:
            key = (func, _key_of(args), _key_of(tuple(kwargs.items())) if kwargs else None)
        except _Unkeyable:
            return func(*args, **kwargs)
        made = self.known.get(key)
        if made is not None:
            self.hits += 1
            many, outputs = made
            return tuple(_new(o) for o in outputs) if many else _new(outputs[0])
        result = func(*args, **kwargs)
        outputs = _outputs_of(result)
        if outputs is not None:  # (a factory op that made a CPU tensor is not an op on meta tensors: not counted)
            self.misses += 1
            self.known[key] = outputs
        return result
