"""HunyuanVideo, HunyuanVideo 1.5 and HunyuanVideo-Framepack: adapters, inputs and tiny test models."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import SHAPE_ROPE, SINGLE_BLOCK_COMPOSED, adaln_zero
from .tiny import TXT, Tiny, arange, filled, latents, noise, timestep


def hunyuan_video_modulated_input(block, args):
    # TeaCache4HunyuanVideo: modulate(img_norm1(img), shift_msa, scale_msa) == norm1(h, emb=temb)[0], [B, L_img, D].
    # Image-to-video "token_replace" blocks modulate the first frame's tokens with a second embedding.
    if args.get("token_replace_emb") is not None:
        return block.norm1(args[HIDDEN], args["temb"], args["token_replace_emb"], args["num_tokens"])[0]
    return block.norm1(args[HIDDEN], emb=args["temb"])[0]


register_adapter(Adapter(
    model_class="HunyuanVideoTransformer3DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),
        BlockList("single_transformer_blocks", outputs=(HIDDEN, ENCODER)),
    ),
    modules=("attn", "ff", "ff_context", "proj_mlp", "proj_out"),
    composed=SINGLE_BLOCK_COMPOSED,
    modulated_input=hunyuan_video_modulated_input,
    notes="text refiner (context_embedder.token_refiner) runs on text tokens before the blocks: not a block list. "
          "image_condition_type='token_replace' swaps in TokenReplace block classes with the same slots.",
    invariants=SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="HunyuanVideo15Transformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn", "ff", "ff_context"),
    modulated_input=adaln_zero(),
    notes="text refiner (context_embedder.token_refiner) runs on text tokens before the blocks: not a block list.",
))

register_adapter(Adapter(
    model_class="HunyuanVideoFramepackTransformer3DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),
        BlockList("single_transformer_blocks", outputs=(HIDDEN, ENCODER)),
    ),
    modules=("attn", "ff", "ff_context", "proj_mlp", "proj_out"),
    composed=SINGLE_BLOCK_COMPOSED,
    modulated_input=hunyuan_video_modulated_input,
    notes="HunyuanVideo blocks; the hidden stream also holds the packed history-frame tokens.",
))


# ---- tiny test models ---------------------------------------------------------------------------------------------

_CONFIG = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
               num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
               guidance_embeds=True, text_embed_dim=24, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))
_INPUTS = dict(
    hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W]
    timestep=timestep(),
    encoder_hidden_states=noise("txt", TXT, 24),
    encoder_attention_mask=filled(1.0, TXT),
    pooled_projections=noise("pooled", 16),
    guidance=filled(6000.0),
)

TINY = {
    "hunyuan_video": Tiny("HunyuanVideoTransformer3DModel", config=_CONFIG, inputs=_INPUTS),
    "hunyuan_video_i2v": Tiny(
        "HunyuanVideoTransformer3DModel", config=dict(_CONFIG, image_condition_type="token_replace"),
        inputs=_INPUTS, key="hunyuan_video",
        notes="image_condition_type='token_replace': TokenReplace block classes, first-frame tokens modulated "
              "with t = 0"),
    "hunyuan_video15": Tiny("HunyuanVideo15Transformer3DModel", config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=24, text_embed_2_dim=16, image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    ), inputs=dict(
        hidden_states=latents(4, 2, 4, 4),  # [B, C, F, H, W], 32 tokens
        timestep=timestep(),
        encoder_hidden_states=noise("txt", TXT, 24),
        encoder_attention_mask=filled(1.0, TXT),
        encoder_hidden_states_2=noise("byt5", 4, 16),
        encoder_attention_mask_2=filled(1.0, 4),
        image_embeds=filled(0.0, 4, 16),  # text-to-video: zero image features
    )),
    "hunyuan_video_framepack": Tiny("HunyuanVideoFramepackTransformer3DModel", config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=24,
        pooled_projection_dim=16, rope_axes_dim=(4, 6, 6), has_image_proj=True, image_proj_dim=16,
        has_clean_x_embedder=True,
    ), inputs=dict(
        hidden_states=latents(4, 2, 8, 8),  # [B, C, F, H, W] -> 32 tokens
        timestep=timestep(),
        encoder_hidden_states=noise("txt", TXT, 24),
        encoder_attention_mask=filled(1.0, TXT),
        pooled_projections=noise("pooled", 16),
        image_embeds=noise("image", 4, 16),
        indices_latents=arange(6, 8),  # frame indices [F], shared by the batch
        guidance=filled(6000.0),
        # packed history: clean frames [B, C, 1, H, W], 2x-compressed [B, C, 2, H, W], 4x [B, C, 4, H, W]
        latents_clean=noise("clean", 4, 1, 8, 8), indices_latents_clean=arange(5, 6),
        latents_history_2x=noise("2x", 4, 2, 8, 8),
        indices_latents_history_2x=arange(3, 5),
        latents_history_4x=noise("4x", 4, 4, 8, 8),
        indices_latents_history_4x=arange(0, 4),
    ), key="framepack", notes="history latents (clean, 2x, 4x) are fixed context packed before the noisy tokens"),
}
