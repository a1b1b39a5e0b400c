"""A zoo of tiny diffusers transformers, one per family with a dcache adapter, for tests.

    ZOO["flux"].make_model()                       -> FluxTransformer2DModel, random weights (seeded), fp32, eval
    ZOO["flux"].make_inputs(step, batch=1, generator=None) -> forward kwargs for that denoising step

Every model is tiny (2 blocks per block list, width 32, a few dozen tokens; a CPU forward takes milliseconds) and is
built from a config: nothing is downloaded. Inputs imitate a denoising trajectory so that caching has something to
exploit: fixed base latents plus a small smooth drift that grows with the step, fixed text conditioning, and a noise
level sigma(step) = exp(-step / ZOO_STEPS) that decreases with the step, written in each model's own timestep
convention (t = 1000*sigma, t = sigma, or t = 1 - sigma for Lumina / Z-Image, which count from noise to image).

Determinism: `make_inputs` is a pure function of (step, batch, seed); the seed is `generator.initial_seed()` when a
generator is given, else 0. Sample i of a batch depends only on (seed, i), so a batch of 2 starts with the batch of 1.

Import from another test file (pytest runs with --import-mode=importlib, so tests/ is not a package):

    import importlib.util, pathlib, sys
    def _zoo():
        if "dcache_test_zoo" not in sys.modules:
            spec = importlib.util.spec_from_file_location("dcache_test_zoo",
                                                          pathlib.Path(__file__).with_name("zoo.py"))
            sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        return sys.modules["dcache_test_zoo"]
    ZOO = _zoo().ZOO
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

ZOO_STEPS = 10  # sigma(step) falls from 1 to e^-1 over ZOO_STEPS steps and keeps falling after
DRIFT = 0.05  # how far the latents move along a fixed direction as sigma goes from 1 to 0
WIDTH = 32  # hidden size of every zoo model: 2 heads x 16


@dataclass(frozen=True)
class ZooEntry:
    name: str  # short family name, the ZOO key
    model_class: str  # diffusers class name == the dcache adapter's model_class
    make_model: Callable[[], nn.Module]  # tiny config, random weights (seeded), fp32, eval mode
    make_inputs: Callable[..., dict[str, Any]]  # (step, batch=1, generator=None) -> forward kwargs
    notes: str = ""


ZOO: dict[str, ZooEntry] = {}


# ---- deterministic inputs ---------------------------------------------------------------------------------------

def sigma(step: int) -> float:
    """Noise level of `step`: 1.0 at step 0, exp(-1) at ZOO_STEPS, smooth and strictly decreasing."""
    return math.exp(-step / ZOO_STEPS)


def _seed(generator: torch.Generator | None) -> int:
    return 0 if generator is None else int(generator.initial_seed())


def _randn(key: str, shape: tuple[int, ...], batch: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[batch, *shape] standard normal; sample i depends only on (key, seed, i)."""
    samples = []
    for i in range(batch):
        g = torch.Generator().manual_seed((zlib.crc32(key.encode()) + 7919 * seed + 104729 * i) % (2**63))
        samples.append(torch.randn(shape, generator=g) * scale)
    return torch.stack(samples)


def _latents(key: str, shape: tuple[int, ...], step: int, batch: int, seed: int) -> torch.Tensor:
    """Base latents + DRIFT * (1 - sigma(step)) * a fixed direction: consecutive steps differ by ~DRIFT/ZOO_STEPS."""
    base = _randn(key + "/base", shape, batch, seed)
    direction = _randn(key + "/direction", shape, batch, seed)
    return base + DRIFT * (1.0 - sigma(step)) * direction


def _t(step: int, batch: int, scale: float = 1000.0) -> torch.Tensor:
    """Timestep [batch] = scale * sigma(step) (1000-step or [0, 1] conventions)."""
    return torch.full((batch,), scale * sigma(step))


def _t_reversed(step: int, batch: int) -> torch.Tensor:
    """Timestep [batch] = 1 - sigma(step): Lumina / Z-Image count from noise (0) to image (1)."""
    return torch.full((batch,), 1.0 - sigma(step))


def _ids(*axes: int, offset_axis: int | None = None) -> torch.Tensor:
    """Position ids [prod(axes), len(axes)] of a grid; used for Flux-style RoPE (img_ids / txt_ids)."""
    grids = torch.meshgrid(*[torch.arange(n) for n in axes], indexing="ij")
    return torch.stack([g.flatten() for g in grids], dim=-1).float()


def _build(cls: Callable[..., nn.Module], seed: int = 0, **config) -> nn.Module:
    torch.manual_seed(seed)
    model = cls(**config)
    return model.float().eval()


def _register(name: str, model_class: str, notes: str = ""):
    """Decorator for a `(make_model, make_inputs)` pair factory."""

    def wrap(factory: Callable[[], tuple[Callable[[], nn.Module], Callable[..., dict[str, Any]]]]):
        make_model, make_inputs = factory()
        ZOO[name] = ZooEntry(name, model_class, make_model, make_inputs, notes)
        return factory

    return wrap


def _diffusers(name: str):
    import diffusers

    return getattr(diffusers, name, None) or getattr(diffusers.models.transformers, name)


# ---- families -----------------------------------------------------------------------------------------------------
# Shapes in comments: B batch, C latent channels, F frames, H/W latent height/width, L tokens, T text tokens.

TXT = 8  # text tokens


@_register("flux", "FluxTransformer2DModel")
def _flux():
    def make_model():
        return _build(_diffusers("FluxTransformer2DModel"), patch_size=1, in_channels=8, num_layers=2,
                      num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("flux", (16, 8), step, batch, s),  # packed latents [B, H*W = 4*4, C]
            encoder_hidden_states=_randn("flux/txt", (TXT, 24), batch, s),
            pooled_projections=_randn("flux/pooled", (16,), batch, s),
            timestep=_t(step, batch, 1.0),
            img_ids=_ids(1, 4, 4), txt_ids=torch.zeros(TXT, 3),
        )

    return make_model, make_inputs


@_register("flux2", "Flux2Transformer2DModel")
def _flux2():
    def make_model():
        return _build(_diffusers("Flux2Transformer2DModel"), patch_size=1, in_channels=8, num_layers=2,
                      num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("flux2", (16, 8), step, batch, s),  # [B, 4*4, C]
            encoder_hidden_states=_randn("flux2/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch, 1.0), guidance=torch.full((batch,), 4.0),
            img_ids=_ids(1, 4, 4, 1), txt_ids=_ids(1, 1, 1, TXT),
        )

    return make_model, make_inputs


def _wan_like(cls_name: str, key: str, **extra_config):
    def make_model():
        return _build(_diffusers(cls_name), patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, out_channels=4, text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2,
                      rope_max_seq_len=32, **extra_config)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents(key, (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 2*4*4 = 32 tokens
            encoder_hidden_states=_randn(key + "/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
        )

    return make_model, make_inputs


@_register("wan", "WanTransformer3DModel")
def _wan():
    return _wan_like("WanTransformer3DModel", "wan")


@_register("hunyuan_video", "HunyuanVideoTransformer3DModel")
def _hunyuan_video():
    def make_model():
        return _build(_diffusers("HunyuanVideoTransformer3DModel"), in_channels=4, out_channels=4,
                      num_attention_heads=2, attention_head_dim=16, num_layers=2, num_single_layers=2,
                      num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, guidance_embeds=True,
                      text_embed_dim=24, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("hunyuan_video", (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W]
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("hunyuan_video/txt", (TXT, 24), batch, s),
            encoder_attention_mask=torch.ones(batch, TXT),
            pooled_projections=_randn("hunyuan_video/pooled", (16,), batch, s),
            guidance=torch.full((batch,), 6000.0),
        )

    return make_model, make_inputs


@_register("hunyuan_video_i2v", "HunyuanVideoTransformer3DModel",
           notes="image_condition_type='token_replace': TokenReplace block classes, first-frame tokens modulated "
                 "with t = 0")
def _hunyuan_video_i2v():
    make_model, make_inputs = _hunyuan_video()

    def make_i2v_model():
        return _build(_diffusers("HunyuanVideoTransformer3DModel"), in_channels=4, out_channels=4,
                      num_attention_heads=2, attention_head_dim=16, num_layers=2, num_single_layers=2,
                      num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, guidance_embeds=True,
                      text_embed_dim=24, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6),
                      image_condition_type="token_replace")

    return make_i2v_model, make_inputs


@_register("hunyuan_video15", "HunyuanVideo15Transformer3DModel")
def _hunyuan_video15():
    def make_model():
        return _build(_diffusers("HunyuanVideo15Transformer3DModel"), in_channels=4, out_channels=4,
                      num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
                      mlp_ratio=2.0, text_embed_dim=24, text_embed_2_dim=16, image_embed_dim=16,
                      rope_axes_dim=(4, 6, 6))

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("hunyuan_video15", (4, 2, 4, 4), step, batch, s),  # [B, C, F, H, W], 32 tokens
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("hunyuan_video15/txt", (TXT, 24), batch, s),
            encoder_attention_mask=torch.ones(batch, TXT),
            encoder_hidden_states_2=_randn("hunyuan_video15/byt5", (4, 16), batch, s),
            encoder_attention_mask_2=torch.ones(batch, 4),
            image_embeds=torch.zeros(batch, 4, 16),  # text-to-video: zero image features
        )

    return make_model, make_inputs


@_register("qwen_image", "QwenImageTransformer2DModel")
def _qwen_image():
    def make_model():
        return _build(_diffusers("QwenImageTransformer2DModel"), patch_size=2, in_channels=16, out_channels=4,
                      num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      axes_dims_rope=(4, 6, 6))

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("qwen_image", (16, 16), step, batch, s),  # packed [B, 4*4, C*2*2]
            encoder_hidden_states=_randn("qwen_image/txt", (TXT, 24), batch, s),
            encoder_hidden_states_mask=torch.ones(batch, TXT, dtype=torch.long),
            timestep=_t(step, batch, 1.0),
            img_shapes=[[(1, 4, 4)]] * batch,
        )

    return make_model, make_inputs


@_register("sd3", "SD3Transformer2DModel", notes="SD3.5-style: block 0 has dual attention (attn2)")
def _sd3():
    def make_model():
        return _build(_diffusers("SD3Transformer2DModel"), sample_size=8, patch_size=2, in_channels=4,
                      num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      caption_projection_dim=32, pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8,
                      dual_attention_layers=(0,), qk_norm="rms_norm")

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("sd3", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            encoder_hidden_states=_randn("sd3/txt", (TXT, 24), batch, s),
            pooled_projections=_randn("sd3/pooled", (16,), batch, s),
            timestep=_t(step, batch),
        )

    return make_model, make_inputs


@_register("pixart", "PixArtTransformer2DModel")
def _pixart():
    def make_model():
        return _build(_diffusers("PixArtTransformer2DModel"), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, out_channels=8, num_layers=2, cross_attention_dim=32, sample_size=8,
                      patch_size=2, caption_channels=24, use_additional_conditions=False)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("pixart", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            encoder_hidden_states=_randn("pixart/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        )

    return make_model, make_inputs


@_register("sana", "SanaTransformer2DModel")
def _sana():
    def make_model():
        return _build(_diffusers("SanaTransformer2DModel"), in_channels=4, out_channels=4, num_attention_heads=2,
                      attention_head_dim=16, num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
                      cross_attention_dim=32, caption_channels=24, sample_size=8, patch_size=1)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("sana", (4, 4, 4), step, batch, s),  # [B, C, H, W] -> 16 tokens
            encoder_hidden_states=_randn("sana/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
        )

    return make_model, make_inputs


@_register("cogvideox", "CogVideoXTransformer3DModel")
def _cogvideox():
    def make_model():
        return _build(_diffusers("CogVideoXTransformer3DModel"), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, out_channels=4, time_embed_dim=16, text_embed_dim=24, num_layers=2,
                      sample_width=8, sample_height=8, sample_frames=9, patch_size=2, max_text_seq_length=TXT)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("cogvideox", (3, 4, 8, 8), step, batch, s),  # [B, F, C, H, W] -> 48 tokens
            encoder_hidden_states=_randn("cogvideox/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
        )

    return make_model, make_inputs


@_register("ltx", "LTXVideoTransformer3DModel")
def _ltx():
    def make_model():
        return _build(_diffusers("LTXVideoTransformer3DModel"), in_channels=8, out_channels=8,
                      num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, num_layers=2,
                      caption_channels=24)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("ltx", (32, 8), step, batch, s),  # packed [B, F*H*W = 2*4*4, C]
            encoder_hidden_states=_randn("ltx/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
            encoder_attention_mask=torch.ones(batch, TXT),
            num_frames=2, height=4, width=4,
        )

    return make_model, make_inputs


@_register("lumina2", "Lumina2Transformer2DModel", notes="timestep convention t = 1 - sigma")
def _lumina2():
    def make_model():
        return _build(_diffusers("Lumina2Transformer2DModel"), sample_size=8, patch_size=2, in_channels=4,
                      hidden_size=32, num_layers=2, num_refiner_layers=1, num_attention_heads=2, num_kv_heads=2,
                      multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32), cap_feat_dim=24)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("lumina2", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            timestep=_t_reversed(step, batch),
            encoder_hidden_states=_randn("lumina2/txt", (TXT, 24), batch, s),
            encoder_attention_mask=torch.ones(batch, TXT, dtype=torch.bool),
        )

    return make_model, make_inputs


@_register("chroma", "ChromaTransformer2DModel")
def _chroma():
    def make_model():
        return _build(_diffusers("ChromaTransformer2DModel"), patch_size=1, in_channels=8, num_layers=2,
                      num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
                      approximator_layers=1)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("chroma", (16, 8), step, batch, s),  # [B, 4*4, C]
            encoder_hidden_states=_randn("chroma/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch, 1.0),
            img_ids=_ids(1, 4, 4), txt_ids=torch.zeros(TXT, 3),
        )

    return make_model, make_inputs


@_register("hidream", "HiDreamImageTransformer2DModel")
def _hidream():
    def make_model():
        return _build(_diffusers("HiDreamImageTransformer2DModel"), patch_size=2, in_channels=4, out_channels=4,
                      num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                      caption_channels=[24, 16], text_emb_dim=16, num_routed_experts=2, num_activated_experts=1,
                      axes_dims_rope=(4, 6, 6), max_resolution=(16, 16), llama_layers=[0, 1, 2, 3])

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        llama = _randn("hidream/llama", (4, TXT, 16), batch, s).transpose(0, 1)  # [layers, B, T, D_llama]
        return dict(
            hidden_states=_latents("hidream", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            timesteps=_t(step, batch),
            encoder_hidden_states_t5=_randn("hidream/t5", (TXT, 24), batch, s),
            encoder_hidden_states_llama3=llama,
            pooled_embeds=_randn("hidream/pooled", (16,), batch, s),
        )

    return make_model, make_inputs


@_register("auraflow", "AuraFlowTransformer2DModel")
def _auraflow():
    def make_model():
        return _build(_diffusers("AuraFlowTransformer2DModel"), sample_size=8, patch_size=2, in_channels=4,
                      num_mmdit_layers=2, num_single_dit_layers=2, attention_head_dim=16, num_attention_heads=2,
                      joint_attention_dim=24, caption_projection_dim=32, out_channels=4, pos_embed_max_size=16)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("auraflow", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            encoder_hidden_states=_randn("auraflow/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch, 1.0),
        )

    return make_model, make_inputs


@_register("mochi", "MochiTransformer3DModel")
def _mochi():
    def make_model():
        return _build(_diffusers("MochiTransformer3DModel"), patch_size=2, num_attention_heads=2,
                      attention_head_dim=16, num_layers=2, pooled_projection_dim=16, in_channels=4,
                      text_embed_dim=24, time_embed_dim=16, max_sequence_length=TXT)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("mochi", (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 32 tokens
            encoder_hidden_states=_randn("mochi/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
            encoder_attention_mask=torch.ones(batch, TXT, dtype=torch.bool),
        )

    return make_model, make_inputs


@_register("dit", "DiTTransformer2DModel")
def _dit():
    def make_model():
        return _build(_diffusers("DiTTransformer2DModel"), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("dit", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            timestep=_t(step, batch),
            class_labels=torch.arange(batch) % 10,
        )

    return make_model, make_inputs


@_register("cogview4", "CogView4Transformer2DModel")
def _cogview4():
    def make_model():
        return _build(_diffusers("CogView4Transformer2DModel"), patch_size=2, in_channels=4, out_channels=4,
                      num_layers=2, attention_head_dim=16, num_attention_heads=2, text_embed_dim=24,
                      time_embed_dim=16, condition_dim=8, pos_embed_max_size=16, sample_size=8, rope_axes_dim=(8, 8))

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        size = torch.tensor([[64.0, 64.0]]).repeat(batch, 1)
        return dict(
            hidden_states=_latents("cogview4", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            encoder_hidden_states=_randn("cogview4/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
            original_size=size, target_size=size, crop_coords=torch.zeros(batch, 2),
        )

    return make_model, make_inputs


@_register("wan22_ti2v", "WanTransformer3DModel",
           notes="Wan 2.2 TI2V: one timestep per token [B, L]; the first (conditioning) frame is clean, t = 0")
def _wan22_ti2v():
    make_model, wan_inputs = _wan_like("WanTransformer3DModel", "wan22_ti2v")

    def make_inputs(step, batch=1, generator=None):
        inputs = wan_inputs(step, batch, generator)
        per_token = _t(step, batch)[:, None].repeat(1, 32)  # 2 frames x 4 x 4 tokens
        per_token[:, :16] = 0.0  # first latent frame: the given image
        inputs["timestep"] = per_token
        return inputs

    return make_model, make_inputs


@_register("skyreels_v2", "SkyReelsV2Transformer3DModel")
def _skyreels_v2():
    return _wan_like("SkyReelsV2Transformer3DModel", "skyreels_v2")


@_register("z_image", "ZImageTransformer2DModel", notes="timestep convention t = 1 - sigma; list inputs")
def _z_image():
    def make_model():
        return _build(_diffusers("ZImageTransformer2DModel"), all_patch_size=(2,), all_f_patch_size=(1,),
                      in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                      cap_feat_dim=24, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        x = _latents("z_image", (4, 1, 8, 8), step, batch, s)  # per sample [C, F, H, W] -> 16 tokens
        cap = _randn("z_image/txt", (TXT, 24), batch, s)  # per sample [T, D_cap]
        return dict(x=list(x.unbind(0)), t=_t_reversed(step, batch), cap_feats=list(cap.unbind(0)))

    return make_model, make_inputs


# ---- further families ---------------------------------------------------------------------------------------------

@_register("allegro", "AllegroTransformer3DModel")
def _allegro():
    def make_model():
        return _build(_diffusers("AllegroTransformer3DModel"), patch_size=2, patch_size_t=1, num_attention_heads=2,
                      attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=32,
                      sample_height=8, sample_width=8, sample_frames=2, caption_channels=24)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("allegro", (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 32 tokens
            encoder_hidden_states=_randn("allegro/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
        )

    return make_model, make_inputs


def _flux_like(cls_name: str, key: str, pooled: int | None, **config):
    """Bria / Ovis / LongCat: Flux-style MMDiT + single blocks, packed latents [B, 4*4, C]."""

    def make_model():
        return _build(_diffusers(cls_name), patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      axes_dims_rope=(4, 6, 6), **config)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        inputs = dict(
            hidden_states=_latents(key, (16, 8), step, batch, s),
            encoder_hidden_states=_randn(key + "/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch, 1.0),
            img_ids=_ids(1, 4, 4), txt_ids=torch.zeros(TXT, 3),
        )
        if pooled:
            inputs["pooled_projections"] = _randn(key + "/pooled", (pooled,), batch, s)
        return inputs

    return make_model, make_inputs


@_register("bria", "BriaTransformer2DModel")
def _bria():
    return _flux_like("BriaTransformer2DModel", "bria", None)


@_register("ovis_image", "OvisImageTransformer2DModel")
def _ovis_image():
    return _flux_like("OvisImageTransformer2DModel", "ovis_image", None, out_channels=8)


@_register("longcat_image", "LongCatImageTransformer2DModel")
def _longcat_image():
    return _flux_like("LongCatImageTransformer2DModel", "longcat_image", None, pooled_projection_dim=16)


@_register("bria_fibo", "BriaFiboTransformer2DModel")
def _bria_fibo():
    def make_model():
        return _build(_diffusers("BriaFiboTransformer2DModel"), patch_size=1, in_channels=8, num_layers=2,
                      num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      axes_dims_rope=(4, 6, 6), text_encoder_dim=24)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        layers = _randn("bria_fibo/layers", (4, TXT, 24), batch, s)  # one text-encoder layer per block
        return dict(
            hidden_states=_latents("bria_fibo", (16, 8), step, batch, s),  # [B, 4*4, C]
            encoder_hidden_states=_randn("bria_fibo/txt", (TXT, 24), batch, s),
            text_encoder_layers=list(layers.unbind(1)),
            timestep=_t(step, batch),
            img_ids=_ids(1, 4, 4), txt_ids=torch.zeros(TXT, 3),
        )

    return make_model, make_inputs


@_register("chronoedit", "ChronoEditTransformer3DModel")
def _chronoedit():
    return _wan_like("ChronoEditTransformer3DModel", "chronoedit")


@_register("wan_vace", "WanVACETransformer3DModel")
def _wan_vace():
    make_model, wan_inputs = _wan_like("WanVACETransformer3DModel", "wan_vace", vace_layers=[0, 1],
                                       vace_in_channels=8)

    def make_inputs(step, batch=1, generator=None):
        inputs = wan_inputs(step, batch, generator)
        # control video [B, vace_in_channels, F, H, W]: fixed across steps like a real conditioning video
        inputs["control_hidden_states"] = _randn("wan_vace/control", (8, 2, 8, 8), batch, _seed(generator))
        return inputs

    return make_model, make_inputs


@_register("cogview3plus", "CogView3PlusTransformer2DModel")
def _cogview3plus():
    def make_model():
        return _build(_diffusers("CogView3PlusTransformer2DModel"), patch_size=2, in_channels=4, num_layers=2,
                      attention_head_dim=16, num_attention_heads=2, out_channels=4, text_embed_dim=24,
                      time_embed_dim=16, condition_dim=8, pos_embed_max_size=16, sample_size=8)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        size = torch.tensor([[64.0, 64.0]]).repeat(batch, 1)
        return dict(
            hidden_states=_latents("cogview3plus", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            encoder_hidden_states=_randn("cogview3plus/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
            original_size=size, target_size=size, crop_coords=torch.zeros(batch, 2),
        )

    return make_model, make_inputs


@_register("consisid", "ConsisIDTransformer3DModel", notes="without the face (id) conditioning inputs")
def _consisid():
    def make_model():
        return _build(_diffusers("ConsisIDTransformer3DModel"), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, out_channels=4, time_embed_dim=16, text_embed_dim=24, num_layers=2,
                      sample_width=8, sample_height=8, sample_frames=9, patch_size=2, max_text_seq_length=TXT)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("consisid", (3, 4, 8, 8), step, batch, s),  # [B, F, C, H, W]
            encoder_hidden_states=_randn("consisid/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
        )

    return make_model, make_inputs


@_register("cosmos", "CosmosTransformer3DModel")
def _cosmos():
    def make_model():
        return _build(_diffusers("CosmosTransformer3DModel"), in_channels=4, out_channels=4, num_attention_heads=2,
                      attention_head_dim=16, num_layers=2, mlp_ratio=2.0, text_embed_dim=24, adaln_lora_dim=8,
                      max_size=(4, 16, 16), patch_size=(1, 2, 2), rope_scale=(1.0, 1.0, 1.0),
                      concat_padding_mask=False)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("cosmos", (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 32 tokens
            timestep=_t(step, batch, 1.0),
            encoder_hidden_states=_randn("cosmos/txt", (TXT, 24), batch, s),
        )

    return make_model, make_inputs


@_register("easyanimate", "EasyAnimateTransformer3DModel")
def _easyanimate():
    def make_model():
        return _build(_diffusers("EasyAnimateTransformer3DModel"), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, out_channels=4, patch_size=2, sample_width=8, sample_height=8, num_layers=2,
                      mmdit_layers=2, time_embed_dim=16, text_embed_dim=24)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("easyanimate", (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 32 tokens
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("easyanimate/txt", (TXT, 24), batch, s),
        )

    return make_model, make_inputs


@_register("hunyuan_dit", "HunyuanDiT2DModel")
def _hunyuan_dit():
    def make_model():
        return _build(_diffusers("HunyuanDiT2DModel"), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, patch_size=2, sample_size=8, hidden_size=32, num_layers=4, mlp_ratio=2.0,
                      cross_attention_dim=24, cross_attention_dim_t5=16, pooled_projection_dim=16, text_len=TXT,
                      text_len_t5=4)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("hunyuan_dit", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("hunyuan_dit/clip", (TXT, 24), batch, s),
            text_embedding_mask=torch.ones(batch, TXT),
            encoder_hidden_states_t5=_randn("hunyuan_dit/t5", (4, 16), batch, s),
            text_embedding_mask_t5=torch.ones(batch, 4),
            image_meta_size=torch.tensor([[64.0, 64.0, 64.0, 64.0, 0.0, 0.0]]).repeat(batch, 1),
            style=torch.zeros(batch, dtype=torch.long),
            image_rotary_emb=_hunyuan_dit_rope(),
        )

    return make_model, make_inputs


def _hunyuan_dit_rope():
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    return get_2d_rotary_pos_embed(16, ((0, 0), (4, 4)), (4, 4), use_real=True)  # head_dim 16, 4x4 token grid


@_register("hunyuan_image", "HunyuanImageTransformer2DModel")
def _hunyuan_image():
    def make_model():
        return _build(_diffusers("HunyuanImageTransformer2DModel"), in_channels=4, out_channels=4,
                      num_attention_heads=2, attention_head_dim=16, num_layers=2, num_single_layers=2,
                      num_refiner_layers=1, mlp_ratio=2.0, patch_size=(1, 1), text_embed_dim=24,
                      rope_axes_dim=(8, 8))

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("hunyuan_image", (4, 4, 4), step, batch, s),  # [B, C, H, W] -> 16 tokens
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("hunyuan_image/txt", (TXT, 24), batch, s),
            encoder_attention_mask=torch.ones(batch, TXT),
        )

    return make_model, make_inputs


@_register("hunyuan_video_framepack", "HunyuanVideoFramepackTransformer3DModel",
           notes="history latents (clean, 2x, 4x) are fixed context packed before the noisy tokens")
def _hunyuan_video_framepack():
    def make_model():
        return _build(_diffusers("HunyuanVideoFramepackTransformer3DModel"), in_channels=4, out_channels=4,
                      num_attention_heads=2, attention_head_dim=16, num_layers=2, num_single_layers=2,
                      num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=24,
                      pooled_projection_dim=16, rope_axes_dim=(4, 6, 6), has_image_proj=True, image_proj_dim=16,
                      has_clean_x_embedder=True)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("framepack", (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 32 tokens
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("framepack/txt", (TXT, 24), batch, s),
            encoder_attention_mask=torch.ones(batch, TXT),
            pooled_projections=_randn("framepack/pooled", (16,), batch, s),
            image_embeds=_randn("framepack/image", (4, 16), batch, s),
            indices_latents=torch.arange(6, 8),  # frame indices [F], shared by the batch
            guidance=torch.full((batch,), 6000.0),
            # packed history: clean frames [B, C, 1, H, W], 2x-compressed [B, C, 2, H, W], 4x [B, C, 4, H, W]
            latents_clean=_randn("framepack/clean", (4, 1, 8, 8), batch, s), indices_latents_clean=torch.tensor([5]),
            latents_history_2x=_randn("framepack/2x", (4, 2, 8, 8), batch, s),
            indices_latents_history_2x=torch.arange(3, 5),
            latents_history_4x=_randn("framepack/4x", (4, 4, 8, 8), batch, s),
            indices_latents_history_4x=torch.arange(0, 4),
        )

    return make_model, make_inputs


@_register("kandinsky5", "Kandinsky5Transformer3DModel")
def _kandinsky5():
    def make_model():
        return _build(_diffusers("Kandinsky5Transformer3DModel"), in_visual_dim=4, in_text_dim=24, in_text_dim2=16,
                      time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2), model_dim=32, ff_dim=64,
                      num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6))

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("kandinsky5", (2, 8, 8, 4), step, batch, s),  # [B, F, H, W, C] channels last
            encoder_hidden_states=_randn("kandinsky5/txt", (TXT, 24), batch, s),
            pooled_projections=_randn("kandinsky5/pooled", (16,), batch, s),
            timestep=_t(step, batch),
            visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
            text_rope_pos=torch.arange(TXT),
        )

    return make_model, make_inputs


@_register("lumina_next", "LuminaNextDiT2DModel", notes="timestep convention t = 1 - sigma")
def _lumina_next():
    def make_model():
        return _build(_diffusers("LuminaNextDiT2DModel"), sample_size=8, patch_size=2, in_channels=4,
                      hidden_size=32, num_layers=2, num_attention_heads=2, num_kv_heads=2, multiple_of=16,
                      learn_sigma=False, cross_attention_dim=24)

    def make_inputs(step, batch=1, generator=None):
        from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

        s = _seed(generator)
        return dict(
            hidden_states=_latents("lumina_next", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            timestep=_t_reversed(step, batch),
            encoder_hidden_states=_randn("lumina_next/txt", (TXT, 24), batch, s),
            encoder_mask=torch.ones(batch, TXT),
            image_rotary_emb=get_2d_rotary_pos_embed_lumina(16, 32, 32),
            cross_attention_kwargs={},
        )

    return make_model, make_inputs


@_register("omnigen", "OmniGenTransformer2DModel", notes="text-only condition tokens, no input images")
def _omnigen():
    def make_model():
        return _build(_diffusers("OmniGenTransformer2DModel"), in_channels=4, patch_size=2, hidden_size=32,
                      num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, num_layers=2,
                      vocab_size=64, pad_token_id=0, max_position_embeddings=64,
                      rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
                      original_max_position_embeddings=64, pos_embed_max_size=16, time_step_dim=16)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        length = TXT + 1 + 16  # [condition tokens ; time token ; 4*4 image tokens]
        ids = (_randn("omnigen/ids", (TXT,), batch, s).abs() * 20).long() % 63 + 1
        return dict(
            hidden_states=_latents("omnigen", (4, 8, 8), step, batch, s),  # [B, C, H, W]
            timestep=_t(step, batch, 1.0),
            input_ids=ids, input_img_latents=[], input_image_sizes={},
            attention_mask=torch.ones(batch, length, length),
            position_ids=torch.arange(length).unsqueeze(0).repeat(batch, 1),
        )

    return make_model, make_inputs


@_register("sana_video", "SanaVideoTransformer3DModel")
def _sana_video():
    def make_model():
        return _build(_diffusers("SanaVideoTransformer3DModel"), in_channels=4, out_channels=4,
                      num_attention_heads=2, attention_head_dim=16, num_layers=2, num_cross_attention_heads=2,
                      cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24, sample_size=8,
                      patch_size=(1, 2, 2), rope_max_seq_len=32)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("sana_video", (4, 2, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 32 tokens
            encoder_hidden_states=_randn("sana_video/txt", (TXT, 24), batch, s),
            timestep=_t(step, batch),
        )

    return make_model, make_inputs


@_register("anyflow", "AnyFlowTransformer3DModel")
def _anyflow():
    def make_model():
        return _build(_diffusers("AnyFlowTransformer3DModel"), patch_size=(1, 2, 2), num_attention_heads=2,
                      attention_head_dim=16, in_channels=4, out_channels=4, text_dim=24, freq_dim=32, ffn_dim=64,
                      num_layers=2, rope_max_seq_len=32)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("anyflow", (2, 4, 8, 8), step, batch, s),  # [B, F, C, H, W] -> 32 tokens
            # one timestep per latent frame [B, F]; the flow map goes from t to the next step's r
            timestep=_t(step, batch)[:, None].repeat(1, 2), r_timestep=_t(step + 1, batch)[:, None].repeat(1, 2),
            encoder_hidden_states=_randn("anyflow/txt", (TXT, 24), batch, s),
        )

    return make_model, make_inputs


@_register("joy_image_edit", "JoyImageEditTransformer3DModel")
def _joy_image_edit():
    def make_model():
        return _build(_diffusers("JoyImageEditTransformer3DModel"), patch_size=[1, 2, 2], in_channels=4,
                      hidden_size=32, num_attention_heads=2, text_dim=24, mlp_width_ratio=2.0, num_layers=2,
                      rope_dim_list=[4, 6, 6])

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("joy_image_edit", (4, 1, 8, 8), step, batch, s),  # [B, C, F, H, W] -> 16
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("joy_image_edit/txt", (TXT, 24), batch, s),
        )

    return make_model, make_inputs


@_register("nucleus_moe_image", "NucleusMoEImageTransformer2DModel")
def _nucleus_moe_image():
    def make_model():
        return _build(_diffusers("NucleusMoEImageTransformer2DModel"), patch_size=2, in_channels=16,
                      out_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
                      joint_attention_dim=24, axes_dims_rope=(4, 6, 6), num_experts=4, moe_intermediate_dim=32,
                      dense_moe_strategy="leave_first_three_and_last_block_dense")

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("nucleus_moe_image", (16, 16), step, batch, s),  # packed [B, 4*4, C*2*2]
            img_shapes=[(1, 4, 4)] * batch,
            encoder_hidden_states=_randn("nucleus_moe_image/txt", (TXT, 24), batch, s),
            encoder_hidden_states_mask=torch.ones(batch, TXT, dtype=torch.long),
            timestep=_t(step, batch, 1.0),
        )

    return make_model, make_inputs


@_register("prx", "PRXTransformer2DModel")
def _prx():
    def make_model():
        return _build(_diffusers("PRXTransformer2DModel"), in_channels=4, patch_size=2, context_in_dim=24,
                      hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=2, axes_dim=[8, 8])

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("prx", (4, 8, 8), step, batch, s),  # [B, C, H, W] -> 16 tokens
            timestep=_t(step, batch),
            encoder_hidden_states=_randn("prx/txt", (TXT, 24), batch, s),
        )

    return make_model, make_inputs


@_register("stable_audio", "StableAudioDiTModel")
def _stable_audio():
    def make_model():
        return _build(_diffusers("StableAudioDiTModel"), sample_size=16, in_channels=4, num_layers=2,
                      attention_head_dim=16, num_attention_heads=2, num_key_value_attention_heads=1,
                      out_channels=4, cross_attention_dim=16, time_proj_dim=16, global_states_input_dim=16,
                      cross_attention_input_dim=24)

    def make_inputs(step, batch=1, generator=None):
        from diffusers.models.embeddings import get_1d_rotary_pos_embed

        s = _seed(generator)
        return dict(
            hidden_states=_latents("stable_audio", (4, 16), step, batch, s),  # [B, C, T_audio] -> 1 + 16 tokens
            timestep=_t(step, batch, 1.0),
            encoder_hidden_states=_randn("stable_audio/txt", (TXT, 24), batch, s),
            global_hidden_states=_randn("stable_audio/global", (1, 16), batch, s),
            rotary_embedding=get_1d_rotary_pos_embed(8, 17, use_real=True, repeat_interleave_real=False),
        )

    return make_model, make_inputs


@_register("ltx2", "LTX2VideoTransformer3DModel",
           notes="audio + video: the audio stream is the block's second returned stream (adapter `encoder` slot)")
def _ltx2():
    def make_model():
        return _build(_diffusers("LTX2VideoTransformer3DModel"), in_channels=8, out_channels=8,
                      num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, audio_in_channels=8,
                      audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
                      audio_cross_attention_dim=16, num_layers=2, caption_channels=24)

    def make_inputs(step, batch=1, generator=None):
        s = _seed(generator)
        return dict(
            hidden_states=_latents("ltx2", (32, 8), step, batch, s),  # packed video [B, F*H*W = 2*4*4, C]
            audio_hidden_states=_latents("ltx2/audio", (12, 8), step, batch, s),  # packed audio [B, T_audio, C]
            encoder_hidden_states=_randn("ltx2/txt", (TXT, 24), batch, s),
            audio_encoder_hidden_states=_randn("ltx2/audio_txt", (TXT, 24), batch, s),
            timestep=_t(step, batch), encoder_attention_mask=torch.ones(batch, TXT),
            audio_encoder_attention_mask=torch.ones(batch, TXT),
            num_frames=2, height=4, width=4, audio_num_frames=12,
        )

    return make_model, make_inputs


# A static schedule per unit kind (method, config for forecast order k, scope): decisions depend on the step only, so
# two runs of one model that differ in how the cache is stored (dtype, device) take the same decisions.
STATIC_UNIT_SCHEDULES = {
    "stack": ("fixed_interval", lambda k: {"interval": 2, "forecast_order": k}, "blocks"),
    "block": ("taylorseer", lambda k: {"granularity": "block", "interval": 2, "order": k, "warmup_steps": 1},
              "blocks"),
    "module": ("taylorseer", lambda k: {"granularity": "module", "interval": 2, "order": k, "warmup_steps": 1},
               "blocks"),
    "call": ("fixed_interval", lambda k: {"interval": 2, "forecast_order": k}, "call"),
}
