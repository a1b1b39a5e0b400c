"""`ShapesPipeline`: class-conditional images with a tiny `SD3Transformer2DModel` (MM-DiT), SD3's sampler and loop.

It keeps `StableDiffusion3Pipeline`'s denoising loop: `FlowMatchEulerDiscreteScheduler` (static shift),
`set_timesteps(N)` once per generation, the transformer called with the scheduler's timestep (t in [0, 1000],
= 1000 sigma), `encoder_hidden_states` and `pooled_projections`, batched CFG by default (one call on the doubled
batch [uncond; cond], as SD3 runs it) and `scheduler.step(v, t, latents)`. SD3's transformer class has no
`cache_context`, so its calls carry no branch names, as in diffusers' SD3 pipeline: a cache tells the branches
apart by call order and batch halves. A `LabelEncoder` stands in for SD3's three text encoders; the latents are the
pixels folded 2x2 into channels (`procedural_data`), which needs no VAE.

Images: `pipe("red circle").images[0]` is a PIL image of a red circle (prompts: "<colour> <shape>" with colours
red / green / blue and shapes circle / square / triangle). Latents [B, 12, 16, 16] <-> images [B, 3, 32, 32] in
[0, 1]; patch 2: 64 tokens.
"""

from collections.abc import Sequence

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

from .class_pipeline import ClassConditionalPipeline
from .label_encoder import LabelEncoder
from .motion_pipeline import to_pil
from .procedural_data import SHAPE_CLASSES, SHAPE_SIZE, latents_to_images

DEFAULT_STEPS = 28
DEFAULT_GUIDANCE = 4.0


class ShapesPipeline(ClassConditionalPipeline):
    """Generates 32x32 RGB images of the requested coloured shapes. Components: transformer, scheduler,
    label_encoder."""

    noun = "shape"
    prompt_noun = "coloured shape"
    class_names = SHAPE_CLASSES
    default_steps = DEFAULT_STEPS
    default_guidance = DEFAULT_GUIDANCE
    default_cfg_mode = "batched"

    def __init__(self, transformer: SD3Transformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler,
                 label_encoder: LabelEncoder):
        super().__init__(transformer, scheduler, label_encoder)

    def sample_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, SHAPE_SIZE // 2, SHAPE_SIZE // 2)  # latent layout [C, h, w]

    def _transformer_call(self, x, t, labels, embedded):
        """x [B, 12, 16, 16] at t in [0, 1000] -> velocity [B, 12, 16, 16], as StableDiffusion3Pipeline calls it."""
        encoder_hidden_states, pooled = embedded
        return self.transformer(hidden_states=x, timestep=t.expand(x.shape[0]),
                                encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled,
                                return_dict=False)[0]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | int | Sequence[str | int] | None = None,
        num_inference_steps: int = DEFAULT_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        cfg_mode: str = "batched",
        output_type: str = "pil",
        return_dict: bool = True,
        labels: int | Sequence[int] | torch.Tensor | None = None,
    ):
        """Generate one image per requested shape, as `StableDiffusion3Pipeline` does per prompt.

            pipe("red circle").images[0]                         # a PIL image (128x128) of a red circle
            pipe(["blue square", "green triangle"], output_type="pt")   # tensor [2, 3, 32, 32] in [0, 1]

        Args:
            prompt: "<colour> <shape>" (see `SHAPE_CLASSES`), a class label (0..8), or a list of them.
            labels: the same as class labels 0..8 (instead of `prompt`).
            num_inference_steps: Euler steps (>= 1).
            guidance_scale: CFG scale g; v = v_uncond + g * (v_cond - v_uncond). g <= 1: no CFG, one call per step.
            generator: torch.Generator (or one per label) for the starting noise.
            latents: starting noise [B, 12, 16, 16] instead of drawing it.
            cfg_mode: "batched" (default, as SD3: one call on [uncond; cond]) or "split" (cond, then uncond).
            output_type: "pil" (list of 128x128 RGB images), "pt" (tensor [B, 3, 32, 32] in [0, 1]), "np" (array
                [B, 32, 32, 3]), "latent" ([B, 12, 16, 16]).
            return_dict: return an `ImagePipelineOutput` (else a tuple `(images,)`).
        """
        latents = self._denoise(prompt, labels, num_inference_steps, guidance_scale, generator, latents, cfg_mode,
                                output_type)  # [B, 12, 16, 16]
        if output_type == "latent":
            images = latents
        else:
            images = latents_to_images(latents.float())  # [B, 3, 32, 32] in [0, 1]
            if output_type == "np":
                images = images.permute(0, 2, 3, 1).cpu().numpy()  # [B, 32, 32, 3], diffusers' numpy layout
            elif output_type == "pil":
                images = [to_pil(image) for image in images]
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)
