"""Sana and Sana-Video: adapters, inputs and tiny test models."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import per_token_table, scale_shift_table
from .tiny import TXT, Tiny, latents, noise, timestep


def sana_modulated_input(block, args):
    return scale_shift_table(block, args[HIDDEN], args["timestep"])


register_adapter(Adapter(
    model_class="SanaTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=sana_modulated_input,
    notes="blocks are called positionally (hidden, mask, encoder, encoder_mask, timestep, height, width); "
          "encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="SanaVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=per_token_table("timestep"),
    notes="encoder_hidden_states is cross-attention context.",
))


# ---- tiny test models ---------------------------------------------------------------------------------------------

TINY = {
    "sana": Tiny("SanaTransformer2DModel", config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
        sample_size=8, patch_size=1,
    ), inputs=dict(
        hidden_states=latents(4, 4, 4),  # [B, C, H, W] -> 16 tokens
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(),
    )),
    "sana_video": Tiny("SanaVideoTransformer3DModel", config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
        sample_size=8, patch_size=(1, 2, 2), rope_max_seq_len=32,
    ), inputs=dict(
        hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W] -> 32 tokens
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(),
    )),
}
