"""Per-family adapter data for diffusers transformers (registered on import by dcache.adapters)."""

from __future__ import annotations

from .adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter


def _flux_modulated_input(block, args):
    # FLUX / TeaCache: AdaLN-Zero output of the first double block, norm1(h, emb=temb)[0]: [B, L_img, D].
    return block.norm1(args[HIDDEN], emb=args["temb"])[0]


register_adapter(Adapter(
    model_class="FluxTransformer2DModel",
    block_lists=(
        BlockList("transformer_blocks", outputs=(ENCODER, HIDDEN)),
        BlockList("single_transformer_blocks", outputs=(ENCODER, HIDDEN)),
    ),
    modules=("attn", "ff", "ff_context", "proj_mlp"),
    modulated_input=_flux_modulated_input,
))
