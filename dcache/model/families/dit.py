"""DiT (class-conditional): adapter and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import basic_block_modulated_input
from .tiny import Tiny, latents, sample_index, timestep

register_adapter(Adapter(
    model_class="DiTTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "ff"),
    modulated_input=basic_block_modulated_input,
    notes="class-conditional: BasicTransformerBlock(norm_type='ada_norm_zero') with no text stream.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "dit": Tiny("DiTTransformer2DModel", config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10,
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        timestep=timestep(),
        class_labels=sample_index(10),
    )),
}
