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

import math
from collections.abc import Sequence

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from .label_encoder import LabelEncoder

IMAGE_SIZE = 16  # pixels per side
PATCH = 2  # Flux packs 2x2 pixels into one token: 16x16x1 -> 8x8 tokens x 4 channels
DEFAULT_STEPS = 28
# Tuned with the digit classifier: from 1.5 up, >= 99 % of samples show the requested digit, and the classifier-feature
# Frechet distance to real digits is lowest at 1.5 (it grows with more guidance: less diversity). See METRICS.json.
DEFAULT_GUIDANCE = 1.5
CFG_MODES = ("split", "batched")
OUTPUT_TYPES = ("pt", "np", "pil", "latent")
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


class DigitFlowPipeline(DiffusionPipeline):
    """Generates 16x16 grayscale digits of the requested classes. Components: transformer, scheduler, label_encoder."""

    model_cpu_offload_seq = "label_encoder->transformer"

    def __init__(
        self,
        transformer: FluxTransformer2DModel,
        scheduler: FlowMatchEulerDiscreteScheduler,
        label_encoder: LabelEncoder,
    ):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, label_encoder=label_encoder)

    @property
    def num_classes(self) -> int:
        return self.label_encoder.config.num_classes

    @property
    def num_timesteps(self) -> int:
        """Number of denoising steps of the last (or current) call."""
        return self._num_timesteps

    def _labels(self, prompt, labels):
        """`prompt` (a digit string / word, a label, or a list of them) or `labels` -> what `_check_inputs` takes."""
        if prompt is not None and labels is not None:
            raise ValueError("pass the digits as prompt (pipe('3'), pipe(['3', 'seven'])) or as labels "
                             "(pipe(labels=[3, 7])), not both.")
        if prompt is None:
            if labels is None:
                raise ValueError("no digit requested: pass a prompt such as pipe('3') or pipe(['3', 'seven']), or "
                                 "class labels such as pipe(labels=[3, 7]).")
            return labels
        if isinstance(prompt, str):
            return [parse_digit_prompt(prompt)]
        if isinstance(prompt, (list, tuple)):
            return [parse_digit_prompt(p, i) if isinstance(p, str) else p for i, p in enumerate(prompt)]
        return prompt  # an int, a tensor of labels: checked as labels

    def _check_inputs(self, labels, num_inference_steps, guidance_scale, generator, latents, cfg_mode, output_type):
        """Validates the call and returns the labels as a list of ints."""
        if isinstance(labels, torch.Tensor):
            labels = labels.tolist() if labels.ndim <= 1 else labels  # 0-d -> int, 1-d -> list
        if isinstance(labels, (int, np.integer)) and not isinstance(labels, bool):
            labels = [int(labels)]
        if (
            not isinstance(labels, Sequence)
            or len(labels) == 0
            or not all(isinstance(label, (int, np.integer)) and not isinstance(label, bool) for label in labels)
        ):
            raise ValueError(
                f"labels must be an int or a non-empty list of ints in 0..{self.num_classes - 1}, got {labels!r}; "
                "e.g. pipe(labels=[0, 1, 2]), or digit prompts such as pipe(['0', 'one', '2'])."
            )
        bad = [(i, label) for i, label in enumerate(labels) if not 0 <= label < self.num_classes]
        if bad:
            i, label = bad[0]
            raise ValueError(
                f"labels must be digit classes in 0..{self.num_classes - 1}, got {label} at position {i}; the null "
                f"label {self.num_classes} is reserved for the unconditional branch of CFG (use guidance_scale=1 to "
                f"turn CFG off)."
            )
        if (isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, (int, np.integer))
                or num_inference_steps < 1):
            raise ValueError(f"num_inference_steps must be an int >= 1, got {num_inference_steps!r}; the default is "
                             f"{DEFAULT_STEPS}.")
        if (isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float))
                or not math.isfinite(guidance_scale)):
            raise ValueError(
                f"guidance_scale must be a finite number, got {guidance_scale!r}; values <= 1 turn CFG off, the "
                f"default is {DEFAULT_GUIDANCE}."
            )
        if cfg_mode not in CFG_MODES:
            raise ValueError(
                f"cfg_mode must be one of {CFG_MODES}, got {cfg_mode!r}: 'split' makes two transformer calls per step "
                "(cond, then uncond), 'batched' one call on the doubled batch [uncond; cond]."
            )
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        if isinstance(generator, list) and len(generator) != len(labels):
            raise ValueError(
                f"got a list of {len(generator)} generators for {len(labels)} labels; pass one generator, or one per "
                f"label."
            )
        expected = (len(labels), 1, IMAGE_SIZE, IMAGE_SIZE)
        if latents is not None and tuple(latents.shape) != expected:
            raise ValueError(
                f"latents must be the starting noise in pixel layout {list(expected)} (one per label), got "
                f"{list(latents.shape)}."
            )
        return [int(label) for label in labels]

    def _encode(self, labels, dtype):
        """labels [B] -> (encoder_hidden_states [B, T, D], pooled [B, P]) in `dtype`: the prompt embedding, made once
        per generation (as diffusers pipelines encode their prompts before the denoising loop)."""
        encoder_hidden_states, pooled = self.label_encoder(labels)
        return encoder_hidden_states.to(dtype), pooled.to(dtype)

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
        labels = self._check_inputs(self._labels(prompt, labels), num_inference_steps, guidance_scale, generator,
                                    latents, cfg_mode, output_type)
        device = self._execution_device
        dtype = self.transformer.dtype
        batch = len(labels)
        do_cfg = guidance_scale > 1.0

        cond = torch.tensor(labels, dtype=torch.long, device=device)  # [B]
        uncond = torch.full_like(cond, self.label_encoder.null_label)  # [B]
        both = torch.cat([uncond, cond])  # [2B], batched CFG order: [uncond; cond]
        txt_ids = text_ids(self.label_encoder.config.num_tokens, device=device, dtype=dtype)  # [T, 3]
        img_ids = image_ids(device=device, dtype=dtype)  # [64, 3]
        # the labels' embeddings, once per generation: (encoder_hidden_states [B or 2B, T, D], pooled)
        cond_embeds = self._encode(cond, dtype)
        uncond_embeds = self._encode(uncond, dtype) if do_cfg and cfg_mode == "split" else None
        both_embeds = self._encode(both, dtype) if do_cfg and cfg_mode != "split" else None

        if latents is None:
            latents = randn_tensor((batch, 1, IMAGE_SIZE, IMAGE_SIZE), generator=generator, device=device, dtype=dtype)
        x = pack_images(latents.to(device=device, dtype=dtype))  # [B, 64, 4], x_1 = noise

        self.scheduler.set_timesteps(sigmas=flow_sigmas(num_inference_steps), device=device)
        self.scheduler.set_begin_index(0)
        timesteps = self.scheduler.timesteps  # [N], = 1000 * shifted sigma
        sigmas = self.scheduler.sigmas.tolist()  # [N + 1] on the host, once, for the cache context
        self._num_timesteps = len(timesteps)

        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                timestep = t.expand(batch).to(dtype) / 1000  # [B], sigma in (0, 1]
                context = dict(step_index=i, num_inference_steps=num_inference_steps, timestep=t, sigma=sigmas[i])
                if not do_cfg:
                    with self.transformer.cache_context("cond", **context):
                        velocity = self._velocity(x, cond, timestep, txt_ids, img_ids, cond_embeds)
                elif cfg_mode == "split":
                    with self.transformer.cache_context("cond", **context):
                        v_cond = self._velocity(x, cond, timestep, txt_ids, img_ids, cond_embeds)
                    with self.transformer.cache_context("uncond", **context):
                        v_uncond = self._velocity(x, uncond, timestep, txt_ids, img_ids, uncond_embeds)
                    velocity = v_uncond + guidance_scale * (v_cond - v_uncond)
                else:
                    with self.transformer.cache_context("cond_uncond", **context):
                        v_both = self._velocity(torch.cat([x, x]), both, timestep.repeat(2), txt_ids, img_ids,
                                                both_embeds)
                    v_uncond, v_cond = v_both.chunk(2)
                    velocity = v_uncond + guidance_scale * (v_cond - v_uncond)
                x = self.scheduler.step(velocity, t, x, return_dict=False)[0]  # x + (sigma_next - sigma) * v
                progress_bar.update()

        self.maybe_free_model_hooks()
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
