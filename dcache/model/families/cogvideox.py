"""CogVideoX and the CogVideoX-style ConsisID: adapters, inputs and tiny test models."""

from __future__ import annotations

import torch

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import Args, time_embedding
from .tiny import TXT, Tiny, latents, noise, timestep


def frames_first_latents(args: Args) -> torch.Tensor:
    # CogVideoX-style latents [B, F, C, H, W] -> [B, C, F, H, W].
    return args[HIDDEN].transpose(1, 2)


register_adapter(Adapter(
    model_class="CogVideoXTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    latents=frames_first_latents,
    modulated_input=time_embedding("temb"),
    notes="`ff` runs once over [text; video] tokens. Modulated input = time embedding `temb` [B, D] (TeaCache).",
))

register_adapter(Adapter(
    model_class="ConsisIDTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    latents=frames_first_latents,
    modulated_input=time_embedding("temb"),
    notes="CogVideoX-style blocks. Identity-preserving local facial extractor adds to hidden_states between some "
          "blocks (outside the blocks): included in a whole-stack residual.",
))


# ---- tiny test models ---------------------------------------------------------------------------------------------

_CONFIG = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
               text_embed_dim=24, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
               max_text_seq_length=TXT)
_INPUTS = dict(
    hidden_states=latents(3, 4, 8, 8),  # [B, F, C, H, W] -> 48 tokens
    encoder_hidden_states=noise("txt", TXT, 24),
    timestep=timestep(),
)

TINY = {
    "cogvideox": Tiny("CogVideoXTransformer3DModel", config=_CONFIG, inputs=_INPUTS),
    "consisid": Tiny("ConsisIDTransformer3DModel", config=_CONFIG, inputs=_INPUTS,
                     notes="without the face (id) conditioning inputs"),
}
