"""AuraFlow: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import adaln_zero
from .tiny import TXT, Tiny, latents, noise, timestep

register_adapter(Adapter(
    model_class="AuraFlowTransformer2DModel",
    block_lists=(
        BlockList("joint_transformer_blocks", outputs=(ENCODER, HIDDEN)),
        # Single blocks: hidden = [txt ; img] [B, L_txt + L_img, D].
        BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,)),
    ),
    modules=("attn", "ff", "ff_context"),
    modulated_input=adaln_zero(),
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "auraflow": Tiny("AuraFlowTransformer2DModel", config=dict(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32,
        out_channels=4, pos_embed_max_size=16,
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(1.0),
    )),
}
