"""SeaCache's SEA indicator (dcache.schedules.seacache), the latent layouts it reads (dcache.runtime.latents) and the
SPECTRAL_REL_L1 signal its provider measures through the engine.

Checked against diffusers' own SeaCache filter and Flux pipeline packing where diffusers has them, and against a
direct computation for the engine's signal.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FluxTransformer2DModel

import dcache
from dcache import Action, Schedule
from dcache.runtime import latents as layouts
from dcache.schedules import seacache
from dcache.schedules.seacache import SPECTRAL_REL_L1


def test_gain_is_unit_mean_flat_when_clean_and_low_pass_when_noisy():
    for sigma in (0.02, 0.5, 0.95):
        gain = seacache.sea_gain((1, 16, 16), sigma, 3.0, torch.device("cpu"))
        assert gain.shape == (1, 16, 16) and gain.mean().item() == pytest.approx(1.0, rel=1e-6)
    clean = seacache.sea_gain((1, 16, 16), 0.02, 3.0, torch.device("cpu"))
    noisy = seacache.sea_gain((1, 16, 16), 0.95, 3.0, torch.device("cpu"))
    assert clean.max() / clean.min() < 1.1  # low noise: (nearly) no filtering
    assert noisy[0, 0, 0] > 50 * noisy[0, 8, 8]  # high noise: the zero frequency dominates the Nyquist corner


def test_filter_matches_diffusers_seacache():
    sea = pytest.importorskip("diffusers.hooks.sea_cache")
    x = torch.randn(2, 3, 2, 12, 10, generator=torch.Generator().manual_seed(0))  # [B, C, T, H, W]
    for sigma in (0.1, 0.7):
        ours = seacache.sea_filter(x, sigma, 3.0)
        for b in range(2):  # diffusers filters one [C, T, H, W] latent as [T, H, W, C] over its first three axes
            theirs = sea._apply_sea_filter(x[b].movedim(0, -1), sigma=sigma, power_exp=3.0).movedim(-1, 0)
            torch.testing.assert_close(ours[b], theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("height, width", [(16, 16), (8, 24)])
def test_packed_tokens_unpack_like_the_flux_pipeline(height, width):
    from diffusers import FluxPipeline

    latents = torch.randn(2, 3, height, width)
    tokens = FluxPipeline._pack_latents(latents, 2, 3, height, width)  # [2, h*w, 12]
    ids = FluxPipeline._prepare_latent_image_ids(2, height // 2, width // 2, "cpu", torch.float32)
    unpacked = layouts.packed_2x2_latents(tokens, ids)
    assert unpacked.shape == (2, 3, 1, height, width)
    assert torch.equal(unpacked[:, :, 0], latents)
    assert layouts.packed_2x2_latents(tokens, ids[:-1]) is None  # ids of another token set: no grid
    assert layouts.packed_2x2_latents(tokens[..., :-1], ids) is None  # channels not 2x2-packed


def test_grid_is_read_once_per_ids_tensor_and_again_after_an_inplace_change():
    from diffusers import FluxPipeline

    ids = FluxPipeline._prepare_latent_image_ids(1, 4, 6, "cpu", torch.float32)
    tokens = torch.randn(1, 24, 4)
    assert layouts.packed_2x2_latents(tokens, ids).shape == (1, 1, 1, 8, 12)
    assert layouts._GRIDS[id(ids)][2:] == (4, 6)  # cached: later calls with this tensor do not read it again
    ids[:, 1], ids[:, 2] = torch.arange(24) // 2, torch.arange(24) % 2  # in place: now a 12 x 2 token grid
    assert layouts.packed_2x2_latents(tokens, ids).shape == (1, 1, 1, 24, 4)


def test_call_latents_layouts():
    assert layouts.call_latents(torch.zeros(2, 4, 8, 8), None, None).shape == (2, 4, 1, 8, 8)
    assert layouts.call_latents(torch.zeros(2, 4, 3, 8, 8), None, None).shape == (2, 4, 3, 8, 8)
    assert layouts.call_latents(torch.zeros(2, 64, 16), None, None) is None  # tokens without a layout
    fn = lambda args: args["hidden_states"].transpose(1, 2)  # noqa: E731  frames-first video latents
    assert layouts.call_latents(None, fn, {"hidden_states": torch.zeros(2, 3, 4, 8, 8)}).shape == (2, 4, 3, 8, 8)


def test_per_sample_relative_l1_is_the_mean_over_samples():
    a, b = torch.ones(2, 3), torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    assert seacache.per_sample_rel_l1(a, b).tolist() == pytest.approx([(0.5 + 0.0) / 2])


class _Record(Schedule):
    """Always computes; keeps the SPECTRAL_REL_L1 value of every call."""

    signals = frozenset({SPECTRAL_REL_L1})

    def __init__(self):
        self.seen: list[float | None] = []

    def decide(self, ctx):
        self.seen.append(ctx.signals.get(SPECTRAL_REL_L1))
        return Action.COMPUTE


def test_engine_signal_equals_a_direct_computation():
    from diffusers import FluxPipeline

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    steps, (h, w) = 4, (8, 12)
    ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 2, h, w, generator=g) for _ in range(steps)]
    cond = dict(encoder_hidden_states=torch.randn(2, 3, 32, generator=g), pooled_projections=torch.randn(2, 32),
                txt_ids=torch.zeros(3, 3), img_ids=ids)
    record = _Record()
    with dcache.apply(model, record, num_steps=steps), torch.no_grad():
        for i, x in enumerate(xs):
            tokens = FluxPipeline._pack_latents(x, 2, 2, h, w)
            model(hidden_states=tokens, timestep=torch.full((2,), 1.0 - i / steps), **cond)
    assert record.seen[0] is None  # a branch's first call has nothing to compare with
    for i in range(1, steps):  # no scheduler: sigma = 1 - step / num_steps
        now = seacache.sea_filter(xs[i].unsqueeze(2), 1.0 - i / steps)
        before = seacache.sea_filter(xs[i - 1].unsqueeze(2), 1.0 - (i - 1) / steps)
        expected = sum(float((now[b] - before[b]).abs().mean() / before[b].abs().mean()) for b in range(2)) / 2
        assert record.seen[i] == pytest.approx(expected, rel=1e-5)
        assert math.isfinite(record.seen[i])


def test_flux2_and_z_image_latent_layouts_recover_the_vae_latents():
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    from dcache.model.families import registered_adapters

    adapters = registered_adapters()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 12, generator=g)  # VAE latents [B, C, H, W]
    patches = Flux2Pipeline._patchify_latents(x)  # [B, 4C, H/2, W/2]
    tokens = Flux2Pipeline._pack_latents(patches)  # [B, H/2 * W/2, 4C]
    ids = Flux2Pipeline._prepare_latent_ids(patches)  # [B, L, 4]: (t, h, w, l)
    flux2 = adapters["Flux2Transformer2DModel"].latents({"hidden_states": tokens, "img_ids": ids})
    assert torch.equal(flux2, x.unsqueeze(2))
    samples = [torch.randn(4, 1, 8, 8, generator=g) for _ in range(2)]  # Z-Image: per-sample [C, F, H, W]
    z_image = adapters["ZImageTransformer2DModel"].latents
    assert torch.equal(z_image({"x": samples}), torch.stack(samples))
    assert z_image({"x": [samples[0], samples[1][:, :, :4]]}) is None  # different sizes: no common layout
