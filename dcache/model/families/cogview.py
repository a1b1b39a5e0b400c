"""CogView3-Plus and CogView4: adapters and tiny test models."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import text_image_norm_modulated_input
from .tiny import TXT, Tiny, filled, latents, noise, repeated, timestep

register_adapter(Adapter(
    model_class="CogView3PlusTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    modulated_input=lambda block, args: text_image_norm_modulated_input(block, args, emb="emb"),
    notes="`ff` runs once over [text; image] tokens; the time embedding argument is named `emb`.",
))

register_adapter(Adapter(
    model_class="CogView4Transformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    shared=("ff",),
    modulated_input=text_image_norm_modulated_input,
    notes="`ff` is shared: called twice per block (image, then text); one cache per call (Adapter.shared).",
))


# ---- tiny test models ---------------------------------------------------------------------------------------------

_CONFIG = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
               num_attention_heads=2, text_embed_dim=24, time_embed_dim=16, condition_dim=8, pos_embed_max_size=16,
               sample_size=8)
_INPUTS = dict(
    hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
    encoder_hidden_states=noise("txt", TXT, 24),
    timestep=timestep(),
    original_size=repeated([64.0, 64.0]), target_size=repeated([64.0, 64.0]), crop_coords=filled(0.0, 2),
)

TINY = {
    "cogview3plus": Tiny("CogView3PlusTransformer2DModel", config=_CONFIG, inputs=_INPUTS),
    "cogview4": Tiny("CogView4Transformer2DModel", config=dict(_CONFIG, rope_axes_dim=(8, 8)), inputs=_INPUTS),
}
