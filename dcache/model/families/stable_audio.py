"""Stable Audio: adapter and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .tiny import TXT, Tiny, embedding, latents, noise, timestep

register_adapter(Adapter(
    model_class="StableAudioDiTModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=None,
    notes="audio DiT: the timestep enters as a prepended global token, no AdaLN; encoder_hidden_states is "
          "cross-attention context.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "stable_audio": Tiny("StableAudioDiTModel", config=dict(
        sample_size=16, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        num_key_value_attention_heads=1, out_channels=4, cross_attention_dim=16, time_proj_dim=16,
        global_states_input_dim=16, cross_attention_input_dim=24,
    ), inputs=dict(
        hidden_states=latents(4, 16),  # [B, C, T_audio] -> 1 + 16 tokens
        timestep=timestep(1.0),
        encoder_hidden_states=noise("txt", TXT, 24),
        global_hidden_states=noise("global", 1, 16),
        rotary_embedding=embedding("get_1d_rotary_pos_embed", 8, 17, use_real=True, repeat_interleave_real=False),
    )),
}
