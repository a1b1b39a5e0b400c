"""LTX-Video and LTX-2 (audio + video): adapters, inputs and tiny test models."""

from __future__ import annotations

import torch

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from ...runtime.latents import unpack_tokens
from .patterns import Args, per_token_table
from .tiny import TXT, Tiny, filled, latents, noise, timestep


def ltx_latents(args: Args) -> torch.Tensor | None:
    # LTX: tokens [B, F*H*W, C] (patch 1) with the latent grid as the num_frames / height / width arguments.
    frames, height, width = args.get("num_frames"), args.get("height"), args.get("width")
    if not all(isinstance(v, int) for v in (frames, height, width)):
        return None
    return unpack_tokens(args[HIDDEN], frames, height, width, 1)


register_adapter(Adapter(
    model_class="LTXVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    latents=ltx_latents,
    modulated_input=per_token_table("temb"),
    notes="encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="LTX2VideoTransformer3DModel",
    # Two evolving streams: video (hidden) and audio. The audio stream takes the adapter's second stream slot
    # (`encoder`), so reuse keeps a separate residual for it; the text contexts of both are read, not returned.
    block_lists=(BlockList("transformer_blocks", encoder="audio_hidden_states", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "attn2", "ff", "audio_attn1", "audio_attn2", "audio_ff", "audio_to_video_attn",
             "video_to_audio_attn"),
    latents=ltx_latents,
    modulated_input=per_token_table("temb"),
    notes="audio + video: the ENCODER slot is the audio stream [B, L_audio, D_audio] (narrower than video).",
))


# ---- tiny test models ---------------------------------------------------------------------------------------------

TINY = {
    "ltx": Tiny("LTXVideoTransformer3DModel", config=dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        num_layers=2, caption_channels=24,
    ), inputs=dict(
        hidden_states=latents(32, 8),  # packed [B, F*H*W = 2*4*4, C]
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(),
        encoder_attention_mask=filled(1.0, TXT),
        num_frames=2, height=4, width=4,
    )),
    "ltx2": Tiny("LTX2VideoTransformer3DModel", config=dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=2, caption_channels=24,
    ), inputs=dict(
        hidden_states=latents(32, 8),  # packed video [B, F*H*W = 2*4*4, C]
        audio_hidden_states=latents(12, 8, key="audio"),  # packed audio [B, T_audio, C]
        encoder_hidden_states=noise("txt", TXT, 24),
        audio_encoder_hidden_states=noise("audio_txt", TXT, 24),
        timestep=timestep(), encoder_attention_mask=filled(1.0, TXT),
        audio_encoder_attention_mask=filled(1.0, TXT),
        num_frames=2, height=4, width=4, audio_num_frames=12,
    ), notes="audio + video: the audio stream is the block's second returned stream (adapter `encoder` slot)"),
}
