"""`ClassConditionalPipeline`: what the bundled class-conditional pipelines share.

The bundled models (digits with Flux, motion clips with Wan, shapes with SD3) are conditioned on a class label
through a `LabelEncoder` instead of a text encoder, and otherwise follow their diffusers pipeline. This base holds
what does not depend on the family: prompts/labels -> class ids, the input checks (each error names the fix), the
label embeddings made once per generation, and one guided velocity per step:

    v = v_uncond + g * (v_cond - v_uncond)      g = guidance_scale > 1; g <= 1: v = v_cond, one call per step

computed by "split" CFG (two calls: cond, then uncond) or "batched" CFG (one call on the doubled batch
[uncond; cond]). Each call runs inside the transformer's `cache_context("cond" | "uncond" | "cond_uncond")` where
the transformer class has one (diffusers' `CacheMixin`), as diffusers' Flux and Wan pipelines do; classes without
it (SD3) are called bare, as `StableDiffusion3Pipeline` calls them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils.torch_utils import randn_tensor

CFG_MODES = ("split", "batched")


def parse_class_prompt(prompt, class_names: Sequence[str], noun: str, position: int | None = None) -> int:
    """A prompt naming a class -> its id: the class name in any case and spacing ("Red  Circle" -> "red circle"),
    or the class id as text ("4"). A ValueError that lists the names otherwise."""
    text = " ".join(prompt.lower().split()) if isinstance(prompt, str) else None
    if text is not None and text.isdigit() and int(text) < len(class_names):
        return int(text)
    if text in class_names:
        return class_names.index(text)
    where = "" if position is None else f" at position {position}"
    raise ValueError(f"prompt {prompt!r}{where} names no {noun}: this model takes the prompts "
                     f"{', '.join(repr(n) for n in class_names)} (or class labels: pipe(labels=[0, 1])).")


class ClassConditionalPipeline(DiffusionPipeline):
    """Base of the bundled pipelines; components: transformer, scheduler, label_encoder.

    A subclass sets `noun`, `class_names`, `default_steps`, `default_guidance`, `default_cfg_mode`, implements
    `sample_shape` and `_transformer_call`, and its `__call__` (the documented signature) runs `_denoise` and turns
    the final latents into its output type."""

    model_cpu_offload_seq = "label_encoder->transformer"
    noun = "class"  # what one sample is called in messages: "digit", "clip", "shape"
    prompt_noun = "class"  # what a prompt names, in messages: "motion direction", "coloured shape"
    class_names: tuple[str, ...] = ()  # the prompts, in label order
    default_steps = 28
    default_guidance = 1.0
    default_cfg_mode = "split"
    output_types = ("pt", "np", "pil", "latent")
    state_dtype: torch.dtype | None = None  # dtype of the sampler state; None: the transformer's

    def __init__(self, transformer, scheduler, label_encoder):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, label_encoder=label_encoder)

    @property
    def num_classes(self) -> int:
        return self.label_encoder.config.num_classes

    @property
    def num_timesteps(self) -> int:
        """Number of denoising steps of the last (or current) call."""
        return self._num_timesteps

    @property
    def guidance_scale(self) -> float:
        """The CFG scale of the last (or current) call, as diffusers pipelines expose it (caches read it)."""
        return self._guidance_scale

    def parse_prompt(self, prompt, position: int | None = None) -> int:
        """A prompt -> its class label (`parse_class_prompt` over `class_names`)."""
        return parse_class_prompt(prompt, self.class_names, self.prompt_noun, position)

    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample's starting noise (what `latents` holds per label)."""
        raise NotImplementedError

    def _transformer_call(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor,
                          embedded: tuple) -> torch.Tensor:
        """The transformer on the sampler state x [B or 2B, ...] at scheduler timestep t for the branch's labels
        [B or 2B] and their `_encode` pair -> its prediction (v = noise - x_0), shaped as x."""
        raise NotImplementedError

    def _set_timesteps(self, num_inference_steps: int, device) -> None:
        """The scheduler's `set_timesteps` for a generation (once per call, as diffusers pipelines do)."""
        self.scheduler.set_timesteps(num_inference_steps, device=device)

    def _to_state(self, latents: torch.Tensor) -> torch.Tensor:
        """Starting noise (layout `sample_shape`) -> the sampler state the transformer takes."""
        return latents

    def _labels(self, prompt, labels):
        """`prompt` (a class name, a label, or a list of them) or `labels` -> what `_check_inputs` takes."""
        if prompt is not None and labels is not None:
            raise ValueError(f"pass the {self.noun}s as prompt (pipe('{self.parse_example}')) or as labels "
                             f"(pipe(labels=[0, 1])), not both.")
        if prompt is None:
            if labels is None:
                raise ValueError(f"no {self.noun} requested: pass a prompt such as pipe('{self.parse_example}'), or "
                                 f"class labels such as pipe(labels=[0, 1]).")
            return labels
        if isinstance(prompt, str):
            return [self.parse_prompt(prompt)]
        if isinstance(prompt, (list, tuple)):
            return [self.parse_prompt(p, i) if isinstance(p, str) else p for i, p in enumerate(prompt)]
        return prompt  # an int, a tensor of labels: checked as labels

    @property
    def parse_example(self) -> str:
        return self.class_names[0] if self.class_names else "0"

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
                f"e.g. pipe(labels=[0, 1, 2]), or prompts such as pipe(['{self.parse_example}'])."
            )
        bad = [(i, label) for i, label in enumerate(labels) if not 0 <= label < self.num_classes]
        if bad:
            i, label = bad[0]
            raise ValueError(
                f"labels must be {self.noun} classes in 0..{self.num_classes - 1}, got {label} at position {i}; the "
                f"null label {self.num_classes} is reserved for the unconditional branch of CFG (use "
                f"guidance_scale=1 to turn CFG off)."
            )
        if (isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, (int, np.integer))
                or num_inference_steps < 1):
            raise ValueError(f"num_inference_steps must be an int >= 1, got {num_inference_steps!r}; the default is "
                             f"{self.default_steps}.")
        if (isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float))
                or not math.isfinite(guidance_scale)):
            raise ValueError(
                f"guidance_scale must be a finite number, got {guidance_scale!r}; values <= 1 turn CFG off, the "
                f"default is {self.default_guidance}."
            )
        if cfg_mode not in CFG_MODES:
            raise ValueError(
                f"cfg_mode must be one of {CFG_MODES}, got {cfg_mode!r}: 'split' makes two transformer calls per step "
                "(cond, then uncond), 'batched' one call on the doubled batch [uncond; cond]."
            )
        if output_type not in self.output_types:
            raise ValueError(f"output_type must be one of {self.output_types}, got {output_type!r}.")
        if isinstance(generator, list) and len(generator) != len(labels):
            raise ValueError(
                f"got a list of {len(generator)} generators for {len(labels)} labels; pass one generator, or one per "
                f"label."
            )
        expected = (len(labels), *self.sample_shape())
        if latents is not None and tuple(latents.shape) != expected:
            raise ValueError(
                f"latents must be the starting noise in layout {list(expected)} (one per label), got "
                f"{list(latents.shape)}."
            )
        return [int(label) for label in labels]

    def _encode(self, labels, dtype):
        """labels [B] -> (encoder_hidden_states [B, T, D], pooled [B, P] or None) in `dtype`: the prompt embedding,
        made once per generation (as diffusers pipelines encode their prompts before the denoising loop)."""
        encoder_hidden_states, pooled = self.label_encoder(labels)
        return encoder_hidden_states.to(dtype), None if pooled is None else pooled.to(dtype)

    def _label_embeddings(self, labels: list[int], do_cfg: bool, cfg_mode: str, device, dtype) -> dict:
        """What each branch needs, made once per generation: {"cond": (labels [B], embedding), "uncond": ...} (split
        CFG) or {"cond": ..., "both": (labels [2B] = [uncond; cond], embedding)} (batched CFG); an embedding is
        `_encode`'s pair."""
        cond = torch.tensor(labels, dtype=torch.long, device=device)  # [B]
        uncond = torch.full_like(cond, self.label_encoder.null_label)  # [B]
        branches = {"cond": cond}
        if do_cfg and cfg_mode == "split":
            branches["uncond"] = uncond
        elif do_cfg:
            branches["both"] = torch.cat([uncond, cond])  # [2B], batched CFG order
        return {name: (branch, self._encode(branch, dtype)) for name, branch in branches.items()}

    def _context(self, name: str, **kwargs):
        """The transformer's `cache_context(name, **kwargs)` where its class has one, else a no-op."""
        cache_context = getattr(self.transformer, "cache_context", None)
        return contextlib.nullcontext() if cache_context is None else cache_context(name, **kwargs)

    def _guided_velocity(
        self, call: Callable[[torch.Tensor, torch.Tensor, tuple], torch.Tensor], x: torch.Tensor, embeds: dict,
        guidance_scale: float, context: dict,
    ) -> torch.Tensor:
        """One step's guided velocity. call(x, labels, embedding) runs the transformer on x [B, ...] (or [2B, ...]
        for batched CFG) with one branch of `_label_embeddings`; v = v_uncond + g (v_cond - v_uncond) when embeds
        hold an uncond branch, else v_cond."""
        if "uncond" in embeds:
            with self._context("cond", **context):
                v_cond = call(x, *embeds["cond"])
            with self._context("uncond", **context):
                v_uncond = call(x, *embeds["uncond"])
        elif "both" in embeds:
            with self._context("cond_uncond", **context):
                v_uncond, v_cond = call(torch.cat([x, x]), *embeds["both"]).chunk(2)
        else:
            with self._context("cond", **context):
                return call(x, *embeds["cond"])
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def _denoise(self, prompt, labels, num_inference_steps, guidance_scale, generator, latents, cfg_mode,
                 output_type) -> torch.Tensor:
        """The checked call's denoising loop -> the final sampler state:

            set_timesteps once; per step i at timestep t: v = guided velocity (`_guided_velocity`, each call in
            cache_context with step_index / num_inference_steps / timestep / sigma), x = scheduler.step(v, t, x)
        """
        labels = self._check_inputs(self._labels(prompt, labels), num_inference_steps, guidance_scale, generator,
                                    latents, cfg_mode, output_type)
        device = self._execution_device
        dtype = self.transformer.dtype
        state_dtype = self.state_dtype or dtype
        embeds = self._label_embeddings(labels, guidance_scale > 1.0, cfg_mode, device, dtype)  # once per generation

        if latents is None:
            latents = randn_tensor((len(labels), *self.sample_shape()), generator=generator, device=device,
                                   dtype=state_dtype)
        x = self._to_state(latents.to(device=device, dtype=state_dtype))  # x_1 = noise

        self._set_timesteps(num_inference_steps, device)
        self.scheduler.set_begin_index(0)
        timesteps = self.scheduler.timesteps  # [N] = 1000 * shifted sigma
        sigmas = self.scheduler.sigmas.tolist()  # [N + 1] on the host, once, for the cache context
        self._num_timesteps = len(timesteps)
        self._guidance_scale = float(guidance_scale)

        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                context = dict(step_index=i, num_inference_steps=num_inference_steps, timestep=t, sigma=sigmas[i])

                def call(x_in, branch_labels, embedded):  # x_in [B or 2B, ...] -> prediction of the same shape
                    return self._transformer_call(x_in, t, branch_labels, embedded)

                velocity = self._guided_velocity(call, x, embeds, guidance_scale, context)
                x = self.scheduler.step(velocity, t, x, return_dict=False)[0]
                progress_bar.update()

        self.maybe_free_model_hooks()
        return x
