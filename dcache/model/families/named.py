"""Adapters of the families the project names first (Flux, Wan, HunyuanVideo, Qwen-Image, ...), registered on
import (dcache.model.families)."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, Invariant, register_adapter
from .inputs import (SHAPE_ROPE, SINGLE_BLOCK_COMPOSED, adaln_zero, flux_like, basic_block_modulated_input,
                     chroma_modulated_input, flux2_modulated_input, frames_first_latents,
                     hunyuan_video_modulated_input, image_shapes_latents, ltx_latents, packed_latents, per_token_table,
                     qwen_image_modulated_input, rms_norm_zero_modulated_input, sample_list_latents,
                     sana_modulated_input, text_image_norm_modulated_input, time_embedding, z_image_modulated_input)


register_adapter(flux_like("FluxTransformer2DModel"))

register_adapter(Adapter(
    model_class="Flux2Transformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        # Single blocks get encoder_hidden_states=None and hidden = [txt ; img] tokens [B, L_txt + L_img, D].
        BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,)),
    ),
    modules=("attn", "ff", "ff_context"),
    modulated_input=flux2_modulated_input,
    # Flux2 pipelines patchify the VAE latents 2x2 (channels (C, dy, dx)) and pack them row-major, ids (t, h, w, l):
    # the same token layout as Flux, so the same unpacking gives [B, C, 1, 2h, 2w].
    latents=packed_latents,
    notes="single blocks run over the concatenated [text; image] stream; their attention fuses the MLP "
          "(Flux2ParallelSelfAttention), so `attn` is the whole single block.",
    invariants=(Invariant("pos_embed", key="inputs"),),  # pos_embed(img_ids[0]), pos_embed(txt_ids[0])
))

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
    model_class="QwenImageTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),),
    modules=("attn", "img_mlp", "txt_mlp"),
    latents=image_shapes_latents,
    modulated_input=qwen_image_modulated_input,
))

register_adapter(Adapter(
    model_class="SD3Transformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),),
    modules=("attn", "attn2", "ff", "ff_context"),
    modulated_input=adaln_zero(),
    notes="the last block is context_pre_only: it returns encoder_hidden_states=None and has no ff_context. "
          "SD3.5 dual-attention blocks add `attn2` (self-attention on the image stream).",
))

register_adapter(Adapter(
    model_class="PixArtTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=basic_block_modulated_input,
    notes="BasicTransformerBlock(norm_type='ada_norm_single'); encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="SanaTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=sana_modulated_input,
    notes="blocks are called positionally (hidden, mask, encoder, encoder_mask, timestep, height, width); "
          "encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="CogVideoXTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    latents=frames_first_latents,
    modulated_input=time_embedding("temb"),
    notes="`ff` runs once over [text; video] tokens. Modulated input = time embedding `temb` [B, D] (TeaCache).",
))

register_adapter(Adapter(
    model_class="LTXVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    latents=ltx_latents,
    modulated_input=per_token_table("temb"),
    notes="encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="Lumina2Transformer2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn", "feed_forward"),
    modulated_input=rms_norm_zero_modulated_input,
    notes="`layers` run over the joint [caption; image] sequence. Skipped: context_refiner (caption tokens only) and "
          "noise_refiner (image tokens only) run before the join on every call.",
))

# Single blocks take hidden = [txt ; img] [B, L_txt + L_img, D] and return it alone; ControlNet samples are written
# into its image part in place.
register_adapter(flux_like(
    "ChromaTransformer2DModel",
    single=BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,), adds_in_place=True),
    modulated_input=chroma_modulated_input,
    notes="per-block modulation is sliced from one pooled embedding: temb differs per block.",
))

register_adapter(Adapter(
    model_class="HiDreamImageTransformer2DModel",
    block_lists=(
        # HiDreamBlock wraps the real block in `.block`. encoder = [t5 ; llama_0 ; llama_i] per double block; the
        # model keeps only the first part of the returned encoder stream, then appends the next llama layer.
        BlockList("double_stream_blocks", outputs=(HIDDEN, ENCODER)),
        # Single blocks: hidden = [img ; txt ; llama_i] [B, L_img + L_txt + L_llama, D], returned alone.
        BlockList("single_stream_blocks", encoder=None, outputs=(HIDDEN,)),
    ),
    modules=("block.attn1", "block.ff_i", "block.ff_t"),
    modulated_input=time_embedding("temb"),
    notes="modules sit one level down (HiDreamBlock.block): their names are dotted paths. Modulated input = temb "
          "[B, D] (timestep + pooled-text embedding; TeaCache uses the timestep embedding). ff_i is a MoE.",
))

register_adapter(Adapter(
    model_class="AuraFlowTransformer2DModel",
    block_lists=(
        BlockList("joint_transformer_blocks", outputs=(ENCODER, HIDDEN)),
        # Single blocks: hidden = [txt ; img] [B, L_txt + L_img, D].
        BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,)),
    ),
    modules=("attn", "ff", "ff_context"),
    modulated_input=adaln_zero(),
))

register_adapter(Adapter(
    model_class="MochiTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff", "ff_context"),
    modulated_input=rms_norm_zero_modulated_input,
    notes="the text stream is narrower than the video stream (pooled_projection_dim); the last block is "
          "context_pre_only and returns encoder_hidden_states unchanged.",
))

register_adapter(Adapter(
    model_class="DiTTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "ff"),
    modulated_input=basic_block_modulated_input,
    notes="class-conditional: BasicTransformerBlock(norm_type='ada_norm_zero') with no text stream.",
))

register_adapter(Adapter(
    model_class="CogView4Transformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    shared=("ff",),
    modulated_input=text_image_norm_modulated_input,
    notes="`ff` is shared: called twice per block (image, then text); one cache per call (Adapter.shared).",
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
    model_class="ZImageTransformer2DModel",
    block_lists=(BlockList("layers", hidden="x", encoder=None, outputs=(HIDDEN,)),),
    modules=("attention", "feed_forward"),
    modulated_input=z_image_modulated_input,
    latents=sample_list_latents,
    notes="blocks take the stream as `x`: [image ; caption] tokens [B, L_img + L_cap, D]. Skipped: noise_refiner "
          "(image tokens), context_refiner (caption tokens) and siglip_refiner (Omni image features) run before "
          "the join. Model timestep convention: t = 1 - sigma (grows while denoising).",
))
