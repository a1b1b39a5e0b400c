"""Mochi: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import rms_norm_zero_modulated_input
from .tiny import TXT, Tiny, filled, latents, noise, timestep

register_adapter(Adapter(
    model_class="MochiTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff", "ff_context"),
    modulated_input=rms_norm_zero_modulated_input,
    notes="the text stream is narrower than the video stream (pooled_projection_dim); the last block is "
          "context_pre_only and returns encoder_hidden_states unchanged.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "mochi": Tiny("MochiTransformer3DModel", config=dict(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=24, time_embed_dim=16, max_sequence_length=TXT,
    ), inputs=dict(
        hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W] -> 32 tokens
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(),
        encoder_attention_mask=filled(True, TXT, dtype="bool"),
    )),
}
