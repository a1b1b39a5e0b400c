"""Flux and the Flux-style MMDiTs (Flux.2, Chroma, Bria, Bria-Fibo, LongCat-Image, Ovis-Image): adapters, inputs and
tiny test models."""

from __future__ import annotations

from typing import Any

import torch

from ..adapters import ENCODER, HIDDEN, Adapter, BlockList, Invariant, register_adapter
from ...runtime.latents import packed_2x2_latents
from .patterns import SINGLE_BLOCK_COMPOSED, Args, adaln_zero
from .tiny import TXT, Tiny, filled, ids, latents, noise, timestep

# Flux-style double blocks: attn (with to_out / to_add_out), ff, ff_context; single blocks: proj_out composed of attn
# and proj_mlp (patterns.SINGLE_BLOCK_COMPOSED). RoPE: pos_embed(cat[txt_ids, img_ids]) of the forward's own id
# arguments, the same at every step (dcache.runtime.step_invariant).
IDS_ROPE = (Invariant("pos_embed", depends_on=("img_ids", "txt_ids")),)
FLUX_LIKE_MODULES = ("attn", "ff", "ff_context", "proj_mlp", "proj_out")


def packed_latents(args: Args) -> torch.Tensor | None:
    # Flux-style pipelines pack 2x2 latent pixels per token, [B, h*w, C*4], with img_ids [h*w, 3] (row, column in
    # columns 1, 2): unpacked to [B, C, 1, 2h, 2w] (dcache.runtime.latents).
    return packed_2x2_latents(args[HIDDEN], args.get("img_ids"))


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


def flux2_modulated_input(block, args):
    # temb_mod_img [B, 6*D] (or [B, 1, 6*D]) -> (shift, scale, gate) x (attention, MLP), each [B, 1, D].
    mod = args["temb_mod_img"]
    mod = mod.unsqueeze(1) if mod.ndim == 2 else mod
    shift_msa, scale_msa = mod.chunk(6, dim=-1)[:2]
    return (1 + scale_msa) * block.norm1(args[HIDDEN]) + shift_msa


def chroma_modulated_input(block, args):
    # Chroma's pruned AdaLN: temb [B, 12, D] holds precomputed (shift, scale, gate)x2 for image then text.
    return block.norm1(args[HIDDEN], emb=args["temb"][:, :6])[0]


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

# Single blocks take hidden = [txt ; img] [B, L_txt + L_img, D] and return it alone; ControlNet samples are written
# into its image part in place.
register_adapter(flux_like(
    "ChromaTransformer2DModel",
    single=BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,), adds_in_place=True),
    modulated_input=chroma_modulated_input,
    notes="per-block modulation is sliced from one pooled embedding: temb differs per block.",
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

register_adapter(flux_like("LongCatImageTransformer2DModel", invariants=()))

register_adapter(flux_like("OvisImageTransformer2DModel", invariants=()))


# ---- tiny test models ---------------------------------------------------------------------------------------------

_CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6))
_INPUTS = dict(
    hidden_states=latents(16, 8),  # packed latents [B, H*W = 4*4, C]
    encoder_hidden_states=noise("txt", TXT, 24),
    timestep=timestep(1.0),
    img_ids=ids(1, 4, 4), txt_ids=filled(0.0, TXT, 3, batched=False),
)

TINY = {
    "flux": Tiny("FluxTransformer2DModel", config=dict(_CONFIG, pooled_projection_dim=16), inputs=dict(
        hidden_states=latents(16, 8),  # packed latents [B, H*W = 4*4, C]
        encoder_hidden_states=noise("txt", TXT, 24),
        pooled_projections=noise("pooled", 16),
        timestep=timestep(1.0),
        img_ids=ids(1, 4, 4), txt_ids=filled(0.0, TXT, 3, batched=False),
    )),
    "flux2": Tiny("Flux2Transformer2DModel", config=dict(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True,
    ), inputs=dict(
        hidden_states=latents(16, 8),  # [B, 4*4, C]
        encoder_hidden_states=noise("txt", TXT, 24),
        timestep=timestep(1.0), guidance=filled(4.0),
        img_ids=ids(1, 4, 4, 1), txt_ids=ids(1, 1, 1, TXT),
    )),
    "chroma": Tiny("ChromaTransformer2DModel", config=dict(
        _CONFIG, approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1), inputs=_INPUTS),
    "bria": Tiny("BriaTransformer2DModel", config=_CONFIG, inputs=_INPUTS),
    "ovis_image": Tiny("OvisImageTransformer2DModel", config=dict(_CONFIG, out_channels=8), inputs=_INPUTS),
    "longcat_image": Tiny("LongCatImageTransformer2DModel", config=dict(_CONFIG, pooled_projection_dim=16),
                          inputs=_INPUTS),
    "bria_fibo": Tiny("BriaFiboTransformer2DModel", config=dict(_CONFIG, text_encoder_dim=24), inputs=dict(
        hidden_states=latents(16, 8),  # [B, 4*4, C]
        encoder_hidden_states=noise("txt", TXT, 24),
        text_encoder_layers=noise("layers", 4, TXT, 24, unbind=1),  # one text-encoder layer per block
        timestep=timestep(),
        img_ids=ids(1, 4, 4), txt_ids=filled(0.0, TXT, 3, batched=False),
    )),
}
