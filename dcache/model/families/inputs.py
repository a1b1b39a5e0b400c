"""What the family adapters share: how the first block's timestep-modulated input is computed (each function
returns the input of the first attention after AdaLN modulation, [B, L, D], unless its comment says otherwise),
how packed latents are laid out as [B, C, T, H, W] (dcache.runtime.latents), and the module lists and RoPE invariants
of the Flux-like families."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, Invariant
from ...runtime.latents import packed_2x2_latents, unpack_tokens

Args = dict[str, Any]  # the first block's bound forward arguments: name -> value


# ----------------------------------------------------------------------------------------------------------------
# Modulated-input helpers shared by several families. Each returns the input of the first attention after AdaLN
# modulation, [B, L, D], unless its comment says otherwise.
# ----------------------------------------------------------------------------------------------------------------

def adaln_zero(norm: str = "norm1", emb: str = "temb"):
    """AdaLayerNormZero-style `block.<norm>(h, emb=<emb>)` whose first returned tensor is norm(h)*(1+scale)+shift."""

    def modulated_input(block: nn.Module, args: Args) -> torch.Tensor:
        return getattr(block, norm)(args[HIDDEN], emb=args[emb])[0]

    return modulated_input


def scale_shift_table(block: nn.Module, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    # PixArt-alpha "ada_norm_single": temb [B, 6*D] (already projected by the model) + table [6, D]
    #   -> shift_msa, scale_msa, ... each [B, 1, D];  norm1(h) * (1 + scale_msa) + shift_msa: [B, L, D]
    batch = hidden.shape[0]
    shift_msa, scale_msa = (block.scale_shift_table[None] + temb.reshape(batch, 6, -1)).chunk(6, dim=1)[:2]
    return block.norm1(hidden) * (1 + scale_msa) + shift_msa


def flux2_modulated_input(block, args):
    # temb_mod_img [B, 6*D] (or [B, 1, 6*D]) -> (shift, scale, gate) x (attention, MLP), each [B, 1, D].
    mod = args["temb_mod_img"]
    mod = mod.unsqueeze(1) if mod.ndim == 2 else mod
    shift_msa, scale_msa = mod.chunk(6, dim=-1)[:2]
    return (1 + scale_msa) * block.norm1(args[HIDDEN]) + shift_msa


def hunyuan_video_modulated_input(block, args):
    # TeaCache4HunyuanVideo: modulate(img_norm1(img), shift_msa, scale_msa) == norm1(h, emb=temb)[0], [B, L_img, D].
    # Image-to-video "token_replace" blocks modulate the first frame's tokens with a second embedding.
    if args.get("token_replace_emb") is not None:
        return block.norm1(args[HIDDEN], args["temb"], args["token_replace_emb"], args["num_tokens"])[0]
    return block.norm1(args[HIDDEN], emb=args["temb"])[0]


def qwen_image_modulated_input(block, args):
    # img_mod(temb) [B', 6*D] -> first half is (shift, scale, gate) of attention; with zero_cond_t the batch is 2B
    # and `modulate_index` [B, L] picks per token between the two halves. Result [B, L_img, D].
    img_mod_attn = block.img_mod(args["temb"]).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(args[HIDDEN]), img_mod_attn, args.get("modulate_index"))[0]


def basic_block_modulated_input(block, args):
    # diffusers.models.attention.BasicTransformerBlock, by its `norm_type`:
    #   "ada_norm_single" (PixArt): scale/shift table + projected timestep [B, 6*D]
    #   "ada_norm_zero"   (DiT):    AdaLayerNormZero(h, timestep, class_labels)[0] (embeds t and class inside)
    h = args[HIDDEN]
    if block.norm_type == "ada_norm_single":
        return scale_shift_table(block, h, args["timestep"])
    if block.norm_type == "ada_norm_zero":
        return block.norm1(h, args["timestep"], args.get("class_labels"), hidden_dtype=h.dtype)[0]
    if block.norm_type == "ada_norm":
        return block.norm1(h, args["timestep"])
    raise TypeError(f"BasicTransformerBlock with norm_type={block.norm_type!r} has no timestep modulation; "
                    "use a schedule that does not need the modulated input.")


def sana_modulated_input(block, args):
    return scale_shift_table(block, args[HIDDEN], args["timestep"])


def time_embedding(name: str):
    """Families whose TeaCache signal is the time embedding itself (CogVideoX: `emb`; Wan: `e0`; HiDream: `temb`)."""

    def modulated_input(block: nn.Module, args: Args) -> torch.Tensor:
        return args[name]

    return modulated_input


def per_token_table(emb: str):
    """LTX / Sana-Video: emb [B, T, 6*D] (T = 1, or one per token) + table [6, D] -> shift/scale [B, T, D]."""

    def modulated_input(block: nn.Module, args: Args) -> torch.Tensor:
        h, e = args[HIDDEN], args[emb]
        table = block.scale_shift_table
        shift_msa, scale_msa = (table[None, None] + e.reshape(h.shape[0], e.size(1), table.shape[0], -1)).unbind(2)[:2]
        return block.norm1(h) * (1 + scale_msa) + shift_msa

    return modulated_input


def rms_norm_zero_modulated_input(block, args):
    # Lumina / Lumina-Next / Mochi: RMSNormZero(h, temb) -> (norm(h) * (1 + scale_msa), gates...), [B, L, D].
    return block.norm1(args[HIDDEN], args["temb"])[0]


def chroma_modulated_input(block, args):
    # Chroma's pruned AdaLN: temb [B, 12, D] holds precomputed (shift, scale, gate)x2 for image then text.
    return block.norm1(args[HIDDEN], emb=args["temb"][:, :6])[0]


def text_image_norm_modulated_input(block, args, emb: str = "temb"):
    # CogView3Plus / CogView4 / CogVideoX-style norms take (h, encoder, temb) and return the modulated image first.
    return block.norm1(args[HIDDEN], args[ENCODER], args[emb])[0]


def z_image_modulated_input(block, args):
    # adaLN_modulation(adaln_input) [B, 4*D] -> (scale_msa, gate_msa, scale_mlp, gate_mlp); input of attention is
    # attention_norm1(x) * (1 + scale_msa): [B, L_img + L_txt, D]. Omni mode passes per-token noisy/clean embeddings
    # instead; the noisy one is used (the clean tokens do not change between steps).
    emb = args.get("adaln_input")
    if emb is None:
        emb = args["adaln_noisy"]
    scale_msa = block.adaLN_modulation(emb).unsqueeze(1).chunk(4, dim=2)[0]
    return block.attention_norm1(args["x"]) * (1.0 + scale_msa)


def allegro_modulated_input(block, args):
    return scale_shift_table(block, args[HIDDEN], args["temb"])


def cosmos_modulated_input(block, args):
    return block.norm1(args[HIDDEN], args["embedded_timestep"], args.get("temb"))[0]


def hunyuan_dit_modulated_input(block, args):
    # AdaLayerNormShift: norm(h) + shift(temb), [B, L, D] (no scale). Blocks of the second half first fuse their
    # U-Net skip input; the first block has none.
    return block.norm1(args[HIDDEN], args["temb"])


def kandinsky5_modulated_input(block, args):
    # visual_modulation(time_embed) [B, 1, 9*D] -> (self-attn, cross-attn, ff) x (shift, scale, gate).
    shift, scale, _ = torch.chunk(torch.chunk(block.visual_modulation(args["time_embed"]).unsqueeze(1), 3, dim=-1)[0],
                                  3, dim=-1)
    return block.self_attention_norm(args["visual_embed"]) * (scale + 1.0) + shift


def nucleus_moe_modulated_input(block, args):
    # img_mod(temb) [B, 4*D] -> (scale1, gate1, scale2, gate2) each [B, 1, D]; attention input = norm(h)*(1+scale1).
    scale1 = block.img_mod(args["temb"]).unsqueeze(1).chunk(4, dim=-1)[0]
    return block.pre_attn_norm(args[HIDDEN]) * (1 + scale1)


def prx_modulated_input(block, args):
    # modulation(temb) -> ((shift, scale, gate) attention, (shift, scale, gate) MLP), each [B, 1, D].
    shift, scale, _ = block.modulation(args["temb"])[0]
    return (1 + scale) * block.img_pre_norm(args[HIDDEN]) + shift


def joy_image_modulated_input(block, args):
    # img_mod(temb) -> 6 x [B, D]: (shift, scale, gate) for attention, then for the MLP.
    shift, scale = block.img_mod(args["temb"])[:2]
    return block.img_norm1(args[HIDDEN]) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def packed_latents(args: Args) -> torch.Tensor | None:
    # Flux-style pipelines pack 2x2 latent pixels per token, [B, h*w, C*4], with img_ids [h*w, 3] (row, column in
    # columns 1, 2): unpacked to [B, C, 1, 2h, 2w] (dcache.runtime.latents).
    return packed_2x2_latents(args[HIDDEN], args.get("img_ids"))


def sample_list_latents(args: Args) -> torch.Tensor | None:
    # Z-Image: `x` is a list of per-sample latents [C, F, H, W]; stacked to [B, C, F, H, W] when they share a shape
    # (else no layout).
    xs = args.get("x")
    if not isinstance(xs, (list, tuple)) or not xs or not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in xs):
        return None
    if any(t.shape != xs[0].shape for t in xs):
        return None
    return torch.stack(list(xs))


def frames_first_latents(args: Args) -> torch.Tensor:
    # CogVideoX-style latents [B, F, C, H, W] -> [B, C, F, H, W].
    return args[HIDDEN].transpose(1, 2)


def image_shapes_latents(args: Args) -> torch.Tensor | None:
    # Qwen-Image-style: 2x2-packed tokens [B, L, C*4]; img_shapes[sample] = [(frames, h, w) of the generated image,
    # then of each reference image]. The generated image's tokens come first.
    shapes = args.get("img_shapes")
    first = shapes[0] if shapes else None
    first = first[0] if isinstance(first, list) and first else first
    if not isinstance(first, tuple) or len(first) != 3:
        return None
    return unpack_tokens(args[HIDDEN], *(int(v) for v in first), 2)


def ltx_latents(args: Args) -> torch.Tensor | None:
    # LTX: tokens [B, F*H*W, C] (patch 1) with the latent grid as the num_frames / height / width arguments.
    frames, height, width = args.get("num_frames"), args.get("height"), args.get("width")
    if not all(isinstance(v, int) for v in (frames, height, width)):
        return None
    return unpack_tokens(args[HIDDEN], frames, height, width, 1)


def channels_last_latents(args: Args) -> torch.Tensor:
    # Kandinsky 5: visual latents [B, F, H, W, C] -> [B, C, F, H, W].
    return args[HIDDEN].permute(0, 4, 1, 2, 3)


# Flux-style double blocks: attn (with to_out / to_add_out), ff, ff_context. Flux-style single blocks compute
#   h + gate * proj_out(cat[attn(n), gelu(proj_mlp(n))])      n = AdaLN(h): attn is pre_only (no to_out)
# so proj_out (5 D^2 per token of the ~12 D^2 of the block's linear layers) is a unit too, composed of attn and
# proj_mlp: a reused proj_out needs neither of them. Reused output = before the gate (the gate is recomputed).
# RoPE tables outside the blocks, the same at every step (dcache.runtime.step_invariant). Flux-style:
# pos_embed(cat[txt_ids, img_ids]) of the forward's own id arguments; Wan / HunyuanVideo-style: rope(hidden_states)
# reads its shape only.
IDS_ROPE = (Invariant("pos_embed", depends_on=("img_ids", "txt_ids")),)
SHAPE_ROPE = (Invariant("rope", key="shapes"),)
FLUX_LIKE_MODULES = ("attn", "ff", "ff_context", "proj_mlp", "proj_out")
SINGLE_BLOCK_COMPOSED = (("proj_out", ("attn", "proj_mlp")),)


def flux_like(model_class: str, *, single: BlockList | None = None, modulated_input: Any = None,
              invariants: tuple = IDS_ROPE, notes: str = "") -> Adapter:
    """The adapter of a Flux-style MMDiT: double-stream `transformer_blocks` returning (encoder, hidden), then
    `single_transformer_blocks` (by default also returning (encoder, hidden); pass `single` for a variant, e.g. one
    that runs over the concatenated [txt ; img] stream), Flux's inner modules with the single block's proj_out
    composed of attn and proj_mlp, 2x2-packed latents and an AdaLN-zero modulated input."""
    single = single or BlockList("single_transformer_blocks", outputs=(ENCODER, HIDDEN))
    return Adapter(
        model_class=model_class,
        block_lists=(BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)), single),
        modules=FLUX_LIKE_MODULES,
        composed=SINGLE_BLOCK_COMPOSED,
        latents=packed_latents,
        modulated_input=modulated_input if modulated_input is not None else adaln_zero(),
        invariants=invariants,
        notes=notes,
    )
