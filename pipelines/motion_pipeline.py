"""`MotionClipPipeline`: class-conditional video with a tiny `WanTransformer3DModel`, Wan's sampler and loop.

It keeps `WanPipeline`'s denoising loop: `UniPCMultistepScheduler` with flow prediction (`use_flow_sigmas`,
`flow_shift`), `set_timesteps(N)` once per generation, the transformer called with the scheduler's timestep
(t in [0, 1000], = 1000 sigma) on latents [B, C, F, h, w], each call inside `cache_context("cond")` /
`cache_context("uncond")` (split CFG, Wan's default) with step_index / sigma / num_inference_steps, and
`scheduler.step(v, t, latents)`. Only the conditioning differs: `WanPipeline` needs a UMT5 text encoder and a
trained `AutoencoderKLWan`; here a `LabelEncoder` stands in for the text encoder (its tokens are Wan's
`encoder_hidden_states`), and the latents are the pixels folded 2x2 into channels (`procedural_data`), which
needs no VAE.

Clips: `pipe("right").frames[0]` is a list of 5 PIL frames of a scene moving right (a camera pan; prompts:
"right", "left", "down", "up"). Latents [B, 12, 5, 8, 8] <-> frames [B, 5, 3, 16, 16] in [0, 1]; patch (1, 2, 2):
80 tokens.
"""

from collections.abc import Sequence

import PIL.Image
import torch
from diffusers import UniPCMultistepScheduler, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

from .class_pipeline import ClassConditionalPipeline
from .label_encoder import LabelEncoder
from .procedural_data import CLIP_FRAMES, CLIP_SIZE, MOTION_CLASSES, latents_to_clips

DEFAULT_STEPS = 20
DEFAULT_GUIDANCE = 5.0  # WanPipeline's default guidance
PIL_SCALE = 4  # "pil" frames are upscaled with nearest-neighbour: 16x16 -> 64x64


class MotionClipPipeline(ClassConditionalPipeline):
    """Generates 5-frame 16x16 RGB clips of a scene panning in the requested direction. Components: transformer,
    scheduler, label_encoder."""

    noun = "clip"
    prompt_noun = "motion direction"
    class_names = MOTION_CLASSES
    default_steps = DEFAULT_STEPS
    default_guidance = DEFAULT_GUIDANCE
    state_dtype = torch.float32  # Wan keeps its sampler state in float32 and casts each transformer input

    def __init__(self, transformer: WanTransformer3DModel, scheduler: UniPCMultistepScheduler,
                 label_encoder: LabelEncoder):
        super().__init__(transformer, scheduler, label_encoder)

    def sample_shape(self) -> tuple[int, ...]:
        c = self.transformer.config.in_channels
        return (c, CLIP_FRAMES, CLIP_SIZE // 2, CLIP_SIZE // 2)  # Wan's latent layout [C, F, h, w]

    def _transformer_call(self, x, t, labels, embedded):
        """x [B, 12, 5, 8, 8] at t in [0, 1000] -> flow prediction v [B, 12, 5, 8, 8], as WanPipeline calls it. x is
        cast to the dtype the embeddings were made in (the transformer's, read once per generation as WanPipeline
        does: `transformer.dtype` walks every parameter, ~0.9 ms a call on this model)."""
        return self.transformer(hidden_states=x.to(embedded[0].dtype), timestep=t.expand(x.shape[0]),
                                encoder_hidden_states=embedded[0], return_dict=False)[0]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | int | Sequence[str | int] | None = None,
        num_inference_steps: int = DEFAULT_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        cfg_mode: str = "split",
        output_type: str = "np",
        return_dict: bool = True,
        labels: int | Sequence[int] | torch.Tensor | None = None,
    ):
        """Generate one clip per requested direction, as `WanPipeline` does per prompt.

            pipe("right").frames[0]                    # [5, 16, 16, 3] numpy frames of a scene moving right
            pipe(["up", "left"], output_type="pt")     # .frames: tensor [2, 5, 3, 16, 16] in [0, 1]

        Args:
            prompt: a direction ("right", "left", "down", "up"), a class label (0..3), or a list of them.
            labels: the same as class labels 0..3 (instead of `prompt`).
            num_inference_steps: UniPC steps (>= 1).
            guidance_scale: CFG scale g; v = v_uncond + g * (v_cond - v_uncond). g <= 1: no CFG, one call per step.
            generator: torch.Generator (or one per label) for the starting noise.
            latents: starting noise [B, 12, 5, 8, 8] instead of drawing it.
            cfg_mode: "split" (two calls per step, cond then uncond, as WanPipeline) or "batched" (one call on
                [uncond; cond]).
            output_type: "np" (default, as WanPipeline: array [B, 5, 16, 16, 3] in [0, 1]), "pt" (tensor
                [B, 5, 3, 16, 16]), "pil" (per clip a list of 5 RGB 64x64 images), "latent" ([B, 12, 5, 8, 8]).
            return_dict: return a `WanPipelineOutput` (else a tuple `(frames,)`).
        """
        latents = self._denoise(prompt, labels, num_inference_steps, guidance_scale, generator, latents, cfg_mode,
                                output_type)  # [B, 12, 5, 8, 8], float32
        if output_type == "latent":
            frames = latents
        else:
            frames = latents_to_clips(latents.float())  # [B, F, 3, 16, 16] in [0, 1]
            if output_type == "np":
                frames = frames.permute(0, 1, 3, 4, 2).cpu().numpy()  # [B, F, 16, 16, 3], diffusers' video layout
            elif output_type == "pil":
                frames = [[to_pil(frame) for frame in clip] for clip in frames]
        if not return_dict:
            return (frames,)
        return WanPipelineOutput(frames=frames)


def to_pil(image: torch.Tensor, scale: int = PIL_SCALE) -> PIL.Image.Image:
    """[3, H, W] in [0, 1] -> RGB PIL image (H*scale, W*scale), nearest-neighbour upscaled."""
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).cpu().numpy()
    pil = PIL.Image.fromarray(pixels)  # uint8 [H, W, 3] -> mode "RGB"
    return pil.resize((pixels.shape[1] * scale, pixels.shape[0] * scale), resample=PIL.Image.NEAREST)
