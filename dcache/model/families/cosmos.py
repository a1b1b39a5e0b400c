"""Cosmos: adapter, inputs and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .tiny import TXT, Tiny, latents, noise, timestep


def cosmos_modulated_input(block, args):
    return block.norm1(args[HIDDEN], args["embedded_timestep"], args.get("temb"))[0]


register_adapter(Adapter(
    model_class="CosmosTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=cosmos_modulated_input,
    notes="encoder_hidden_states is cross-attention context (a tensor, or (text, image) tuple).",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "cosmos": Tiny("CosmosTransformer3DModel", config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2, mlp_ratio=2.0,
        text_embed_dim=24, adaln_lora_dim=8, max_size=(4, 16, 16), patch_size=(1, 2, 2), rope_scale=(1.0, 1.0, 1.0),
        concat_padding_mask=False,
    ), inputs=dict(
        hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W] -> 32 tokens
        timestep=timestep(1.0),
        encoder_hidden_states=noise("txt", TXT, 24),
    )),
}
