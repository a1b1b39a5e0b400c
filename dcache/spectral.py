"""Spectral-evolution-aware (SEA) indicator of a transformer call's noisy latents (SeaCache, arXiv 2602.18993).

The noisy latent x_t = (1 - sigma) x_0 + sigma eps of a flow-matching sampler is filtered over its spatial (and
temporal) frequencies with the Wiener gain of a clean signal whose power falls as |f|^-p, observed in white noise of
level sigma:

    g(f) = s P(f) / (s^2 P(f) + sigma^2),    P(f) = 1 / |f|^p,    s = 1 - sigma      (per axis, multiplied)

normalised to unit mean over the frequency grid so that indicators of different steps are comparable (SeaCache
Eq. 7). At high noise the filter keeps the low frequencies that carry the emerging image; at low noise it is nearly
flat. The indicator of a call is this filtered latent; its relative L1 change between consecutive calls of a branch
is `Signal.SPECTRAL_REL_L1` (the mean over samples of the per-sample relative L1, as diffusers' SeaCache does).

Latents come as [B, C, T, H, W] (an adapter's `latents` function, or a 4-D / 5-D `hidden_states` argument taken as
[B, C, H, W] / [B, C, T, H, W]); a model whose latents are neither (packed tokens without an adapter function) gets
no filter: the indicator is then the plain relative change of its input.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

_EPS = 1e-16


@functools.lru_cache(maxsize=512)
def sea_gain(shape: tuple[int, ...], sigma: float, power: float, device: torch.device) -> torch.Tensor:
    """Unit-mean Wiener gain over the frequency grid of `shape` (the filtered axes), float32; read-only.

    Cached: a sampler visits the same few dozen noise levels in every generation (and both CFG branches of a step
    share one), and building the gain costs more Python than the FFT on small latents."""
    sigma = min(max(float(sigma), 1e-6), 1.0 - 1e-6)
    signal, noise = 1.0 - sigma, sigma
    gain = None
    for axis, size in enumerate(shape):
        freq = torch.fft.fftfreq(size, device=device, dtype=torch.float32)
        clean = 1.0 / (freq.abs().pow(power) + _EPS)  # zero frequency: 1e16 -> gain 1 / signal
        g = signal * clean / (signal * signal * clean + noise * noise + _EPS)
        view = [1] * len(shape)
        view[axis] = size
        gain = g.reshape(view) if gain is None else gain * g.reshape(view)
    mean = gain.mean()
    return torch.where(torch.isfinite(mean) & (mean > 0), gain / mean, gain)  # on the device: no host sync


def sea_filter(latents: torch.Tensor, sigma: float, power: float = 3.0) -> torch.Tensor:
    """latents [B, C, T, H, W] -> the SEA-filtered latents, same shape, float32 (FFT over T, H, W)."""
    x = latents.detach().float()
    dims = (-3, -2, -1)
    gain = sea_gain(tuple(x.shape[-3:]), sigma, power, x.device)
    return torch.fft.ifftn(torch.fft.fftn(x, dim=dims) * gain, dim=dims).real


def call_latents(hidden: Any, latents_fn: Any, arguments: dict[str, Any] | None) -> torch.Tensor | None:
    """[B, C, T, H, W] latents of one transformer call, or None (then the indicator is unfiltered)."""
    if latents_fn is not None and arguments is not None:
        out = latents_fn(arguments)
        return out if isinstance(out, torch.Tensor) and out.ndim == 5 else None
    if isinstance(hidden, torch.Tensor) and hidden.ndim == 4:  # [B, C, H, W]
        return hidden.unsqueeze(2)
    if isinstance(hidden, torch.Tensor) and hidden.ndim == 5:  # [B, C, T, H, W]
        return hidden
    return None


def per_sample_rel_l1(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """mean over the batch of mean|x_i - ref_i| / mean|ref_i|: a [1] tensor on the device (no host sync)."""
    b = x.shape[0]
    num = (x - ref).abs().reshape(b, -1).mean(dim=1)
    den = ref.abs().reshape(b, -1).mean(dim=1) + _EPS
    return (num / den).mean().reshape(1)


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
    if known is not None and known[0]() is key and known[1] == key._version:
        return known[2], known[3]
    span = (ids[:, 1:3].amax(dim=0) - ids[:, 1:3].amin(dim=0) + 1).tolist()
    if key.is_inference():  # no version counter (torch.inference_mode): read every call, never remembered
        return int(span[0]), int(span[1])
    if len(_GRIDS) > 64:  # forget the ids of finished generations
        for k in [k for k, v in _GRIDS.items() if v[0]() is None]:
            del _GRIDS[k]
    _GRIDS[id(key)] = (weakref.ref(key), key._version, int(span[0]), int(span[1]))
    return int(span[0]), int(span[1])


__all__ = ["sea_gain", "sea_filter", "call_latents", "per_sample_rel_l1", "unpack_tokens", "packed_2x2_latents"]
