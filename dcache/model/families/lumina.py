"""Lumina 2 and Lumina-Next: adapters and tiny test models."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import rms_norm_zero_modulated_input
from .tiny import TXT, Tiny, embedding, filled, latents, noise, timestep

register_adapter(Adapter(
    model_class="Lumina2Transformer2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn", "feed_forward"),
    modulated_input=rms_norm_zero_modulated_input,
    notes="`layers` run over the joint [caption; image] sequence. Skipped: context_refiner (caption tokens only) and "
          "noise_refiner (image tokens only) run before the join on every call.",
))

register_adapter(Adapter(
    model_class="LuminaNextDiT2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "feed_forward"),
    modulated_input=rms_norm_zero_modulated_input,
    notes="encoder_hidden_states is cross-attention context. attn1 and attn2 outputs are mixed and projected by "
          "attn2.to_out inside the block, so their outputs are pre-projection head tensors.",
))


# ---- tiny test models (Lumina counts from noise to image: t = 1 - sigma) ------------------------------------------

TINY = {
    "lumina2": Tiny("Lumina2Transformer2DModel", config=dict(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
        cap_feat_dim=24,
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        timestep=timestep(reverse=True),
        encoder_hidden_states=noise("txt", TXT, 24),
        encoder_attention_mask=filled(True, TXT, dtype="bool"),
    ), notes="timestep convention t = 1 - sigma"),
    "lumina_next": Tiny("LuminaNextDiT2DModel", config=dict(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_attention_heads=2,
        num_kv_heads=2, multiple_of=16, learn_sigma=False, cross_attention_dim=24,
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        timestep=timestep(reverse=True),
        encoder_hidden_states=noise("txt", TXT, 24),
        encoder_mask=filled(1.0, TXT),
        image_rotary_emb=embedding("get_2d_rotary_pos_embed_lumina", 16, 32, 32),
        cross_attention_kwargs={},
    ), notes="timestep convention t = 1 - sigma"),
}
