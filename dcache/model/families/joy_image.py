"""JoyImage-Edit: adapter, inputs and tiny test model."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .tiny import TXT, Tiny, latents, noise, timestep


def joy_image_modulated_input(block, args):
    # img_mod(temb) -> 6 x [B, D]: (shift, scale, gate) for attention, then for the MLP.
    shift, scale = block.img_mod(args["temb"])[:2]
    return block.img_norm1(args[HIDDEN]) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


register_adapter(Adapter(
    model_class="JoyImageEditTransformer3DModel",
    block_lists=(BlockList("double_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn", "img_mlp", "txt_mlp"),
    modulated_input=joy_image_modulated_input,
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "joy_image_edit": Tiny("JoyImageEditTransformer3DModel", config=dict(
        patch_size=[1, 2, 2], in_channels=4, hidden_size=32, num_attention_heads=2, text_dim=24, mlp_width_ratio=2.0,
        num_layers=2, rope_dim_list=[4, 6, 6],
    ), inputs=dict(
        hidden_states=latents(4, 1, 8, 8),  # [B, C, F, H, W] -> 16
        timestep=timestep(),
        encoder_hidden_states=noise("txt", TXT, 24),
    )),
}
