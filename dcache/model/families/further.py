"""Adapters of the further families, alphabetically, registered on import (dcache.model.families)."""

from __future__ import annotations

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter
from .inputs import (SHAPE_ROPE, SINGLE_BLOCK_COMPOSED, adaln_zero, flux_like, allegro_modulated_input,
                     channels_last_latents, cosmos_modulated_input, frames_first_latents, hunyuan_dit_modulated_input,
                     hunyuan_video_modulated_input, image_shapes_latents, joy_image_modulated_input,
                     kandinsky5_modulated_input, ltx_latents, nucleus_moe_modulated_input, per_token_table,
                     prx_modulated_input, rms_norm_zero_modulated_input, text_image_norm_modulated_input,
                     time_embedding)


register_adapter(Adapter(
    model_class="AllegroTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=allegro_modulated_input,
    notes="encoder_hidden_states is cross-attention context.",
))

# ControlNet single-block samples are written in place (as Chroma's)
register_adapter(flux_like("BriaTransformer2DModel", single=BlockList(
    "single_transformer_blocks", outputs=(ENCODER, HIDDEN), adds_in_place=True)))

# Single blocks: hidden = [txt ; img] [B, L_txt + L_img, D].
register_adapter(flux_like(
    "BriaFiboTransformer2DModel", single=BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,)),
    invariants=(),
    notes="each block reads its own slice of the text-encoder layers (mixed into the text stream outside blocks).",
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
    model_class="CogView3PlusTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    modulated_input=lambda block, args: text_image_norm_modulated_input(block, args, emb="emb"),
    notes="`ff` runs once over [text; image] tokens; the time embedding argument is named `emb`.",
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

register_adapter(Adapter(
    model_class="CosmosTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=cosmos_modulated_input,
    notes="encoder_hidden_states is cross-attention context (a tensor, or (text, image) tuple).",
))

register_adapter(Adapter(
    model_class="EasyAnimateTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff", "txt_ff"),
    shared=("ff",),
    modulated_input=text_image_norm_modulated_input,
    notes="without a separate txt_ff the block calls `ff` twice (image, text); one cache per call (Adapter.shared).",
))

register_adapter(Adapter(
    model_class="HunyuanDiT2DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=hunyuan_dit_modulated_input,
    notes="U-Net-like long skips: outputs of the first half are fed as `skip` into the second half. "
          "encoder_hidden_states is cross-attention context.",
))

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

register_adapter(Adapter(
    model_class="Kandinsky5Transformer3DModel",
    block_lists=(BlockList("visual_transformer_blocks", hidden="visual_embed", encoder=None, outputs=(HIDDEN,)),),
    modules=("self_attention", "cross_attention", "feed_forward"),
    latents=channels_last_latents,
    modulated_input=kandinsky5_modulated_input,
    notes="blocks take the stream as `visual_embed`; text_embed is cross-attention context. Skipped: "
          "text_transformer_blocks (text tokens only) run before the visual blocks.",
))

register_adapter(flux_like("LongCatImageTransformer2DModel", invariants=()))

register_adapter(Adapter(
    model_class="LuminaNextDiT2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "feed_forward"),
    modulated_input=rms_norm_zero_modulated_input,
    notes="encoder_hidden_states is cross-attention context. attn1 and attn2 outputs are mixed and projected by "
          "attn2.to_out inside the block, so their outputs are pre-projection head tensors.",
))

register_adapter(Adapter(
    model_class="OmniGenTransformer2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("self_attn", "mlp"),
    modulated_input=None,
    notes="LLM-style (Phi-3) blocks over [condition ; time ; image] tokens; the timestep enters as a token, no "
          "AdaLN, so no modulated input.",
))

register_adapter(flux_like("OvisImageTransformer2DModel", invariants=()))

register_adapter(Adapter(
    model_class="SanaVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=per_token_table("timestep"),
    notes="encoder_hidden_states is cross-attention context.",
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

register_adapter(Adapter(
    model_class="JoyImageEditTransformer3DModel",
    block_lists=(BlockList("double_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn", "img_mlp", "txt_mlp"),
    modulated_input=joy_image_modulated_input,
))

register_adapter(Adapter(
    model_class="NucleusMoEImageTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn", "img_mlp"),
    latents=image_shapes_latents,
    modulated_input=nucleus_moe_modulated_input,
    notes="image tokens attend to projected text (encoder_proj inside the block); the text stream is read, not "
          "returned. img_mlp is a routed MoE (dense in the first and last blocks).",
))

register_adapter(Adapter(
    model_class="PRXTransformer2DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attention", "gate_proj", "up_proj", "down_proj"),
    composed=(("down_proj", ("gate_proj", "up_proj")),),
    modulated_input=prx_modulated_input,
    notes="the MLP is inline: h + gate * down_proj(gelu(gate_proj(x)) * up_proj(x)), so its three projections are "
          "units and down_proj is composed of the other two; text is read as attention context.",
))

register_adapter(Adapter(
    model_class="StableAudioDiTModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=None,
    notes="audio DiT: the timestep enters as a prepended global token, no AdaLN; encoder_hidden_states is "
          "cross-attention context.",
))

register_adapter(Adapter(
    model_class="LTX2VideoTransformer3DModel",
    # Two evolving streams: video (hidden) and audio. The audio stream takes the adapter's second stream slot
    # (`encoder`), so reuse keeps a separate residual for it; the text contexts of both are read, not returned.
    block_lists=(BlockList("transformer_blocks", encoder="audio_hidden_states", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "attn2", "ff", "audio_attn1", "audio_attn2", "audio_ff", "audio_to_video_attn",
             "video_to_audio_attn"),
    latents=ltx_latents,
    modulated_input=per_token_table("temb"),
    notes="audio + video: the ENCODER slot is the audio stream [B, L_audio, D_audio] (narrower than video).",
))
