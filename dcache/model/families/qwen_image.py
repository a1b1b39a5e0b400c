"""Qwen-Image: adapter, inputs and tiny test model."""

from __future__ import annotations

from ...compat.diffusers import qwen_image_modulate
from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import image_shapes_latents
from .tiny import TXT, Tiny, filled, latents, noise, per_sample, timestep


def qwen_image_modulated_input(block, args):
    # img_mod(temb) [B', 6*D] -> first half is (shift, scale, gate) of attention; with zero_cond_t the batch is 2B
    # and `modulate_index` [B, L] picks per token between the two halves. Result [B, L_img, D].
    img_mod_attn = block.img_mod(args["temb"]).chunk(2, dim=-1)[0]
    return qwen_image_modulate(block, block.img_norm1(args[HIDDEN]), img_mod_attn, args.get("modulate_index"))[0]


register_adapter(Adapter(
    model_class="QwenImageTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),),
    modules=("attn", "img_mlp", "txt_mlp"),
    latents=image_shapes_latents,
    modulated_input=qwen_image_modulated_input,
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "qwen_image": Tiny("QwenImageTransformer2DModel", config=dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
    ), inputs=dict(
        hidden_states=latents(16, 16),  # packed [B, 4*4, C*2*2]
        encoder_hidden_states=noise("txt", TXT, 24),
        encoder_hidden_states_mask=filled(1, TXT, dtype="long"),
        timestep=timestep(1.0),
        img_shapes=per_sample([(1, 4, 4)]),
    )),
}
