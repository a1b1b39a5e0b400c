"""The bundled models as the benchmarks see them: how to load each, its judge, and what its peers need.

    spec = MODELS["motion"]
    pipe, judge = spec.load(), spec.load_judge()
    x = spec.samples(pipe(labels=[0, 1], output_type="pt"))      # [B, 3, H, W] images or [B, F, 3, H, W] clips

One table, read by every benchmark that runs on more than one model (methods.py, transfer.py), so a model's
settings (default steps, guidance, CFG mode) come from its pipeline class and nothing is repeated per script.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

import dcache.pipelines.bundled as bundled
from dcache.pipelines.flow_training import samples


@dataclass(frozen=True)
class BundledModel:
    name: str  # the short name benchmarks take on the command line: "digits"
    asset: str  # its folder under pipelines/assets: "tiny-digits"
    loader: str  # the dcache.pipelines.bundled function that loads the pipeline
    judge: str  # ... and the one that loads its classifier
    family: str  # what it stands for, in table headings
    cache_dit_adapter: str  # the key of cache-dit's BlockAdapterRegister for this transformer class
    # SeaCache's (diffusers) spectral indicator input: hidden_states -> per-sample latents [C, T, H, W]
    raw_vision: Callable[[Any, tuple, dict], list[torch.Tensor] | None] | None = None
    # FasterCache's latent layout (diffusers' tensor_format): "BCFHW" for video
    tensor_format: str = "BCHW"
    # cache-dit's calibrators on the encoder stream too (False where cache-dit 1.5.3 fails with them: SD3's blocks)
    cache_dit_encoder_calibrator: bool = True
    # diffusers' TaylorSeer `cache_identifiers` where its defaults (re.fullmatch of "^blocks.*attn") hook nothing:
    # Wan's attention modules are blocks.<i>.attn1 / attn2
    taylorseer_identifiers: tuple[str, ...] | None = None

    def load(self):
        pipe = getattr(bundled, self.loader)()
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def load_judge(self):
        return getattr(bundled, self.judge)()

    @staticmethod
    def samples(output) -> torch.Tensor:
        """A pipeline output's samples as float: `.frames` of the video model, else `.images`."""
        return samples(output).detach().float()

    @property
    def title(self) -> str:
        return f"{self.asset} ({self.family})"

    def weights_id(self) -> str:
        """sha256 prefix of the transformer weights (the assets may be retrained between runs)."""
        path = bundled.BUNDLED[self.asset] / "transformer" / "diffusion_pytorch_model.safetensors"
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else "?"


def frames_as_images(x: torch.Tensor) -> torch.Tensor:
    """Samples [B, C, H, W] or clips [B, F, C, H, W] -> [B', C, H, W] (a clip's frames as separate images), for
    per-image metrics such as SSIM."""
    return x if x.ndim == 4 else x.flatten(0, 1)


def flux_tokens_to_latents(module, args, kwargs) -> list[torch.Tensor] | None:
    """Flux: packed tokens [B, N, 4C] (2x2 pixels per token) -> per-sample latents [C, T=1, H, W]."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
        return None
    b, n, d = hidden.shape
    side = math.isqrt(n)
    c = d // 4
    x = hidden.view(b, side, side, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, side * 2, side * 2)
    return [sample.unsqueeze(1) for sample in x]


def wan_latents(module, args, kwargs) -> list[torch.Tensor] | None:
    """Wan: latents [B, C, F, H, W] are already per-sample [C, T, H, W]."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 5:
        return None
    return list(hidden)


MODELS = {
    "digits": BundledModel("digits", "tiny-digits", "load_tiny_pipeline", "load_digit_classifier",
                           "Flux, split CFG 1.5, Euler, 28 steps", "Flux", flux_tokens_to_latents),
    "motion": BundledModel("motion", "tiny-motion", "load_motion_pipeline", "load_motion_classifier",
                           "Wan video, split CFG 5, UniPC, 20 steps", "Wan", wan_latents, tensor_format="BCFHW",
                           taylorseer_identifiers=(r"^blocks\.\d+\.attn[12]$",)),
    # diffusers' caches need a CacheMixin transformer; SD3Transformer2DModel is not one in diffusers 0.42
    "shapes": BundledModel("shapes", "tiny-shapes", "load_shapes_pipeline", "load_shapes_classifier",
                           "SD3, batched CFG 4, Euler, 28 steps", "StableDiffusion3",
                           cache_dit_encoder_calibrator=False),
}
