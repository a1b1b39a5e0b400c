"""A tiny text-to-video pipeline built offline from configs with random weights: diffusers' `WanPipeline` with a
2-block `WanTransformer3DModel`, a `base_dim=16` `AutoencoderKLWan` (with base_dim 3, as in diffusers' tests, the
random decoder barely responds to its latents), a 1-layer `UMT5EncoderModel` and a word-level
tokenizer made with the `tokenizers` library (no vocabulary file, nothing downloaded).

    path = save_tiny_wan(tmp_path / "wan")      # a pipeline folder: `--model <path>` loads it like any other
    CALL = {"num_frames": 5, "max_sequence_length": 8}   # 5 frames (latent: 2), 16x16 with height/width 16

The sizes follow diffusers' own Wan pipeline tests. A generation of 2 prompts x 5 frames x 4 steps takes well under
a second on one CPU thread.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["a", "red", "blue", "fox", "cat", "runs", "jumps", "in", "the", "snow", "rain", "at", "night", "city"]
HEIGHT = WIDTH = 16
CALL = {"num_frames": 5, "max_sequence_length": 8}
PROMPTS = ["a red fox runs in the snow", "a blue cat jumps at night"]


def tiny_tokenizer(model_max_length: int | None = None, chat_template: str | None = None):
    """Word-level tokenizer over WORDS (ids: <pad> 0, </s> 1, <unk> 2, words from 3; len(WORDS) + 3 in all).

    model_max_length: what pipelines that pad to `tokenizer.model_max_length` (CLIP's 77 in Flux / SD3) pad to.
    chat_template: a Jinja template for pipelines that call `apply_chat_template` (Z-Image, Flux2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])  # as T5
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                        **extra)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_wan_pipeline(seed: int = 0, boundary_ratio: float | None = None):
    """Wan 2.1 (one transformer); with boundary_ratio, Wan 2.2 A14B style: `transformer` denoises the steps with
    t >= boundary_ratio * 1000 (high noise) and `transformer_2`, a second expert of the same shape with its own
    weights, the rest."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(WORDS) + 3, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                               num_heads=4, relative_attention_num_buckets=8, pad_token_id=0,
                                               eos_token_id=1, decoder_start_token_id=0)).eval()
    vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    if boundary_ratio is None:
        return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                           scheduler=scheduler)
    transformer_2 = WanTransformer3DModel.from_config(transformer.config)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       transformer_2=transformer_2, scheduler=scheduler, boundary_ratio=boundary_ratio)


def save_tiny_wan(path: str | Path, seed: int = 0) -> Path:
    path = Path(path)
    tiny_wan_pipeline(seed).save_pretrained(path)
    return path
