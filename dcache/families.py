"""Per-family adapter data for diffusers transformers (registered on import by dcache.adapters).

One `register_adapter(Adapter(...))` per transformer class, checked against diffusers 0.42 source. For each family:

- `block_lists`: only the `ModuleList`s that run inside the main denoising pass over the latent token stream, in
  execution order. Refiner lists that run first over a *different* token set (text-only context refiners, image-only
  noise refiners, VACE control blocks) are left out and named in `notes`: reuse of the main stack stays correct
  because they run before it on every call.
- `hidden` / `encoder`: the block-forward argument names. `encoder` is set only where the block RETURNS an updated
  text stream; a cross-attention context the block only reads is not a stream (encoder=None), so reuse leaves it be.
- `outputs`: the order of the block's returned tensors (Flux-style blocks return (encoder, hidden); HunyuanVideo /
  CogVideoX-style return (hidden, encoder); single-stream and cross-attention blocks return hidden alone).
- `modules`: inner units whose output can be cached and returned as-is. A module that a block calls more than once
  (one FFN shared by the text and image streams: CogView4, EasyAnimate) is also listed in `shared`, and gets one
  cache per call within the block.
- `modulated_input`: TeaCache's signal, the timestep-modulated input of the first block, computed from that block's
  bound forward arguments without side effects (TeaCache, arXiv 2411.19108). None where the family has no AdaLN-style
  modulation of the hidden stream.

Tiny configs of every family here live in tests/zoo.py; tests/test_zoo.py checks this data against real forwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .adapters import ENCODER, HIDDEN, Adapter, BlockList, Invariant, register_adapter
from .latents import packed_2x2_latents, unpack_tokens

Args = dict[str, Any]  # the first block's bound forward arguments: name -> value


# ----------------------------------------------------------------------------------------------------------------
# Modulated-input helpers shared by several families. Each returns the input of the first attention after AdaLN
# modulation, [B, L, D], unless its comment says otherwise.
# ----------------------------------------------------------------------------------------------------------------

def _adaln_zero(norm: str = "norm1", emb: str = "temb"):
    """AdaLayerNormZero-style `block.<norm>(h, emb=<emb>)` whose first returned tensor is norm(h)*(1+scale)+shift."""

    def modulated_input(block: nn.Module, args: Args) -> torch.Tensor:
        return getattr(block, norm)(args[HIDDEN], emb=args[emb])[0]

    return modulated_input


def _scale_shift_table(block: nn.Module, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    # PixArt-alpha "ada_norm_single": temb [B, 6*D] (already projected by the model) + table [6, D]
    #   -> shift_msa, scale_msa, ... each [B, 1, D];  norm1(h) * (1 + scale_msa) + shift_msa: [B, L, D]
    batch = hidden.shape[0]
    shift_msa, scale_msa = (block.scale_shift_table[None] + temb.reshape(batch, 6, -1)).chunk(6, dim=1)[:2]
    return block.norm1(hidden) * (1 + scale_msa) + shift_msa


def _flux2_modulated_input(block, args):
    # temb_mod_img [B, 6*D] (or [B, 1, 6*D]) -> (shift, scale, gate) x (attention, MLP), each [B, 1, D].
    mod = args["temb_mod_img"]
    mod = mod.unsqueeze(1) if mod.ndim == 2 else mod
    shift_msa, scale_msa = mod.chunk(6, dim=-1)[:2]
    return (1 + scale_msa) * block.norm1(args[HIDDEN]) + shift_msa


def _hunyuan_video_modulated_input(block, args):
    # TeaCache4HunyuanVideo: modulate(img_norm1(img), shift_msa, scale_msa) == norm1(h, emb=temb)[0], [B, L_img, D].
    # Image-to-video "token_replace" blocks modulate the first frame's tokens with a second embedding.
    if args.get("token_replace_emb") is not None:
        return block.norm1(args[HIDDEN], args["temb"], args["token_replace_emb"], args["num_tokens"])[0]
    return block.norm1(args[HIDDEN], emb=args["temb"])[0]


def _qwen_image_modulated_input(block, args):
    # img_mod(temb) [B', 6*D] -> first half is (shift, scale, gate) of attention; with zero_cond_t the batch is 2B
    # and `modulate_index` [B, L] picks per token between the two halves. Result [B, L_img, D].
    img_mod_attn = block.img_mod(args["temb"]).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(args[HIDDEN]), img_mod_attn, args.get("modulate_index"))[0]


def _basic_block_modulated_input(block, args):
    # diffusers.models.attention.BasicTransformerBlock, by its `norm_type`:
    #   "ada_norm_single" (PixArt): scale/shift table + projected timestep [B, 6*D]
    #   "ada_norm_zero"   (DiT):    AdaLayerNormZero(h, timestep, class_labels)[0] (embeds t and class inside)
    h = args[HIDDEN]
    if block.norm_type == "ada_norm_single":
        return _scale_shift_table(block, h, args["timestep"])
    if block.norm_type == "ada_norm_zero":
        return block.norm1(h, args["timestep"], args.get("class_labels"), hidden_dtype=h.dtype)[0]
    if block.norm_type == "ada_norm":
        return block.norm1(h, args["timestep"])
    raise TypeError(f"BasicTransformerBlock with norm_type={block.norm_type!r} has no timestep modulation; "
                    "use a schedule that does not need the modulated input.")


def _sana_modulated_input(block, args):
    return _scale_shift_table(block, args[HIDDEN], args["timestep"])


def _time_embedding(name: str):
    """Families whose TeaCache signal is the time embedding itself (CogVideoX: `emb`; Wan: `e0`; HiDream: `temb`)."""

    def modulated_input(block: nn.Module, args: Args) -> torch.Tensor:
        return args[name]

    return modulated_input


def _per_token_table(emb: str):
    """LTX / Sana-Video: emb [B, T, 6*D] (T = 1, or one per token) + table [6, D] -> shift/scale [B, T, D]."""

    def modulated_input(block: nn.Module, args: Args) -> torch.Tensor:
        h, e = args[HIDDEN], args[emb]
        table = block.scale_shift_table
        shift_msa, scale_msa = (table[None, None] + e.reshape(h.shape[0], e.size(1), table.shape[0], -1)).unbind(2)[:2]
        return block.norm1(h) * (1 + scale_msa) + shift_msa

    return modulated_input


def _rms_norm_zero_modulated_input(block, args):
    # Lumina / Lumina-Next / Mochi: RMSNormZero(h, temb) -> (norm(h) * (1 + scale_msa), gates...), [B, L, D].
    return block.norm1(args[HIDDEN], args["temb"])[0]


def _chroma_modulated_input(block, args):
    # Chroma's pruned AdaLN: temb [B, 12, D] holds precomputed (shift, scale, gate)x2 for image then text.
    return block.norm1(args[HIDDEN], emb=args["temb"][:, :6])[0]


def _text_image_norm_modulated_input(block, args, emb: str = "temb"):
    # CogView3Plus / CogView4 / CogVideoX-style norms take (h, encoder, temb) and return the modulated image first.
    return block.norm1(args[HIDDEN], args[ENCODER], args[emb])[0]


def _z_image_modulated_input(block, args):
    # adaLN_modulation(adaln_input) [B, 4*D] -> (scale_msa, gate_msa, scale_mlp, gate_mlp); input of attention is
    # attention_norm1(x) * (1 + scale_msa): [B, L_img + L_txt, D]. Omni mode passes per-token noisy/clean embeddings
    # instead; the noisy one is used (the clean tokens do not change between steps).
    emb = args.get("adaln_input")
    if emb is None:
        emb = args["adaln_noisy"]
    scale_msa = block.adaLN_modulation(emb).unsqueeze(1).chunk(4, dim=2)[0]
    return block.attention_norm1(args["x"]) * (1.0 + scale_msa)


def _allegro_modulated_input(block, args):
    return _scale_shift_table(block, args[HIDDEN], args["temb"])


def _cosmos_modulated_input(block, args):
    return block.norm1(args[HIDDEN], args["embedded_timestep"], args.get("temb"))[0]


def _hunyuan_dit_modulated_input(block, args):
    # AdaLayerNormShift: norm(h) + shift(temb), [B, L, D] (no scale). Blocks of the second half first fuse their
    # U-Net skip input; the first block has none.
    return block.norm1(args[HIDDEN], args["temb"])


def _kandinsky5_modulated_input(block, args):
    # visual_modulation(time_embed) [B, 1, 9*D] -> (self-attn, cross-attn, ff) x (shift, scale, gate).
    shift, scale, _ = torch.chunk(torch.chunk(block.visual_modulation(args["time_embed"]).unsqueeze(1), 3, dim=-1)[0],
                                  3, dim=-1)
    return block.self_attention_norm(args["visual_embed"]) * (scale + 1.0) + shift


def _nucleus_moe_modulated_input(block, args):
    # img_mod(temb) [B, 4*D] -> (scale1, gate1, scale2, gate2) each [B, 1, D]; attention input = norm(h)*(1+scale1).
    scale1 = block.img_mod(args["temb"]).unsqueeze(1).chunk(4, dim=-1)[0]
    return block.pre_attn_norm(args[HIDDEN]) * (1 + scale1)


def _prx_modulated_input(block, args):
    # modulation(temb) -> ((shift, scale, gate) attention, (shift, scale, gate) MLP), each [B, 1, D].
    shift, scale, _ = block.modulation(args["temb"])[0]
    return (1 + scale) * block.img_pre_norm(args[HIDDEN]) + shift


def _joy_image_modulated_input(block, args):
    # img_mod(temb) -> 6 x [B, D]: (shift, scale, gate) for attention, then for the MLP.
    shift, scale = block.img_mod(args["temb"])[:2]
    return block.img_norm1(args[HIDDEN]) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _packed_latents(args: Args) -> torch.Tensor | None:
    # Flux-style pipelines pack 2x2 latent pixels per token, [B, h*w, C*4], with img_ids [h*w, 3] (row, column in
    # columns 1, 2): unpacked to [B, C, 1, 2h, 2w] (dcache.latents).
    return packed_2x2_latents(args[HIDDEN], args.get("img_ids"))


def _sample_list_latents(args: Args) -> torch.Tensor | None:
    # Z-Image: `x` is a list of per-sample latents [C, F, H, W]; stacked to [B, C, F, H, W] when they share a shape
    # (else no layout).
    xs = args.get("x")
    if not isinstance(xs, (list, tuple)) or not xs or not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in xs):
        return None
    if any(t.shape != xs[0].shape for t in xs):
        return None
    return torch.stack(list(xs))


def _frames_first_latents(args: Args) -> torch.Tensor:
    # CogVideoX-style latents [B, F, C, H, W] -> [B, C, F, H, W].
    return args[HIDDEN].transpose(1, 2)


def _image_shapes_latents(args: Args) -> torch.Tensor | None:
    # Qwen-Image-style: 2x2-packed tokens [B, L, C*4]; img_shapes[sample] = [(frames, h, w) of the generated image,
    # then of each reference image]. The generated image's tokens come first.
    shapes = args.get("img_shapes")
    first = shapes[0] if shapes else None
    first = first[0] if isinstance(first, list) and first else first
    if not isinstance(first, tuple) or len(first) != 3:
        return None
    return unpack_tokens(args[HIDDEN], *(int(v) for v in first), 2)


def _ltx_latents(args: Args) -> torch.Tensor | None:
    # LTX: tokens [B, F*H*W, C] (patch 1) with the latent grid as the num_frames / height / width arguments.
    frames, height, width = args.get("num_frames"), args.get("height"), args.get("width")
    if not all(isinstance(v, int) for v in (frames, height, width)):
        return None
    return unpack_tokens(args[HIDDEN], frames, height, width, 1)


def _channels_last_latents(args: Args) -> torch.Tensor:
    # Kandinsky 5: visual latents [B, F, H, W, C] -> [B, C, F, H, W].
    return args[HIDDEN].permute(0, 4, 1, 2, 3)


# ----------------------------------------------------------------------------------------------------------------
# The registry. Order: the families the project names first, then the rest alphabetically.
# ----------------------------------------------------------------------------------------------------------------

# Flux-style double blocks: attn (with to_out / to_add_out), ff, ff_context. Flux-style single blocks compute
#   h + gate * proj_out(cat[attn(n), gelu(proj_mlp(n))])      n = AdaLN(h): attn is pre_only (no to_out)
# so proj_out (5 D^2 per token of the ~12 D^2 of the block's linear layers) is a unit too, composed of attn and
# proj_mlp: a reused proj_out needs neither of them. Reused output = before the gate (the gate is recomputed).
# RoPE tables outside the blocks, the same at every step (dcache.memo). Flux-style: pos_embed(cat[txt_ids, img_ids])
# of the forward's own id arguments; Wan / HunyuanVideo-style: rope(hidden_states) reads its shape only.
_IDS_ROPE = (Invariant("pos_embed", depends_on=("img_ids", "txt_ids")),)
_SHAPE_ROPE = (Invariant("rope", key="shapes"),)
_FLUX_LIKE_MODULES = ("attn", "ff", "ff_context", "proj_mlp", "proj_out")
_SINGLE_BLOCK_COMPOSED = (("proj_out", ("attn", "proj_mlp")),)

register_adapter(Adapter(
    model_class="FluxTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        BlockList("single_transformer_blocks", outputs=(ENCODER, HIDDEN)),
    ),
    modules=_FLUX_LIKE_MODULES,
    composed=_SINGLE_BLOCK_COMPOSED,
    latents=_packed_latents,
    modulated_input=_adaln_zero(),
    invariants=_IDS_ROPE,
))

register_adapter(Adapter(
    model_class="Flux2Transformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        # Single blocks get encoder_hidden_states=None and hidden = [txt ; img] tokens [B, L_txt + L_img, D].
        BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,)),
    ),
    modules=("attn", "ff", "ff_context"),
    modulated_input=_flux2_modulated_input,
    # Flux2 pipelines patchify the VAE latents 2x2 (channels (C, dy, dx)) and pack them row-major, ids (t, h, w, l):
    # the same token layout as Flux, so the same unpacking gives [B, C, 1, 2h, 2w].
    latents=_packed_latents,
    notes="single blocks run over the concatenated [text; image] stream; their attention fuses the MLP "
          "(Flux2ParallelSelfAttention), so `attn` is the whole single block.",
    invariants=(Invariant("pos_embed", key="inputs"),),  # pos_embed(img_ids[0]), pos_embed(txt_ids[0])
))

register_adapter(Adapter(
    model_class="WanTransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=_time_embedding("temb"),
    notes="encoder_hidden_states is cross-attention context (read, not returned). Modulated input = the block's "
          "`temb` = timestep_proj [B, 6, D] (TeaCache's `e0`, the use_ret_steps coefficients).",
    invariants=_SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="HunyuanVideoTransformer3DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),
        BlockList("single_transformer_blocks", outputs=(HIDDEN, ENCODER)),
    ),
    modules=("attn", "ff", "ff_context", "proj_mlp", "proj_out"),
    composed=_SINGLE_BLOCK_COMPOSED,
    modulated_input=_hunyuan_video_modulated_input,
    notes="text refiner (context_embedder.token_refiner) runs on text tokens before the blocks: not a block list. "
          "image_condition_type='token_replace' swaps in TokenReplace block classes with the same slots.",
    invariants=_SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="HunyuanVideo15Transformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn", "ff", "ff_context"),
    modulated_input=_adaln_zero(),
    notes="text refiner (context_embedder.token_refiner) runs on text tokens before the blocks: not a block list.",
))

register_adapter(Adapter(
    model_class="QwenImageTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),),
    modules=("attn", "img_mlp", "txt_mlp"),
    latents=_image_shapes_latents,
    modulated_input=_qwen_image_modulated_input,
))

register_adapter(Adapter(
    model_class="SD3Transformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),),
    modules=("attn", "attn2", "ff", "ff_context"),
    modulated_input=_adaln_zero(),
    notes="the last block is context_pre_only: it returns encoder_hidden_states=None and has no ff_context. "
          "SD3.5 dual-attention blocks add `attn2` (self-attention on the image stream).",
))

register_adapter(Adapter(
    model_class="PixArtTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=_basic_block_modulated_input,
    notes="BasicTransformerBlock(norm_type='ada_norm_single'); encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="SanaTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=_sana_modulated_input,
    notes="blocks are called positionally (hidden, mask, encoder, encoder_mask, timestep, height, width); "
          "encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="CogVideoXTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    latents=_frames_first_latents,
    modulated_input=_time_embedding("temb"),
    notes="`ff` runs once over [text; video] tokens. Modulated input = time embedding `temb` [B, D] (TeaCache).",
))

register_adapter(Adapter(
    model_class="LTXVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    latents=_ltx_latents,
    modulated_input=_per_token_table("temb"),
    notes="encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="Lumina2Transformer2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn", "feed_forward"),
    modulated_input=_rms_norm_zero_modulated_input,
    notes="`layers` run over the joint [caption; image] sequence. Skipped: context_refiner (caption tokens only) and "
          "noise_refiner (image tokens only) run before the join on every call.",
))

register_adapter(Adapter(
    model_class="ChromaTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        # Single blocks take hidden = [txt ; img] [B, L_txt + L_img, D] and return it alone; ControlNet samples are
        # written into its image part in place.
        BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,), adds_in_place=True),
    ),
    modules=_FLUX_LIKE_MODULES,
    composed=_SINGLE_BLOCK_COMPOSED,
    latents=_packed_latents,
    modulated_input=_chroma_modulated_input,
    notes="per-block modulation is sliced from one pooled embedding: temb differs per block.",
    invariants=_IDS_ROPE,
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
    modulated_input=_time_embedding("temb"),
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
    modulated_input=_adaln_zero(),
))

register_adapter(Adapter(
    model_class="MochiTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff", "ff_context"),
    modulated_input=_rms_norm_zero_modulated_input,
    notes="the text stream is narrower than the video stream (pooled_projection_dim); the last block is "
          "context_pre_only and returns encoder_hidden_states unchanged.",
))

register_adapter(Adapter(
    model_class="DiTTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "ff"),
    modulated_input=_basic_block_modulated_input,
    notes="class-conditional: BasicTransformerBlock(norm_type='ada_norm_zero') with no text stream.",
))

register_adapter(Adapter(
    model_class="CogView4Transformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    shared=("ff",),
    modulated_input=_text_image_norm_modulated_input,
    notes="`ff` is shared: called twice per block (image, then text); one cache per call (Adapter.shared).",
))

register_adapter(Adapter(
    model_class="SkyReelsV2Transformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=_time_embedding("temb"),
    notes="Wan-style. Modulated input = timestep_proj [B, 6, D] (or [B, 6, L, D] with diffusion forcing).",
    invariants=_SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="ZImageTransformer2DModel",
    block_lists=(BlockList("layers", hidden="x", encoder=None, outputs=(HIDDEN,)),),
    modules=("attention", "feed_forward"),
    modulated_input=_z_image_modulated_input,
    latents=_sample_list_latents,
    notes="blocks take the stream as `x`: [image ; caption] tokens [B, L_img + L_cap, D]. Skipped: noise_refiner "
          "(image tokens), context_refiner (caption tokens) and siglip_refiner (Omni image features) run before "
          "the join. Model timestep convention: t = 1 - sigma (grows while denoising).",
))

# ---- further families ------------------------------------------------------------------------------------------

register_adapter(Adapter(
    model_class="AllegroTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=_allegro_modulated_input,
    notes="encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="BriaTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        # ControlNet single-block samples are written in place (as Chroma's)
        BlockList("single_transformer_blocks", outputs=(ENCODER, HIDDEN), adds_in_place=True),
    ),
    modules=_FLUX_LIKE_MODULES,
    composed=_SINGLE_BLOCK_COMPOSED,
    latents=_packed_latents,
    modulated_input=_adaln_zero(),
    invariants=_IDS_ROPE,
))

register_adapter(Adapter(
    model_class="BriaFiboTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        # Single blocks: hidden = [txt ; img] [B, L_txt + L_img, D].
        BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,)),
    ),
    modules=_FLUX_LIKE_MODULES,
    composed=_SINGLE_BLOCK_COMPOSED,
    latents=_packed_latents,
    modulated_input=_adaln_zero(),
    notes="each block reads its own slice of the text-encoder layers (mixed into the text stream outside blocks).",
))

register_adapter(Adapter(
    model_class="ChronoEditTransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=_time_embedding("temb"),
    notes="Wan-style blocks; modulated input = timestep_proj [B, 6, D].",
    invariants=_SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="CogView3PlusTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    modulated_input=lambda block, args: _text_image_norm_modulated_input(block, args, emb="emb"),
    notes="`ff` runs once over [text; image] tokens; the time embedding argument is named `emb`.",
))

register_adapter(Adapter(
    model_class="ConsisIDTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff"),
    latents=_frames_first_latents,
    modulated_input=_time_embedding("temb"),
    notes="CogVideoX-style blocks. Identity-preserving local facial extractor adds to hidden_states between some "
          "blocks (outside the blocks): included in a whole-stack residual.",
))

register_adapter(Adapter(
    model_class="CosmosTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=_cosmos_modulated_input,
    notes="encoder_hidden_states is cross-attention context (a tensor, or (text, image) tuple).",
))

register_adapter(Adapter(
    model_class="EasyAnimateTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn1", "ff", "txt_ff"),
    shared=("ff",),
    modulated_input=_text_image_norm_modulated_input,
    notes="without a separate txt_ff the block calls `ff` twice (image, text); one cache per call (Adapter.shared).",
))

register_adapter(Adapter(
    model_class="HunyuanDiT2DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=_hunyuan_dit_modulated_input,
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
    composed=_SINGLE_BLOCK_COMPOSED,
    modulated_input=_adaln_zero(),
    notes="text refiner (context_embedder) runs on text tokens before the blocks: not a block list.",
))

register_adapter(Adapter(
    model_class="HunyuanVideoFramepackTransformer3DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(HIDDEN, ENCODER)),
        BlockList("single_transformer_blocks", outputs=(HIDDEN, ENCODER)),
    ),
    modules=("attn", "ff", "ff_context", "proj_mlp", "proj_out"),
    composed=_SINGLE_BLOCK_COMPOSED,
    modulated_input=_hunyuan_video_modulated_input,
    notes="HunyuanVideo blocks; the hidden stream also holds the packed history-frame tokens.",
))

register_adapter(Adapter(
    model_class="Kandinsky5Transformer3DModel",
    block_lists=(BlockList("visual_transformer_blocks", hidden="visual_embed", encoder=None, outputs=(HIDDEN,)),),
    modules=("self_attention", "cross_attention", "feed_forward"),
    latents=_channels_last_latents,
    modulated_input=_kandinsky5_modulated_input,
    notes="blocks take the stream as `visual_embed`; text_embed is cross-attention context. Skipped: "
          "text_transformer_blocks (text tokens only) run before the visual blocks.",
))

register_adapter(Adapter(
    model_class="LongCatImageTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        BlockList("single_transformer_blocks", outputs=(ENCODER, HIDDEN)),
    ),
    modules=_FLUX_LIKE_MODULES,
    composed=_SINGLE_BLOCK_COMPOSED,
    latents=_packed_latents,
    modulated_input=_adaln_zero(),
))

register_adapter(Adapter(
    model_class="LuminaNextDiT2DModel",
    block_lists=(BlockList("layers", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "feed_forward"),
    modulated_input=_rms_norm_zero_modulated_input,
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

register_adapter(Adapter(
    model_class="OvisImageTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        BlockList("single_transformer_blocks", outputs=(ENCODER, HIDDEN)),
    ),
    modules=_FLUX_LIKE_MODULES,
    composed=_SINGLE_BLOCK_COMPOSED,
    latents=_packed_latents,
    modulated_input=_adaln_zero(),
))

register_adapter(Adapter(
    model_class="SanaVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ff"),
    modulated_input=_per_token_table("timestep"),
    notes="encoder_hidden_states is cross-attention context.",
))

register_adapter(Adapter(
    model_class="WanVACETransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=_time_embedding("temb"),
    notes="Skipped: vace_blocks run first over the control stream and produce hints that the model adds after "
          "some main blocks (outside the blocks, so a whole-stack residual includes them). Reusing the main "
          "stack does not skip the VACE blocks.",
    invariants=_SHAPE_ROPE,
))

register_adapter(Adapter(
    model_class="AnyFlowTransformer3DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn1", "attn2", "ffn"),
    modulated_input=_time_embedding("temb"),
    notes="Wan-style blocks with per-token modulation: temb = timestep_proj [B, L, 6, D] (from t and r).",
))

register_adapter(Adapter(
    model_class="JoyImageEditTransformer3DModel",
    block_lists=(BlockList("double_blocks", outputs=(HIDDEN, ENCODER)),),
    modules=("attn", "img_mlp", "txt_mlp"),
    modulated_input=_joy_image_modulated_input,
))

register_adapter(Adapter(
    model_class="NucleusMoEImageTransformer2DModel",
    block_lists=(BlockList("transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attn", "img_mlp"),
    latents=_image_shapes_latents,
    modulated_input=_nucleus_moe_modulated_input,
    notes="image tokens attend to projected text (encoder_proj inside the block); the text stream is read, not "
          "returned. img_mlp is a routed MoE (dense in the first and last blocks).",
))

register_adapter(Adapter(
    model_class="PRXTransformer2DModel",
    block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
    modules=("attention", "gate_proj", "up_proj", "down_proj"),
    composed=(("down_proj", ("gate_proj", "up_proj")),),
    modulated_input=_prx_modulated_input,
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
    latents=_ltx_latents,
    modulated_input=_per_token_table("temb"),
    notes="audio + video: the ENCODER slot is the audio stream [B, L_audio, D_audio] (narrower than video).",
))
