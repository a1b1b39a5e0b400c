"""How a call-scope engine caches a model's output that is not shaped like its latent input: reused whole.

The call scope (dcache.runtime.call_scope) caches a transformer call in residual form, v = x + Delta. A ControlNet
call, c = ControlNet(x_t, control, t, text; s), has no such form: it returns per-block samples that the transformer
adds to its stream between its blocks (`h = block_i(h) + c_i`), each made as c_i = s * P_i(h_i) (P_i a projection of
the ControlNet's i-th block output h_i, s the call's `conditioning_scale`):
    Flux:       (controlnet_block_samples, controlnet_single_block_samples), tuples of [B, L_img, D] (or None)
    SD3, Sana:  (block_samples,), one [B, L_img, D] per ControlNet block
    Qwen-Image: (block_samples), one [B, L_img, D] per ControlNet block;   Z-Image: {layer index: [B, L, D]}
The samples have the hidden width D, x the latent width C_in: x + Delta means nothing here. `PlainOutput` caches
the output's tensor leaves as they are (held by reference: the pipelines only read them) with its pytree spec, and
serves, at step j from the branch's last computed step k (k' the computed step before k):
    REUSE     c(t_j) = c(t_k) * s_j / s_k
    FORECAST  c(t_j) = (c(t_k) + (j - k) (c(t_k) - c(t_k')) / (k - k')) * s_j / s_k      (order 1; Taylor order n)
The error a reuse leaves out, c(t_j) - c(t_k), the transformer adds to its stream unchanged.

The scale: pipelines switch a ControlNet on and off with control_guidance_start / _end, so s_j = scale * keep_j with
keep_j in {0, 1}. The samples are linear in s, so a served call is rescaled by s_j / s_k; samples cached at s_k = 0
cannot be rescaled (the call computes), and a scale that is not a number (Cosmos' per-block lists) must equal the
cached call's. A computed call at another scale, with other argument shapes or another output structure starts the
branch's history over (a Taylor table never mixes scales). A served call also needs the shapes of every tensor
argument to match the cached call's.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.torch import tree_flatten, tree_unflatten


@dataclass
class PlainLayout:
    """The last computed call of a branch: how to build its output around the cached tensors, and what it was
    computed with."""

    spec: Any  # the output's pytree spec
    leaves: list  # the output's leaves, None where a cached tensor goes
    signature: tuple  # shapes of the call's tensor arguments
    scale: Any  # the scale argument's value (None: the model has none)

    def build(self, tensors: list[torch.Tensor], factor: float) -> Any:
        served = iter(tensors if factor == 1.0 else [t * factor for t in tensors])
        return tree_unflatten([next(served) if leaf is None else leaf for leaf in self.leaves], self.spec)


class PlainOutput:
    """A call-scope engine's output reused whole (above). scale: the argument the output is linear in (a
    ControlNet's "conditioning_scale"), None for none."""

    def __init__(self, scale: str | None = None):
        self.scale = scale

    def key(self, arguments: dict[str, Any], args: tuple, kwargs: dict) -> tuple[tuple, Any]:
        """(signature, scale) of a call: the shapes of its tensor arguments (its FLOP-book key too) and its scale."""
        signature = tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        return signature, arguments.get(self.scale) if self.scale is not None else None

    @staticmethod
    def factor(layout: PlainLayout | None, signature: tuple, scale: Any) -> float | None:
        """The factor s_j / s_k a call at (signature, scale) serves the branch's cached tensors with; None when it
        cannot be served from them."""
        if layout is None or layout.signature != signature:
            return None
        return _rescale(layout.scale, scale)

    @staticmethod
    def layout(out: Any, signature: tuple, scale: Any) -> tuple[PlainLayout, list[torch.Tensor]]:
        """A computed call's layout and the tensors to cache."""
        leaves, spec = tree_flatten(out)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        kept = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return PlainLayout(spec, kept, signature, scale), tensors

    @staticmethod
    def continues(cached: PlainLayout | None, new: PlainLayout) -> bool:
        """Whether a computed call's tensors extend the branch's history (else it starts over)."""
        return (cached is not None and cached.spec == new.spec and cached.signature == new.signature
                and _same(cached.scale, new.scale))


def _as_built(out: Any) -> Any:
    return out


def served_later(out: Any) -> Any:
    """A served output as the call executor hands it over under torch.compile: a function returning it, called by
    the caller's eager frame, so that dynamo compiles a frame of the call (with fullgraph=True a call must); the
    output itself is built eagerly (its scale factor changes from step to step)."""
    return functools.partial(_as_built, out)


def _same(a: Any, b: Any) -> bool:
    """Two scales are the same (numbers, lists of numbers, None); tensors only when the same object."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _rescale(cached: Any, scale: Any) -> float | None:
    """The factor s_j / s_k that turns an output computed at scale s_k into that at s_j (linear in the scale); None
    when there is none (s_k = 0, or scales that are not numbers and differ)."""
    if _same(cached, scale):
        return 1.0
    real = (numbers.Real,)
    if isinstance(cached, real) and isinstance(scale, real) and not isinstance(cached, bool) and cached != 0:
        return float(scale) / float(cached)
    return None
