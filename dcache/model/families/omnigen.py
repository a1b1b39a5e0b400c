"""OmniGen: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .tiny import TXT, Tiny, arange, filled, latents, timestep, token_ids

register_adapter(Adapter(
    model_class="OmniGenTransformer2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("self_attn", "mlp"),
    modulated_input=None,
    notes="LLM-style (Phi-3) blocks over [condition ; time ; image] tokens; the timestep enters as a token, no "
          "AdaLN, so no modulated input.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

_LENGTH = TXT + 1 + 16  # [condition tokens ; time token ; 4*4 image tokens]

TINY = {
    "omnigen": Tiny("OmniGenTransformer2DModel", config=dict(
        in_channels=4, patch_size=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, num_layers=2, vocab_size=64, pad_token_id=0, max_position_embeddings=64,
        rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8}, original_max_position_embeddings=64,
        pos_embed_max_size=16, time_step_dim=16,
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W]
        timestep=timestep(1.0),
        input_ids=token_ids("ids", TXT, 64), input_img_latents=[], input_image_sizes={},
        attention_mask=filled(1.0, _LENGTH, _LENGTH),
        position_ids=arange(_LENGTH, batched=True),
    ), notes="text-only condition tokens, no input images"),
}
