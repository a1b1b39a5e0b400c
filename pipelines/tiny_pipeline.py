"""`DigitFlowPipeline`: class-conditional rectified-flow sampling with a tiny `FluxTransformer2DModel`.

It follows diffusers' `FluxPipeline` wherever the cache engine looks: the scheduler's `set_timesteps` is called once
per generation, the transformer gets `timestep = t / 1000` (= sigma in (0, 1]; Flux multiplies by 1000 inside),
packed 2x2 image tokens with `img_ids`/`txt_ids`, and each transformer call runs inside `cache_context("cond")`,
`cache_context("uncond")` (split CFG) or `cache_context("cond_uncond")` (batched CFG). Its call looks like a
text-to-image pipeline's: `pipe("3").images[0]` is a PIL image of a 3 (prompts name a digit: "3" or "three").

Image layout: pixels [B, 1, 16, 16] in [-1, 1] during sampling  <->  packed tokens [B, 64, 4] (8x8 grid of 2x2
patches).
Flow: x_t = (1 - t) * x_0 + t * noise, the transformer predicts v = noise - x_0, Euler steps from t = 1 to 0.
"""

from collections.abc import Sequence

import numpy as np
import PIL.Image
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

from .class_pipeline import ClassConditionalPipeline
from .label_encoder import LabelEncoder

IMAGE_SIZE = 16  # pixels per side
PATCH = 2  # Flux packs 2x2 pixels into one token: 16x16x1 -> 8x8 tokens x 4 channels
DEFAULT_STEPS = 28
# Tuned with the digit classifier: from 1.5 up, >= 99 % of samples show the requested digit, and the classifier-feature
# Frechet distance to real digits is lowest at 1.5 (it grows with more guidance: less diversity). See METRICS.json.
DEFAULT_GUIDANCE = 1.5
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PIL_SCALE = 4  # "pil" output is upscaled with nearest-neighbour: 16x16 -> 64x64


def pack_images(images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)*(W/2), C*4]: row-major 2x2 patches, channels (c, dy, dx), as FluxPipeline packs
    latents."""
    b, c, h, w = images.shape
    x = images.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack_tokens(tokens: torch.Tensor, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE) -> torch.Tensor:
    """Inverse of `pack_images`: [B, (H/2)*(W/2), C*4] -> [B, C, H, W]."""
    b, _, d = tokens.shape
    c = d // (PATCH * PATCH)
    x = tokens.view(b, height // PATCH, width // PATCH, c, PATCH, PATCH)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def image_ids(height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, device=None, dtype=torch.float32) -> torch.Tensor:
    """RoPE positions of the packed tokens, [(H/2)*(W/2), 3] = (0, row, col), like Flux's latent image ids."""
    rows, cols = torch.meshgrid(torch.arange(height // PATCH), torch.arange(width // PATCH), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return ids.to(device=device, dtype=dtype)


def text_ids(num_tokens: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """RoPE positions of the label tokens, [T, 3] zeros, like Flux's text ids."""
    return torch.zeros(num_tokens, 3, device=device, dtype=dtype)


def parse_digit_prompt(prompt: str, position: int | None = None) -> int:
    """A prompt naming a digit -> its class: "3", " 7 ", "seven", "Seven" -> 3, 7, 7, 7 (a ValueError otherwise)."""
    text = prompt.strip().lower() if isinstance(prompt, str) else None
    if text is not None and len(text) == 1 and text in "0123456789":
        return int(text)
    if text in DIGIT_WORDS:
        return DIGIT_WORDS.index(text)
    where = "" if position is None else f" at position {position}"
    raise ValueError(
        f"prompt {prompt!r}{where} names no digit: the bundled model draws the digits 0-9 and takes the prompts "
        f"'0'..'9' or {', '.join(repr(w) for w in DIGIT_WORDS)} (or class labels: pipe(labels=[0, 1, 2]))."
    )


def flow_sigmas(num_inference_steps: int) -> np.ndarray:
    """Unshifted sigmas 1 -> 1/N, as FluxPipeline passes them; the scheduler applies its `shift` and appends 0."""
    return np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)


class DigitFlowPipeline(ClassConditionalPipeline):
    """Generates 16x16 grayscale digits of the requested classes. Components: transformer, scheduler, label_encoder."""

    noun = "digit"
    class_names = DIGIT_WORDS
    default_steps = DEFAULT_STEPS
    default_guidance = DEFAULT_GUIDANCE

    def __init__(
        self,
        transformer: FluxTransformer2DModel,
        scheduler: FlowMatchEulerDiscreteScheduler,
        label_encoder: LabelEncoder,
    ):
        super().__init__(transformer, scheduler, label_encoder)

    def parse_prompt(self, prompt, position: int | None = None) -> int:
        return parse_digit_prompt(prompt, position)

    def sample_shape(self) -> tuple[int, ...]:
        return (1, IMAGE_SIZE, IMAGE_SIZE)  # pixel layout

    @property
    def parse_example(self) -> str:
        return "3"

    def _set_timesteps(self, num_inference_steps: int, device) -> None:
        self.scheduler.set_timesteps(sigmas=flow_sigmas(num_inference_steps), device=device)

    def _to_state(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels [B, 1, 16, 16] -> packed tokens [B, 64, 4]; the RoPE ids are made here, once per generation."""
        self._ids = (text_ids(self.label_encoder.config.num_tokens, device=latents.device, dtype=latents.dtype),
                     image_ids(device=latents.device, dtype=latents.dtype))  # [T, 3], [64, 3]
        return pack_images(latents)

    def _transformer_call(self, x, t, labels, embedded):
        """Packed x [B, 64, 4] at scheduler timestep t (= 1000 sigma) -> velocity [B, 64, 4] (v = noise - x_0);
        Flux takes timestep = sigma in (0, 1]."""
        txt_ids, img_ids = self._ids
        return self._velocity(x, labels, t.expand(x.shape[0]).to(x.dtype) / 1000, txt_ids, img_ids, embedded)

    def _velocity(self, x, labels, timestep, txt_ids, img_ids, embedded=None):
        """Transformer call: packed x [B, 64, 4], labels [B] -> velocity [B, 64, 4] (v = noise - x_0). `embedded`:
        the labels' `_encode` output (encoded here when not given)."""
        encoder_hidden_states, pooled = embedded if embedded is not None else self._encode(labels, x.dtype)
        return self.transformer(
            hidden_states=x,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | int | Sequence[str | int] | None = None,
        num_inference_steps: int = DEFAULT_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        cfg_mode: str = "split",
        output_type: str = "pil",
        return_dict: bool = True,
        labels: int | Sequence[int] | torch.Tensor | None = None,
    ):
        """Generate one image per requested digit, as a diffusers pipeline does per prompt.

            pipe("3").images[0]                        # a PIL image of a 3
            pipe(["3", "seven"], output_type="pt")      # tensor [2, 1, 16, 16] in [0, 1]

        Args:
            prompt: a digit as text ("3", "seven"; see `parse_digit_prompt`), a class label (3), or a list of them.
            labels: the same as class labels 0..9 (instead of `prompt`).
            num_inference_steps: Euler steps (>= 1).
            guidance_scale: CFG scale g; v = v_uncond + g * (v_cond - v_uncond). g <= 1: no CFG, one call per step.
            generator: torch.Generator (or one per label) for the starting noise.
            latents: starting noise [B, 1, 16, 16] instead of drawing it.
            cfg_mode: "split" (two calls per step, cond then uncond) or "batched" (one call on [uncond; cond]).
            output_type: "pil" (default: list of 64x64 grayscale images), "pt" (tensor [B, 1, 16, 16] in [0, 1]),
                "np" (array [B, 16, 16, 1] in [0, 1]), "latent" (packed tokens [B, 64, 4], unclamped, [-1, 1] scale).
            return_dict: return an `ImagePipelineOutput` (else a tuple `(images,)`).
        """
        x = self._denoise(prompt, labels, num_inference_steps, guidance_scale, generator, latents, cfg_mode,
                          output_type)  # packed tokens [B, 64, 4]
        if output_type == "latent":
            images = x
        else:
            images = (unpack_tokens(x).float() / 2 + 0.5).clamp(0, 1)  # [B, 1, 16, 16] in [0, 1]
            if output_type == "np":
                images = images.permute(0, 2, 3, 1).cpu().numpy()  # [B, 16, 16, 1], diffusers' numpy layout
            elif output_type == "pil":
                images = [to_pil(image) for image in images]
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)


def to_pil(image: torch.Tensor, scale: int = PIL_SCALE) -> PIL.Image.Image:
    """[1, H, W] in [0, 1] -> grayscale PIL image (H*scale, W*scale), nearest-neighbour upscaled."""
    pixels = (image[0] * 255).round().to(torch.uint8).cpu().numpy()
    pil = PIL.Image.fromarray(pixels)  # uint8 [H, W] -> mode "L"
    return pil.resize((pixels.shape[1] * scale, pixels.shape[0] * scale), resample=PIL.Image.NEAREST)
