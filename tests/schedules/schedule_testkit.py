"""Shared helpers of the schedule tests: a tiny FLUX transformer, a denoising-like loop, true compute ratios.

The tiny model is a real `FluxTransformer2DModel` (2 double + 3 single blocks, width 32, random seeded weights).
`denoise` imitates a rectified-flow sampler on it: x_{i+1} = x_i - v_i / N, so the latents evolve through the
model's own outputs. The timestep falls slowly (1.0 -> 0.998): with random weights every sinusoid of the timestep
embedding is used, and timestep jumps of a real schedule would make consecutive steps unrelated (a trained model
learns to be smooth in t; the bundled tiny model is used for quality).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from diffusers import FluxTransformer2DModel

import dcache
from dcache.schedules import tables

STEPS = 20
TOKENS, TEXT_TOKENS = 16, 4


def tiny_flux(seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()


def start(seed: int = 1, batch: int = 1) -> dict[str, torch.Tensor]:
    """Starting latents and fixed conditioning of one generation (a pure function of the seed)."""
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, TOKENS, 4, generator=g),
            "encoder_hidden_states": torch.randn(batch, TEXT_TOKENS, 32, generator=g),
            "pooled_projections": torch.randn(batch, 32, generator=g)}


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    img_ids = torch.zeros(TOKENS, 3)
    img_ids[:, 1] = torch.arange(TOKENS) // 4
    img_ids[:, 2] = torch.arange(TOKENS) % 4
    return img_ids, torch.zeros(TEXT_TOKENS, 3)


def timestep(step: int, steps: int = STEPS) -> float:
    return 1.0 - 0.002 * step / steps


def call(model, x: torch.Tensor, cond: dict[str, torch.Tensor], step: int, steps: int = STEPS) -> torch.Tensor:
    img_ids, txt_ids = _ids()
    return model(hidden_states=x, encoder_hidden_states=cond["encoder_hidden_states"],
                 pooled_projections=cond["pooled_projections"], timestep=torch.full((x.shape[0],), timestep(step,
                                                                                                          steps)),
                 img_ids=img_ids, txt_ids=txt_ids).sample


@torch.no_grad()
def denoise(model, steps: int = STEPS, seed: int = 1, batch: int = 1) -> torch.Tensor:
    """One generation; returns the final latents [batch, TOKENS, 4]."""
    s = start(seed, batch)
    x = s["x"]
    for i in range(steps):
        x = x - call(model, x, s, i, steps) / steps
    return x


@torch.no_grad()
def denoise_two_branches(model, steps: int = STEPS, seeds: tuple[int, int] = (1, 2)) -> tuple[torch.Tensor, ...]:
    """Two independent generations interleaved call by call inside each step (branches call0 / call1, as split CFG
    does with cond / uncond). Returns both final latents."""
    a, b = start(seeds[0]), start(seeds[1])
    xa, xb = a["x"], b["x"]
    for i in range(steps):
        va = call(model, xa, a, i, steps)
        vb = call(model, xb, b, i, steps)
        xa, xb = xa - va / steps, xb - vb / steps
    return xa, xb


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean() / b.abs().mean())


def true_compute_ratio(handle: dcache.Handle) -> float:
    """Computed / total block FLOPs of the last generation, counted independently of `stats().compute_ratio`.

    STACK / BLOCK: the engine's own number. MODULE: total minus the cost of every skipped module unit (an early
    engine counted a computed module twice; the matrix cross-checks the engine's number against this one).
    """
    eng = handle.engine
    if eng.granularity.value != "module":
        return handle.stats().compute_ratio
    calls = eng.record.calls
    total = sum(c.flops_total for c in calls)
    unit_cost = {key[1]: cost for key, cost in eng.flops.by_unit.items() if isinstance(key, tuple) and key[0] == "m"}
    skipped = sum(unit_cost.get(i, 0.0) for c in calls for i, a in enumerate(c.actions) if a != "C")
    return (total - skipped) / total


@contextmanager
def saved_tables() -> Iterator[None]:
    """Restore the global calibration-table registry afterwards (tests register tables for the tiny model)."""
    before = dict(tables._TABLES)
    try:
        yield
    finally:
        tables._TABLES.clear()
        tables._TABLES.update(before)


def run_with(model, method: Any, steps: int = STEPS, seed: int = 1, **overrides) -> tuple[torch.Tensor, dcache.Handle]:
    """Apply, run one generation, remove; returns (final latents, the removed handle: stats still readable)."""
    handle = dcache.apply(model, method, num_steps=steps, **overrides)
    try:
        out = denoise(model, steps, seed)
    finally:
        handle.remove()
    return out, handle
