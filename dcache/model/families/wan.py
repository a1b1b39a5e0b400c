"""Wan and the Wan-style video DiTs (Wan VACE, SkyReels-V2, ChronoEdit, AnyFlow): adapters and tiny test models."""

from __future__ import annotations

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import SHAPE_ROPE, time_embedding
from .tiny import TXT, Tiny, latents, noise, timestep

register_adapter(Adapter(
    model_class="WanTransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=time_embedding("temb"),
    notes="encoder_hidden_states is cross-attention context (read, not returned). Modulated input = the block's "
          "`temb` = timestep_proj [B, 6, D] (TeaCache's `e0`, the use_ret_steps coefficients).",
    invariants=SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="SkyReelsV2Transformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=time_embedding("temb"),
    notes="Wan-style. Modulated input = timestep_proj [B, 6, D] (or [B, 6, L, D] with diffusion forcing).",
    invariants=SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="ChronoEditTransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=time_embedding("temb"),
    notes="Wan-style blocks; modulated input = timestep_proj [B, 6, D].",
    invariants=SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="WanVACETransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=time_embedding("temb"),
    notes="Skipped: vace_blocks run first over the control stream and produce hints that the model adds after "
          "some main blocks (outside the blocks, so a whole-stack residual includes them). Reusing the main "
          "stack does not skip the VACE blocks.",
    invariants=SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="AnyFlowTransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=time_embedding("temb"),
    notes="Wan-style blocks with per-token modulation: temb = timestep_proj [B, L, 6, D] (from t and r).",
))


# ---- tiny test models ---------------------------------------------------------------------------------------------

_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
               text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32)
_INPUTS = dict(
    hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W] -> 2*4*4 = 32 tokens
    encoder_hidden_states=noise("txt", TXT, 24),
    timestep=timestep(),
)

TINY = {
    "wan": Tiny("WanTransformer3DModel", config=_CONFIG, inputs=_INPUTS),
    "wan22_ti2v": Tiny(
        "WanTransformer3DModel", config=_CONFIG,
        # one timestep per token [B, L] (2 frames x 4 x 4 tokens); the first latent frame is the given image, t = 0
        inputs=dict(_INPUTS, timestep=timestep(tokens=32, clean=16)),
        notes="Wan 2.2 TI2V: one timestep per token [B, L]; the first (conditioning) frame is clean, t = 0"),
    "skyreels_v2": Tiny("SkyReelsV2Transformer3DModel", config=_CONFIG, inputs=_INPUTS),
    "chronoedit": Tiny("ChronoEditTransformer3DModel", config=_CONFIG, inputs=_INPUTS),
    "wan_vace": Tiny("WanVACETransformer3DModel", config=dict(_CONFIG, vace_layers=[0, 1], vace_in_channels=8),
                     # control video [B, vace_in_channels, F, H, W]: fixed across steps like a real conditioning video
                     inputs=dict(_INPUTS, control_hidden_states=noise("control", 8, 2, 8, 8))),
    "anyflow": Tiny("AnyFlowTransformer3DModel", config=_CONFIG, inputs=dict(
        hidden_states=latents(2, 4, 8, 8),  # [B, F, C, H, W] -> 32 tokens
        # one timestep per latent frame [B, F]; the flow map goes from t to the next step's r
        timestep=timestep(tokens=2), r_timestep=timestep(tokens=2, ahead=1),
        encoder_hidden_states=noise("txt", TXT, 24),
    )),
}
