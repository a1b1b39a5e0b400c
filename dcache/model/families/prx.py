"""PRX: adapter, inputs and tiny test model."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .tiny import TXT, Tiny, latents, noise, timestep


def prx_modulated_input(block, args):
    # modulation(temb) -> ((shift, scale, gate) attention, (shift, scale, gate) MLP), each [B, 1, D].
    shift, scale, _ = block.modulation(args["temb"])[0]
    return (1 + scale) * block.img_pre_norm(args[HIDDEN]) + shift


register_adapter(Adapter(
    model_class="PRXTransformer2DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attention", "gate_proj", "up_proj", "down_proj"),
    composed=(("down_proj", ("gate_proj", "up_proj")),),
    modulated_input=prx_modulated_input,
    notes="the MLP is inline: h + gate * down_proj(gelu(gate_proj(x)) * up_proj(x)), so its three projections are "
          "units and down_proj is composed of the other two; text is read as attention context.",
))


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "prx": Tiny("PRXTransformer2DModel", config=dict(
        in_channels=4, patch_size=2, context_in_dim=24, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=2,
        axes_dim=[8, 8],
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        timestep=timestep(),
        encoder_hidden_states=noise("txt", TXT, 24),
    )),
}
