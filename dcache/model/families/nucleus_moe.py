"""Nucleus-MoE-Image: adapter, inputs and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import image_shapes_latents
from .tiny import TXT, Tiny, filled, latents, noise, per_sample, timestep


def nucleus_moe_modulated_input(block, args):
    # img_mod(temb) [B, 4*D] -> (scale1, gate1, scale2, gate2) each [B, 1, D]; attention input = norm(h)*(1+scale1).
    scale1 = block.img_mod(args["temb"]).unsqueeze(1).chunk(4, dim=-1)[0]
    return block.pre_attn_norm(args[HIDDEN]) * (1 + scale1)


register_adapter(Adapter(
    model_class="NucleusMoEImageTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn", "img_mlp"),
    latents=image_shapes_latents,
    modulated_input=nucleus_moe_modulated_input,
    notes="image tokens attend to projected text (encoder_proj inside the block); the text stream is read, not "
          "returned. img_mlp is a routed MoE (dense in the first and last blocks).",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "nucleus_moe_image": Tiny("NucleusMoEImageTransformer2DModel", config=dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6), num_experts=4, moe_intermediate_dim=32,
        dense_moe_strategy="leave_first_three_and_last_block_dense",
    ), inputs=dict(
        hidden_states=latents(16, 16),  # packed [B, 4*4, C*2*2]
        img_shapes=per_sample((1, 4, 4)),
        encoder_hidden_states=noise("txt", TXT, 24),
        encoder_hidden_states_mask=filled(1, TXT, dtype="long"),
        timestep=timestep(1.0),
    )),
}
