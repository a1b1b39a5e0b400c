"""PixArt-alpha / PixArt-sigma: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import basic_block_modulated_input
from .tiny import TXT, Tiny, latents, noise, timestep

register_adapter(Adapter(
    model_class="PixArtTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=basic_block_modulated_input,
    notes="BasicTransformerBlock(norm_type='ada_norm_single'); encoder_hidden_states is cross-attention context.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "pixart": Tiny("PixArtTransformer2DModel", config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=24, use_additional_conditions=False,
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
    )),
}
