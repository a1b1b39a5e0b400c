"""What several family modules share: forms of the first block's timestep-modulated input (each function returns the
input of the first attention after AdaLN modulation, [B, L, D], unless its comment says otherwise), the Qwen-style
latent layout, the RoPE invariants and the composed proj_out of Flux-style single blocks.

A helper one family module alone uses lives in that module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapters import ENCODER, HIDDEN, Invariant
from ...runtime.latents import unpack_tokens

Args = dict[str, Any]  # the first block's bound forward arguments: name -> value


# ---- modulated inputs -------------------------------------------------------------------------------------------

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


def text_image_norm_modulated_input(block, args, emb: str = "temb"):
    # CogView3Plus / CogView4 / CogVideoX-style norms take (h, encoder, temb) and return the modulated image first.
    return block.norm1(args[HIDDEN], args[ENCODER], args[emb])[0]


# ---- latent layouts (dcache.runtime.latents) --------------------------------------------------------------------

def image_shapes_latents(args: Args) -> torch.Tensor | None:
    # Qwen-Image-style: 2x2-packed tokens [B, L, C*4]; img_shapes[sample] = [(frames, h, w) of the generated image,
    # then of each reference image]. The generated image's tokens come first.
    shapes = args.get("img_shapes")
    first = shapes[0] if shapes else None
    first = first[0] if isinstance(first, list) and first else first
    if not isinstance(first, tuple) or len(first) != 3:
        return None
    return unpack_tokens(args[HIDDEN], *(int(v) for v in first), 2)


# ---- invariants and composed units --------------------------------------------------------------------------------

# RoPE tables outside the blocks, the same at every step (dcache.runtime.step_invariant). Wan / HunyuanVideo-style:
# rope(hidden_states) reads its shape only.
SHAPE_ROPE = (Invariant("rope", key="shapes"),)
# Flux-style single blocks compute
#   h + gate * proj_out(cat[attn(n), gelu(proj_mlp(n))])      n = AdaLN(h): attn is pre_only (no to_out)
# so proj_out (5 D^2 per token of the ~12 D^2 of the block's linear layers) is a unit too, composed of attn and
# proj_mlp: a reused proj_out needs neither of them. Reused output = before the gate (the gate is recomputed).
SINGLE_BLOCK_COMPOSED = (("proj_out", ("attn", "proj_mlp")),)
