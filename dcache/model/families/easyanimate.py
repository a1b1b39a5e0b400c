"""EasyAnimate: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import text_image_norm_modulated_input
from .tiny import TXT, Tiny, latents, noise, timestep

register_adapter(Adapter(
    model_class="EasyAnimateTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff", "txt_ff"),
    shared=("ff",),
    modulated_input=text_image_norm_modulated_input,
    notes="without a separate txt_ff the block calls `ff` twice (image, text); one cache per call (Adapter.shared).",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "easyanimate": Tiny("EasyAnimateTransformer3DModel", config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, patch_size=2, sample_width=8,
        sample_height=8, num_layers=2, mmdit_layers=2, time_embed_dim=16, text_embed_dim=24,
    ), inputs=dict(
        hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W] -> 32 tokens
        timestep=timestep(),
        encoder_hidden_states=noise("txt", TXT, 24),
    )),
}
