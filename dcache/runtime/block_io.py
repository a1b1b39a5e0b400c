"""Reading the hidden / encoder streams out of a block call and writing a block result back in its own format."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.adapters import ENCODER, HIDDEN, BlockList, UnsupportedModelError


@dataclass(frozen=True)
class StreamSlots:
    """Where one block class receives its streams: kwarg name and positional index (from its signature)."""

    hidden_name: str
    hidden_pos: int | None
    encoder_name: str | None
    encoder_pos: int | None
    outputs: tuple[str | None, ...]

    @classmethod
    def for_block(cls, block: nn.Module, spec: BlockList) -> "StreamSlots":
        params = [p for p in inspect.signature(block.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [p.name for p in params]
        if spec.hidden not in names and not _accepts_kwargs(block):
            raise UnsupportedModelError(block, f"{type(block).__name__}.forward has no argument {spec.hidden!r}")
        hidden_pos = names.index(spec.hidden) if spec.hidden in names else None
        encoder_pos = names.index(spec.encoder) if spec.encoder and spec.encoder in names else None
        return cls(spec.hidden, hidden_pos, spec.encoder, encoder_pos, spec.outputs)

    def read(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [B, L, D], encoder [B, L_txt, D] or None) as passed to the block (runs for every block call)."""
        if kwargs:
            hidden = kwargs.get(self.hidden_name)
            if hidden is None:
                hidden = _pick(args, kwargs, self.hidden_name, self.hidden_pos)
            encoder = kwargs.get(self.encoder_name) if self.encoder_name else None
            if encoder is None and self.encoder_name:
                encoder = _pick(args, kwargs, self.encoder_name, self.encoder_pos)
            return hidden, encoder
        return (_pick(args, kwargs, self.hidden_name, self.hidden_pos),
                _pick(args, kwargs, self.encoder_name, self.encoder_pos) if self.encoder_name else None)

    def split_output(self, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, encoder) out of what the block returned."""
        if isinstance(output, torch.Tensor):
            return output, None
        values = dict(zip(self.outputs, output))
        return values[HIDDEN], values.get(ENCODER)

    def make_output(self, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
        """A block result in the block's own format (tuple order from the adapter)."""
        outputs = self.outputs
        if outputs == _HIDDEN_ONLY:
            return hidden
        if outputs == _ENCODER_HIDDEN:  # the MM-DiT orders, spelled out: this runs for every skipped block
            return encoder, hidden
        if outputs == _HIDDEN_ENCODER:
            return hidden, encoder
        return tuple(hidden if s == HIDDEN else encoder if s == ENCODER else None for s in outputs)


_HIDDEN_ONLY, _ENCODER_HIDDEN, _HIDDEN_ENCODER = (HIDDEN,), (ENCODER, HIDDEN), (HIDDEN, ENCODER)


def bind_arguments(block: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """All forward arguments by name (defaults applied); only used where a signal needs them (every call)."""
    bound = _forward_signature(type(block)).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@functools.lru_cache(maxsize=None)
def _forward_signature(cls: type) -> inspect.Signature:
    """The class's forward signature without `self`, computed once per class: inspect.signature costs tens of
    microseconds, as much as a small block's kernel launches. Hooks that wrap `forward` keep its arguments."""
    sig = inspect.signature(cls.forward)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _pick(args: tuple, kwargs: dict, name: str | None, pos: int | None) -> Any:
    if name is not None and name in kwargs:
        return kwargs[name]
    if pos is not None and pos < len(args):
        return args[pos]
    return None


def _accepts_kwargs(block: nn.Module) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(block.forward).parameters.values())
