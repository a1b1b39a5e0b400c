"""Stable Diffusion 3 / 3.5: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import adaln_zero
from .tiny import TXT, Tiny, latents, noise, timestep

register_adapter(Adapter(
    model_class="SD3Transformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),),
    modules=("attn", "attn2", "ff", "ff_context"),
    modulated_input=adaln_zero(),
    notes="the last block is context_pre_only: it returns encoder_hidden_states=None and has no ff_context. "
          "SD3.5 dual-attention blocks add `attn2` (self-attention on the image stream).",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "sd3": Tiny("SD3Transformer2DModel", config=dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm",
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        encoder_hidden_states=noise("txt", TXT, 24),
        pooled_projections=noise("pooled", 16),
        timestep=timestep(),
    ), notes="SD3.5-style: block 0 has dual attention (attn2)"),
}
