"""Z-Image: adapter, inputs and tiny test model."""

from __future__ import annotations

import torch

from ..adapters import HIDDEN, Adapter, BlockList, register_adapter
from .patterns import Args
from .tiny import TXT, Tiny, latents, noise, timestep


def z_image_modulated_input(block, args):
    # adaLN_modulation(adaln_input) [B, 4*D] -> (scale_msa, gate_msa, scale_mlp, gate_mlp); input of attention is
    # attention_norm1(x) * (1 + scale_msa): [B, L_img + L_txt, D]. Omni mode passes per-token noisy/clean embeddings
    # instead; the noisy one is used (the clean tokens do not change between steps).
    emb = args.get("adaln_input")
    if emb is None:
        emb = args["adaln_noisy"]
    scale_msa = block.adaLN_modulation(emb).unsqueeze(1).chunk(4, dim=2)[0]
    return block.attention_norm1(args["x"]) * (1.0 + scale_msa)


def sample_list_latents(args: Args) -> torch.Tensor | None:
    # Z-Image: `x` is a list of per-sample latents [C, F, H, W]; stacked to [B, C, F, H, W] when they share a shape
    # (else no layout).
    xs = args.get("x")
    if not isinstance(xs, (list, tuple)) or not xs or not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in xs):
        return None
    if any(t.shape != xs[0].shape for t in xs):
        return None
    return torch.stack(list(xs))


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


# ---- tiny test model ----------------------------------------------------------------------------------------------

TINY = {
    "z_image": Tiny("ZImageTransformer2DModel", config=dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=24, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32],
    ), inputs=dict(
        x=latents(4, 1, 8, 8, unbind=0),  # per sample [C, F, H, W] -> 16 tokens
        t=timestep(reverse=True),
        cap_feats=noise("txt", TXT, 24, unbind=0),  # per sample [T, D_cap]
    ), notes="timestep convention t = 1 - sigma; list inputs"),
}
