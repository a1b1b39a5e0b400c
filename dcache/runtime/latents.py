"""The noisy latents of a transformer call laid out as [B, C, T, H, W] (batch, channels, frames, rows, columns).

Signals that read the latents' spatial (and temporal) structure, such as a frequency-domain filter, need them on
their grid, but transformers take them in many forms: [B, C, H, W] or [B, C, T, H, W] `hidden_states`, packed
patch tokens (Flux, Qwen-Image, LTX), per-sample lists. An adapter's `latents` function (dcache.model.adapters) unpacks
its family's form; without one a 4-D / 5-D `hidden_states` argument is taken as it is, and anything else has no
known layout (None).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..compat.torch import tensor_version


def call_latents(hidden: Any, latents_fn: Any, arguments: dict[str, Any] | None) -> torch.Tensor | None:
    """[B, C, T, H, W] latents of one transformer call, or None (no known layout)."""
    if latents_fn is not None and arguments is not None:
        out = latents_fn(arguments)
        return out if isinstance(out, torch.Tensor) and out.ndim == 5 else None
    if isinstance(hidden, torch.Tensor) and hidden.ndim == 4:  # [B, C, H, W]
        return hidden.unsqueeze(2)
    if isinstance(hidden, torch.Tensor) and hidden.ndim == 5:  # [B, C, T, H, W]
        return hidden
    return None


def unpack_tokens(tokens: torch.Tensor, frames: int, rows: int, cols: int, patch: int) -> torch.Tensor | None:
    """Packed latent tokens [B, F*rows*cols (+ more), C*patch*patch] -> [B, C, F, rows*patch, cols*patch].

    Tokens are row-major over (frame, row, column) and each holds patch x patch pixels, channel-major (C, y, x): the
    packing of Flux / Qwen-Image pipelines (patch 2) and LTX (patch 1). Tokens after the first F*rows*cols (reference
    images appended to the stream) are left out. None when the shapes do not fit."""
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3:
        return None
    b, n, d = tokens.shape
    count = frames * rows * cols
    if count <= 0 or count > n or d % (patch * patch):
        return None
    c = d // (patch * patch)
    x = tokens[:, :count].reshape(b, frames, rows, cols, c, patch, patch)
    return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, frames, rows * patch, cols * patch)


def packed_2x2_latents(hidden: torch.Tensor, img_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Flux-style packed tokens [B, h*w, C*4] with image ids [h*w, 3] (row, column in ids columns 1, 2) ->
    [B, C, 1, 2h, 2w], the pipeline's own unpacking (`_unpack_latents`)."""
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or not isinstance(img_ids, torch.Tensor):
        return None
    ids = img_ids[0] if img_ids.ndim == 3 else img_ids  # [L, 3]: (frame / condition, row, column)
    if ids.ndim != 2 or ids.shape[0] != hidden.shape[1] or ids.shape[1] < 3:
        return None
    h, w = _grid(img_ids, ids)
    if h * w != hidden.shape[1]:  # several images / conditions in one stream: not a single grid
        return None
    return unpack_tokens(hidden, 1, h, w, 2)


_GRIDS: dict[int, tuple[weakref.ref, int, int, int]] = {}  # id(ids) -> (ref, version, rows, columns)


def _grid(key: torch.Tensor, ids: torch.Tensor) -> tuple[int, int]:
    """(rows, columns) spanned by image ids [L, 3] (`key`: the tensor the model was given). A pipeline passes the
    same ids tensor at every step: it is read to the host once (one sync per generation, not per call)."""
    known = _GRIDS.get(id(key))
    if known is not None and known[0]() is key and known[1] == tensor_version(key):
        return known[2], known[3]
    span = (ids[:, 1:3].amax(dim=0) - ids[:, 1:3].amin(dim=0) + 1).tolist()
    if key.is_inference():  # no version counter (torch.inference_mode): read every call, never remembered
        return int(span[0]), int(span[1])
    if len(_GRIDS) > 64:  # forget the ids of finished generations
        for k in [k for k, v in _GRIDS.items() if v[0]() is None]:
            del _GRIDS[k]
    _GRIDS[id(key)] = (weakref.ref(key), tensor_version(key), int(span[0]), int(span[1]))
    return int(span[0]), int(span[1])


__all__ = ["call_latents", "unpack_tokens", "packed_2x2_latents"]
