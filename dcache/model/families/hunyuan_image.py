"""Hunyuan's image transformers, HunyuanImage 2.1 and HunyuanDiT: adapters, inputs and tiny test models."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .patterns import SINGLE_BLOCK_COMPOSED, adaln_zero
from .tiny import TXT, Tiny, embedding, filled, latents, noise, repeated, timestep


def hunyuan_dit_modulated_input(block, args):
    # AdaLayerNormShift: norm(h) + shift(temb), [B, L, D] (no scale). Blocks of the second half first fuse their
    # U-Net skip input; the first block has none.
    return block.norm1(args[HIDDEN], args["temb"])


register_adapter(Adapter(
    model_class="HunyuanImageTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),
        BlockList("single_transformer_blocks", outputs=(HIDDEN, ENCODER)),
    ),
    modules=("attn", "ff", "ff_context", "proj_mlp", "proj_out"),
    composed=SINGLE_BLOCK_COMPOSED,
    modulated_input=adaln_zero(),
    notes="text refiner (context_embedder) runs on text tokens before the blocks: not a block list.",
))

register_adapter(Adapter(
    model_class="HunyuanDiT2DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=hunyuan_dit_modulated_input,
    notes="U-Net-like long skips: outputs of the first half are fed as `skip` into the second half. "
          "encoder_hidden_states is cross-attention context.",
))


# ---- tiny test models ---------------------------------------------------------------------------------------------

TINY = {
    "hunyuan_image": Tiny("HunyuanImageTransformer2DModel", config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=(1, 1), text_embed_dim=24,
        rope_axes_dim=(8, 8),
    ), inputs=dict(
        hidden_states=latents(4, 4, 4),  # [B, C, H, W] -> 16 tokens
        timestep=timestep(),
        encoder_hidden_states=noise("txt", TXT, 24),
        encoder_attention_mask=filled(1.0, TXT),
    )),
    "hunyuan_dit": Tiny("HunyuanDiT2DModel", config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=8, hidden_size=32,
        num_layers=4, mlp_ratio=2.0, cross_attention_dim=24, cross_attention_dim_t5=16, pooled_projection_dim=16,
        text_len=TXT, text_len_t5=4,
    ), inputs=dict(
        hidden_states=latents(4, 8, 8),  # [B, C, H, W] -> 16 tokens
        timestep=timestep(),
        encoder_hidden_states=noise("clip", TXT, 24),
        text_embedding_mask=filled(1.0, TXT),
        encoder_hidden_states_t5=noise("t5", 4, 16),
        text_embedding_mask_t5=filled(1.0, 4),
        image_meta_size=repeated([64.0, 64.0, 64.0, 64.0, 0.0, 0.0]),
        style=filled(0, dtype="long"),
        # RoPE of head_dim 16 over the 4x4 token grid
        image_rotary_emb=embedding("get_2d_rotary_pos_embed", 16, ((0, 0), (4, 4)), (4, 4), use_real=True),
    )),
}
