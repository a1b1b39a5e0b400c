"""Allegro: adapter, inputs and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import scale_shift_table
from .tiny import TXT, Tiny, latents, noise, timestep


def allegro_modulated_input(block, args):
    return scale_shift_table(block, args[HIDDEN], args["temb"])


register_adapter(Adapter(
    model_class="AllegroTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=allegro_modulated_input,
    notes="encoder_hidden_states is cross-attention context.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "allegro": Tiny("AllegroTransformer3DModel", config=dict(
        patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=32, sample_height=8, sample_width=8, sample_frames=2, caption_channels=24,
    ), inputs=dict(
        hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W] -> 32 tokens
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(),
    )),
}
