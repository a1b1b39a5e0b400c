"""Tiny REAL diffusers pipelines, built offline from configs with random weights, for tests that drive a pipeline's
own `__call__` the way users do (prompt strings through a tokenizer and text encoder, the pipeline's scheduler,
`retrieve_timesteps` with default or custom sigmas / timesteps, the VAE where the call needs it).

    spec = REAL_PIPELINES["flux"]
    pipe = spec.build()                        # a diffusers FluxPipeline, seeded, fp32, eval, progress bar off
    out = pipe(**spec.call(seed=0))            # prompt strings, 4 steps, output_type="latent"
    out = pipe(**spec.call(seed=0, **spec.custom))   # the same with custom sigmas (or timesteps)

Every component is a real diffusers / transformers class with a tiny config (1-2 blocks, widths 8-32, a few dozen
tokens): CLIP / T5 / UMT5 / Llama / Gemma2 / Qwen3 / Qwen2.5-VL / Mistral3 text encoders, word-level tokenizers
made with the `tokenizers` library (`tests/eval/tiny_video.py`, whose Wan builders this file reuses), tiny VAEs.
Nothing is downloaded. A spec's `custom` is None where the pipeline cannot take custom sigmas or timesteps
(`notes` says why); `folder_call` is the cheap call for `dcache generate / eval --model <folder>` (prompt, size,
steps and the extra `--call` arguments).

Import from a test file (pytest's pythonpath holds tests/): `from real_pipelines import REAL_PIPELINES`.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import ProcessorMixin  # diffusers looks a custom component's base class up in its module

STEPS = 4
PROMPT = "a red fox runs in the snow"
NEGATIVE = "a blue cat"


def _tiny_video():
    """tests/eval/tiny_video.py (the word list, the tokenizer and the Wan builders), loaded by path."""
    name = "dcache_tests_tiny_video"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "eval" / "tiny_video.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


VOCAB = len(_tiny_video().WORDS) + 3  # <pad> 0, </s> 1, <unk> 2, then the words
# One chat template for every pipeline that calls apply_chat_template: message contents are strings (Z-Image) or
# lists of {"type": "text", "text": ...} parts (Flux2); the text of every message, space-separated.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                 "{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %} {% endfor %}")


@dataclass(frozen=True)
class RealPipeline:
    name: str
    build: Callable[[], Any]  # -> the pipeline (seeded: two builds hold identical weights)
    kwargs: dict[str, Any]  # the cheap call, without generator / steps (added by call())
    custom: dict[str, Any] | None = None  # custom sigmas / timesteps the pipeline accepts (None: it takes none)
    folder_call: dict[str, Any] = field(default_factory=dict)  # extra call arguments for the CLI (`--call k=v`)
    video: bool = False
    notes: str = ""

    def call(self, seed: int = 0, **extra: Any) -> dict[str, Any]:
        """The pipeline call: fixed prompt, STEPS steps, a fresh generator seeded with `seed`."""
        kwargs = {"num_inference_steps": STEPS, **self.kwargs, **extra}
        if "sigmas" in kwargs or "timesteps" in kwargs:
            kwargs.pop("num_inference_steps")  # the custom schedule sets the step count
        return {**kwargs, "generator": torch.Generator().manual_seed(seed)}


REAL_PIPELINES: dict[str, RealPipeline] = {}


def _register(name: str, kwargs: dict[str, Any], *, custom: dict[str, Any] | None = None,
              folder_call: dict[str, Any] | None = None, video: bool = False, notes: str = ""):
    def wrap(build: Callable[[], Any]):
        def seeded():
            torch.manual_seed(0)
            pipe = build()
            for module in pipe.components.values():
                if isinstance(module, torch.nn.Module):
                    module.float().eval()
            pipe.set_progress_bar_config(disable=True)
            return pipe

        REAL_PIPELINES[name] = RealPipeline(name, seeded, kwargs, custom, folder_call or {}, video, notes)
        return build

    return wrap


# ---- text encoders and tokenizers -------------------------------------------------------------------------------

def _tokenizer(model_max_length: int = 16, chat_template: str | None = None):
    return _tiny_video().tiny_tokenizer(model_max_length=model_max_length, chat_template=chat_template)


def _clip(hidden: int = 16, projection: bool = False):
    """CLIP text encoder; pooled output at the first </s> (id 1). 77 positions: HunyuanVideo pads CLIP to 77."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden,
                            pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=VOCAB, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1,
                                   num_heads=2, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0))


def _flow_match(**config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)


def _kl_vae(latent_channels: int, block_out_channels: tuple[int, ...] = (4,)):
    """AutoencoderKL; one block: vae_scale_factor 1 (latents have the image's height and width)."""
    from diffusers import AutoencoderKL

    n = len(block_out_channels)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=block_out_channels,
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=1,
                         use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.06, scaling_factor=1.5)


def _image(size: int = 16):
    """A fixed RGB test image (a smooth gradient), for the image-conditioned pipelines."""
    import numpy as np
    import PIL.Image

    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1).astype("uint8")
    return PIL.Image.fromarray(rgb)


# ---- Flux family: 16x16 images, vae factor 1 -> 16x16 latents packed 2x2 -> 64 image tokens, 8 text tokens -------

FLUX_CALL = {"prompt": PROMPT, "height": 16, "width": 16, "max_sequence_length": 8, "guidance_scale": 3.5,
             "output_type": "latent"}
FLOW_SIGMAS = {"sigmas": [1.0, 0.8, 0.55, 0.3]}  # custom sigmas, 4 steps (the default is linspace(1, 1/4, 4))


def _flux_transformer(cls_name: str = "FluxTransformer2DModel", **extra):
    import diffusers

    return getattr(diffusers, cls_name)(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        pooled_projection_dim=16, axes_dims_rope=(4, 6, 6), **extra)


def _flux_components() -> dict[str, Any]:
    return dict(scheduler=_flow_match(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
                vae=_kl_vae(latent_channels=1), text_encoder=_clip(16), tokenizer=_tokenizer(), text_encoder_2=_t5(32),
                tokenizer_2=_tokenizer(), transformer=_flux_transformer())


@_register("flux", FLUX_CALL, custom=FLOW_SIGMAS)
def _flux():
    from diffusers import FluxPipeline

    return FluxPipeline(**_flux_components())


@_register("flux_kontext", {**FLUX_CALL, "image": _image(16), "max_area": 16 * 16, "_auto_resize": False},
           custom=FLOW_SIGMAS,
           notes="max_area and _auto_resize=False: the defaults resize the input image and the output to 1024x1024")
def _flux_kontext():
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_flux_components())


@_register("flux_controlnet", {**FLUX_CALL, "control_image": _image(16), "controlnet_conditioning_scale": 0.7},
           custom=FLOW_SIGMAS)
def _flux_controlnet():
    from diffusers import FluxControlNetPipeline

    components = _flux_components()
    controlnet = _flux_transformer("FluxControlNetModel")
    return FluxControlNetPipeline(**components, controlnet=controlnet)


@_register("chroma", {**FLUX_CALL, "negative_prompt": NEGATIVE, "guidance_scale": 4.0}, custom=FLOW_SIGMAS,
           notes="true CFG: a cond and an uncond call per step")
def _chroma():
    from diffusers import ChromaPipeline, ChromaTransformer2DModel

    transformer = ChromaTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
                                           approximator_hidden_dim=32, approximator_layers=1)
    return ChromaPipeline(scheduler=_flow_match(use_dynamic_shifting=True), vae=_kl_vae(latent_channels=1),
                          text_encoder=_t5(32), tokenizer=_tokenizer(), transformer=transformer)


@_register("flux2", {**FLUX_CALL, "text_encoder_out_layers": (1, 2)}, custom=FLOW_SIGMAS,
           notes="text_encoder_out_layers=(1, 2): the 2-layer text encoder has no layers 10, 20, 30")
def _flux2():
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                          timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4))
    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32,
                     "max_position_embeddings": 512, "num_attention_heads": 2, "num_hidden_layers": 2,
                     "num_key_value_heads": 2, "head_dim": 8, "sliding_window": None, "pad_token_id": 0,
                     "eos_token_id": 1},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 32, "image_size": 30, "patch_size": 6, "num_channels": 3},
        pad_token_id=0, eos_token_id=1, image_token_index=2, vision_feature_layer=-1)
    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    return Flux2Pipeline(scheduler=_flow_match(use_dynamic_shifting=True), vae=vae,
                         text_encoder=Mistral3ForConditionalGeneration(config),
                         tokenizer=_tokenizer(512, chat_template=CHAT_TEMPLATE), transformer=transformer)


# ---- SD3: 16x16 images, vae factor 1, patch 2 -> 64 image tokens; CLIP-L/G + T5, batched CFG --------------------

@_register("sd3", {"prompt": PROMPT, "height": 16, "width": 16, "max_sequence_length": 8, "guidance_scale": 5.0,
                   "output_type": "latent"}, custom=FLOW_SIGMAS, notes="batched CFG (one call per step, batch 2)")
def _sd3():
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
                                        pos_embed_max_size=16)
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=_flow_match(shift=3.0),
                                    vae=_kl_vae(latent_channels=4), text_encoder=_clip(16, projection=True),
                                    tokenizer=_tokenizer(), text_encoder_2=_clip(16, projection=True),
                                    tokenizer_2=_tokenizer(), text_encoder_3=_t5(32), tokenizer_3=_tokenizer())


# ---- Qwen-Image: Qwen2.5-VL text encoder, Qwen VAE (factor 2^len(temperal_downsample)) ---------------------------

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                 "<|video_pad|>"]


def _qwen_tokenizer():
    """The word-level tokenizer plus Qwen's chat and vision special tokens (ids VOCAB .. VOCAB + 5)."""
    tokenizer = _tokenizer(1024)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    return tokenizer


def _qwen_vl_text_encoder():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: VOCAB + i for i, t in enumerate(QWEN_SPECIALS)}
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": VOCAB + len(QWEN_SPECIALS), "hidden_size": 16, "intermediate_size": 32,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "fullatt_block_indexes": [0], "window_size": 56},
        vocab_size=VOCAB + len(QWEN_SPECIALS), image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config)


def _qwen_transformer():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                       guidance_embeds=False, axes_dims_rope=(8, 4, 4))


def _qwen_vae(downsamples: int, base_dim: int = 8, num_res_blocks: int = 1):
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(base_dim=base_dim, z_dim=4, dim_mult=[1] * (downsamples + 1),
                                  num_res_blocks=num_res_blocks,
                                  temperal_downsample=[False] * downsamples, latents_mean=[0.0] * 4,
                                  latents_std=[1.0] * 4)


@_register("qwen_image", {"prompt": PROMPT, "negative_prompt": NEGATIVE, "true_cfg_scale": 4.0, "height": 32,
                          "width": 32, "max_sequence_length": 16, "output_type": "latent"}, custom=FLOW_SIGMAS,
           notes="split true CFG (cache_context cond / uncond); 32x32 / vae 4 / patch 2 -> 16 image tokens")
def _qwen_image():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(scheduler=_flow_match(use_dynamic_shifting=True), vae=_qwen_vae(2),
                             text_encoder=_qwen_vl_text_encoder(), tokenizer=_qwen_tokenizer(),
                             transformer=_qwen_transformer())


@_register("qwen_image_controlnet", {"prompt": PROMPT, "negative_prompt": NEGATIVE, "true_cfg_scale": 4.0,
                                     "height": 32, "width": 32, "max_sequence_length": 16, "output_type": "latent",
                                     "control_image": _image(32), "controlnet_conditioning_scale": 0.7},
           custom=FLOW_SIGMAS,
           notes="one ControlNet call per step, shared by the cond and uncond transformer calls (split true CFG); "
                 "the control image is VAE-encoded and packed like the latents")
def _qwen_image_controlnet():
    from diffusers import QwenImageControlNetModel, QwenImageControlNetPipeline

    controlnet = QwenImageControlNetModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                          axes_dims_rope=(8, 4, 4))
    return QwenImageControlNetPipeline(scheduler=_flow_match(use_dynamic_shifting=True), vae=_qwen_vae(2),
                                       text_encoder=_qwen_vl_text_encoder(), tokenizer=_qwen_tokenizer(),
                                       transformer=_qwen_transformer(), controlnet=controlnet)


def wake_controlnet(controlnet: torch.nn.Module, std: float = 0.1, seed: int = 1) -> torch.nn.Module:
    """Redraw the ControlNet's zero-initialised parameters (its input embedder and per-block output projections,
    `zero_module` in diffusers) from N(0, std^2), seeded: a freshly built ControlNet returns all-zero samples, which
    no test of the samples' effect can see."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in controlnet.parameters():
            if not param.any():
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return controlnet


class QwenVLProcessor(ProcessorMixin):
    """Offline stand-in for transformers' Qwen2VLProcessor, whose constructor needs a video processor and so
    torchvision (not a dependency here): the real Qwen2-VL image processor (PIL backend) and the word-level
    tokenizer, with Qwen2VLProcessor's text rule: each <|image_pad|> becomes grid_t * grid_h * grid_w / merge^2
    image tokens, one per merged vision patch, so that the text encoder's image positions line up. A transformers
    ProcessorMixin, so that a saved pipeline folder holds it (processor_config.json, the tokenizer files) and
    DiffusionPipeline.from_pretrained loads it back: model_index.json names it ["real_pipelines",
    "QwenVLProcessor"], importable where tests/conftest.py registered this module, and diffusers finds its load
    method through this module's `ProcessorMixin` name (a released folder names transformers' Qwen2VLProcessor)."""

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)

    def __call__(self, text: list[str], images=None, padding: bool = True, return_tensors: str = "pt"):
        from transformers import BatchFeature

        vision = {} if images is None else dict(self.image_processor(images=images, return_tensors=return_tensors))
        grids = iter(vision.get("image_grid_thw", []))
        merge = self.image_processor.merge_size ** 2
        expanded = []
        for t in text:
            parts = t.split("<|image_pad|>")
            expanded.append(parts[0] + "".join("<|image_pad|>" * int(next(grids).prod() // merge) + rest
                                               for rest in parts[1:]))
        tokens = self.tokenizer(expanded, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**tokens, **vision})


@_register("qwen_image_edit", {"prompt": PROMPT, "image": _image(32), "height": 256, "width": 256,
                               "true_cfg_scale": 1.0, "max_sequence_length": 16, "output_type": "latent"},
           custom=FLOW_SIGMAS,
           notes="the pipeline resizes the input image to ~1024x1024 and VAE-encodes it on every call: a 6-level "
                 "VAE of width 4 without residual blocks (factor 64; ~0.3 s per encode) keeps that at 8x8 image "
                 "tokens (a 256x256 output: 2x2); the processor is QwenVLProcessor (transformers' "
                 "Qwen2VLProcessor needs torchvision): the real Qwen2-VL image processor at 56x56 pixels")
def _qwen_image_edit():
    from diffusers import QwenImageEditPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _qwen_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
    return QwenImageEditPipeline(scheduler=_flow_match(use_dynamic_shifting=True),
                                 vae=_qwen_vae(6, base_dim=4, num_res_blocks=0),
                                 text_encoder=_qwen_vl_text_encoder(), tokenizer=tokenizer,
                                 processor=QwenVLProcessor(image_processor, tokenizer),
                                 transformer=_qwen_transformer())


# ---- Z-Image: Qwen3 text encoder through its chat template ------------------------------------------------------

@_register("z_image", {"prompt": PROMPT, "height": 16, "width": 16, "max_sequence_length": 16, "guidance_scale": 0.0,
                       "output_type": "latent"}, custom=FLOW_SIGMAS)
def _z_image():
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5,
                                           qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
                                           axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    with torch.no_grad():  # created with torch.empty: fix them so that every build is the same
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    text_encoder = Qwen3Model(Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                                          max_position_embeddings=512, pad_token_id=0))
    return ZImagePipeline(scheduler=_flow_match(use_dynamic_shifting=True), vae=_kl_vae(latent_channels=4),
                          text_encoder=text_encoder, tokenizer=_tokenizer(512, chat_template=CHAT_TEMPLATE),
                          transformer=transformer)


# ---- Sana / PixArt-Sigma (resolution binning off: it would resize to 512x512) ------------------------------------

@_register("sana", {"prompt": PROMPT, "height": 32, "width": 32, "max_sequence_length": 8, "guidance_scale": 4.5,
                    "use_resolution_binning": False, "output_type": "latent"}, custom=FLOW_SIGMAS,
           notes="Gemma2 text encoder; the default complex human instruction is prepended (word-level tokens); "
                 "32x32 (Sana's minimum multiple) / vae 2 / patch 2 -> 64 image tokens")
def _sana():
    from diffusers import AutoencoderDC, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    transformer = SanaTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                         num_attention_heads=2, attention_head_dim=8, num_cross_attention_heads=2,
                                         cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
                                         sample_size=16)
    vae = AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2,
                        encoder_block_types=("ResBlock", "EfficientViTBlock"),
                        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
                        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)),
                        decoder_qkv_multiscales=((), (5,)), encoder_layers_per_block=(1, 1),
                        decoder_layers_per_block=[1, 1], downsample_block_type="conv",
                        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
                        scaling_factor=0.41407)
    text_encoder = Gemma2Model(Gemma2Config(head_dim=8, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                            num_hidden_layers=1, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
                                            bos_token_id=2, attn_implementation="eager"))
    return SanaPipeline(tokenizer=_tokenizer(1024), text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=_flow_match(shift=3.0))


@_register("pixart_sigma", {"prompt": PROMPT, "height": 16, "width": 16, "max_sequence_length": 8,
                            "guidance_scale": 4.5, "use_resolution_binning": False, "output_type": "latent"},
           custom={"timesteps": [999, 700, 400, 150]},
           notes="DPMSolverMultistepScheduler (as the released pipeline): custom timesteps, no sigmas")
def _pixart_sigma():
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    transformer = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                           num_layers=2, cross_attention_dim=16, sample_size=8, patch_size=2,
                                           caption_channels=32, use_additional_conditions=False)
    return PixArtSigmaPipeline(tokenizer=_tokenizer(), text_encoder=_t5(32), vae=_kl_vae(latent_channels=4),
                               transformer=transformer, scheduler=DPMSolverMultistepScheduler())


# ---- video ------------------------------------------------------------------------------------------------------

WAN_CALL = {"prompt": PROMPT, "height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 8,
            "guidance_scale": 1.0, "output_type": "latent"}
WAN_NOTE = "WanPipeline calls scheduler.set_timesteps itself: no custom sigmas / timesteps"
WAN22_BOUNDARY = 0.9  # shift 7, 4 steps: timesteps ~1000, 934, 781, 47: 2 high-noise steps, 2 low-noise


@_register("wan21", WAN_CALL, folder_call={"num_frames": 5, "max_sequence_length": 8}, video=True, notes=WAN_NOTE)
def _wan21():
    return _tiny_video().tiny_wan_pipeline(0)


@_register("wan22", WAN_CALL, folder_call={"num_frames": 5, "max_sequence_length": 8}, video=True,
           notes=WAN_NOTE + "; two experts (transformer_2) switched at boundary_ratio")
def _wan22():
    return _tiny_video().tiny_wan_pipeline(0, boundary_ratio=WAN22_BOUNDARY)


@_register("hunyuan_video", {"prompt": PROMPT, "height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 8,
                             "guidance_scale": 6.0, "output_type": "latent"}, custom=FLOW_SIGMAS, video=True,
           notes="Llama + CLIP text encoders, the default prompt template (crop_start 95)")
def _hunyuan_video():
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
    from transformers import LlamaConfig, LlamaModel

    transformer = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                 attention_head_dim=10, num_layers=2, num_single_layers=2,
                                                 num_refiner_layers=1, patch_size=1, patch_size_t=1,
                                                 guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
                                                 rope_axes_dim=(2, 4, 4))
    vae = AutoencoderKLHunyuanVideo(in_channels=3, out_channels=3, latent_channels=4,
                                    down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                                    up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                    layers_per_block=1, act_fn="silu", norm_num_groups=4, scaling_factor=0.476986,
                                    spatial_compression_ratio=8, temporal_compression_ratio=4,
                                    mid_block_add_attention=True)
    llama = LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=2, num_hidden_layers=2, pad_token_id=0, bos_token_id=2,
                                   eos_token_id=1))
    return HunyuanVideoPipeline(text_encoder=llama, tokenizer=_tokenizer(256), transformer=transformer, vae=vae,
                                scheduler=_flow_match(shift=7.0), text_encoder_2=_clip(8), tokenizer_2=_tokenizer(77))


@_register("ltx", {"prompt": PROMPT, "height": 32, "width": 32, "num_frames": 9, "max_sequence_length": 8,
                   "guidance_scale": 3.0, "output_type": "latent"}, video=True,
           notes="LTXPipeline passes its own sigmas to retrieve_timesteps on every call (the default path is the "
                 "sigmas path); its `timesteps` argument cannot be used (it always passes sigmas too); 32x32 x 9 "
                 "frames / vae 8 x 8 -> 2 x 4 x 4 = 32 tokens")
def _ltx():
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline, LTXVideoTransformer3DModel

    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                             num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                                             num_layers=2, caption_channels=32)
    # the decoder has its own widths and depths (defaults: 128-512 channels, 3-4 layers per block, seconds per decode)
    vae = AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                spatio_temporal_scaling=(True, True, True, False), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_block_out_channels=(8, 8, 8, 8), decoder_layers_per_block=(1, 1, 1, 1, 1),
                                patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return LTXPipeline(scheduler=_flow_match(use_dynamic_shifting=True), vae=vae, text_encoder=_t5(32),
                       tokenizer=_tokenizer(), transformer=transformer)


@_register("cogvideox", {"prompt": PROMPT, "height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 8,
                         "guidance_scale": 6.0, "output_type": "latent"}, video=True,
           notes="CogVideoXDDIMScheduler.set_timesteps takes neither sigmas nor timesteps")
def _cogvideox():
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline
    from diffusers import CogVideoXTransformer3DModel

    transformer = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                              out_channels=4, time_embed_dim=8, text_embed_dim=32, num_layers=2,
                                              sample_width=2, sample_height=2, sample_frames=5, patch_size=2,
                                              temporal_compression_ratio=4, max_text_seq_length=8)
    vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=4, layers_per_block=1, norm_num_groups=2,
                                 temporal_compression_ratio=4)
    return CogVideoXPipeline(tokenizer=_tokenizer(), text_encoder=_t5(32), vae=vae, transformer=transformer,
                             scheduler=CogVideoXDDIMScheduler())
