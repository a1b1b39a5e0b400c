"""HiDream-I1: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import time_embedding
from .tiny import TXT, Tiny, latents, noise, timestep

register_adapter(Adapter(
    model_class="HiDreamImageTransformer2DModel",
    block_lists=(
        # HiDreamBlock wraps the real block in `.block`. encoder = [t5 ; llama_0 ; llama_i] per double block; the
        # model keeps only the first part of the returned encoder stream, then appends the next llama layer.
        BlockList("double_stream_blocks", outputs=(HIDDEN, ENCODER)),
        # Single blocks: hidden = [img ; txt ; llama_i] [B, L_img + L_txt + L_llama, D], returned alone.
        BlockList("single_stream_blocks", encoder=None, outputs=(HIDDEN,)),
    ),
    modules=("block.attn1", "block.ff_i", "block.ff_t"),
    modulated_input=time_embedding("temb"),
    notes="modules sit one level down (HiDreamBlock.block): their names are dotted paths. Modulated input = temb "
          "[B, D] (timestep + pooled-text embedding; TeaCache uses the timestep embedding). ff_i is a MoE.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "hidream": Tiny("HiDreamImageTransformer2DModel", config=dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[24, 16], text_emb_dim=16, num_routed_experts=2,
        num_activated_experts=1, axes_dims_rope=(4, 6, 6), max_resolution=(16, 16), llama_layers=[0, 1, 2, 3],
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        timesteps=timestep(),
        encoder_hidden_states_t5=noise("t5", TXT, 24),
        encoder_hidden_states_llama3=noise("llama", 4, TXT, 16, batch_dim=1),  # [layers, B, T, D_llama]
        pooled_embeds=noise("pooled", 16),
    )),
}
