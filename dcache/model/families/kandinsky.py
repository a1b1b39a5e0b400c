"""Kandinsky 5: adapter, inputs and tiny test model."""

from __future__ import annotations

import torch

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import Args
from .tiny import TXT, Tiny, arange, latents, noise, timestep


def kandinsky5_modulated_input(block, args):
    # visual_modulation(time_embed) [B, 1, 9*D] -> (self-attn, cross-attn, ff) x (shift, scale, gate).
    shift, scale, _ = torch.chunk(torch.chunk(block.visual_modulation(args["time_embed"]).unsqueeze(1), 3, dim=-1)[0],
                                  3, dim=-1)
    return block.self_attention_norm(args["visual_embed"]) * (scale + 1.0) + shift


def channels_last_latents(args: Args) -> torch.Tensor:
    # Kandinsky 5: visual latents [B, F, H, W, C] -> [B, C, F, H, W].
    return args[HIDDEN].permute(0, 4, 1, 2, 3)


register_adapter(Adapter(
    model_class="Kandinsky5Transformer3DModel",
    block_lists=(BlockList("visual_transformer_blocks", hidden="visual_embed", encoder=None, outputs=(HIDDEN,)),),
    modules=("self_attention", "cross_attention", "feed_forward"),
    latents=channels_last_latents,
    modulated_input=kandinsky5_modulated_input,
    notes="blocks take the stream as `visual_embed`; text_embed is cross-attention context. Skipped: "
          "text_transformer_blocks (text tokens only) run before the visual blocks.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "kandinsky5": Tiny("Kandinsky5Transformer3DModel", config=dict(
        in_visual_dim=4, in_text_dim=24, in_text_dim2=16, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6),
    ), inputs=dict(
        hidden_states=latents(2, 8, 8, 4),  # [B, F, H, W, C] channels last
        encoder_hidden_states=noise("txt", TXT, 24),
        pooled_projections=noise("pooled", 16),
        timestep=timestep(),
        visual_rope_pos=[arange(2), arange(4), arange(4)],
        text_rope_pos=arange(TXT),
    )),
}
