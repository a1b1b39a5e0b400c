"""Shared pieces of the compatibility matrix: a tiny diffusers-style pipeline, reference runs, hook inventories.

`CompatPipeline` is a minimal FluxPipeline look-alike (FluxTransformer2DModel + FlowMatchEulerDiscreteScheduler + a
label "text encoder"), small enough for hundreds of generations on a CPU, with every knob the matrix varies:

    pipe = make_pipeline()
    pipe(labels=[1, 2], height=4, width=4, num_inference_steps=4, guidance_scale=3.0, num_images_per_prompt=2,
         cfg_mode="split" | "batched", cache_context=True | False, generator=torch.Generator().manual_seed(0))
    -> latent tokens [B * num_images_per_prompt, H * W, C]

Like diffusers pipelines it calls `scheduler.set_timesteps` once per call, runs each transformer call inside
`transformer.cache_context("cond" | "uncond" | "cond_uncond")` (unless cache_context=False, as older or third-party
pipelines do), and calls `maybe_free_model_hooks()` at the end (model CPU offload).
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

from dcache.pipelines.label_encoder import LabelEncoder

CHANNELS = 4
TXT_TOKENS = 2
JOINT_DIM = 16
POOLED_DIM = 16
TRANSFORMER_CONFIG = dict(patch_size=1, in_channels=CHANNELS, num_layers=2, num_single_layers=3,
                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=JOINT_DIM,
                          pooled_projection_dim=POOLED_DIM, axes_dims_rope=(4, 6, 6))
NUM_BLOCKS = TRANSFORMER_CONFIG["num_layers"] + TRANSFORMER_CONFIG["num_single_layers"]
BLOCK_LAYOUT = [TRANSFORMER_CONFIG["num_layers"], TRANSFORMER_CONFIG["num_single_layers"]]


def grid_ids(height: int, width: int) -> torch.Tensor:
    """RoPE ids [(H*W), 3] = (0, row, col), as Flux's latent image ids."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


class CompatPipeline(DiffusionPipeline):
    model_cpu_offload_seq = "label_encoder->transformer"
    _optional_components: list[str] = []

    def __init__(self, transformer: FluxTransformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler,
                 label_encoder: LabelEncoder):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, label_encoder=label_encoder)

    def _velocity(self, x, labels, timestep, txt_ids, img_ids):
        enc, pooled = self.label_encoder(labels.to(self._execution_device))
        dtype = x.dtype
        return self.transformer(hidden_states=x, encoder_hidden_states=enc.to(dtype),
                                pooled_projections=pooled.to(dtype), timestep=timestep, img_ids=img_ids,
                                txt_ids=txt_ids, return_dict=False)[0]

    @torch.no_grad()
    def __call__(self, labels: list[int], height: int = 4, width: int = 4, num_inference_steps: int = 4,
                 guidance_scale: float = 1.0, num_images_per_prompt: int = 1, cfg_mode: str = "split",
                 cache_context: bool = True, generator: torch.Generator | None = None,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        device = self._execution_device
        dtype = torch.float32
        labels = [int(label) for label in labels for _ in range(num_images_per_prompt)]
        batch = len(labels)
        cond = torch.tensor(labels, dtype=torch.long, device=device)
        uncond = torch.full_like(cond, self.label_encoder.null_label)
        txt_ids = torch.zeros(TXT_TOKENS, 3, device=device)
        img_ids = grid_ids(height, width).to(device)
        if latents is None:
            latents = randn_tensor((batch, height * width, CHANNELS), generator=generator, device=device, dtype=dtype)
        x = latents
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps),
                                     device=device)
        do_cfg = guidance_scale > 1.0

        def ctx(name):
            if cache_context:
                return self.transformer.cache_context(name)
            return _null()

        for t in self.scheduler.timesteps:
            timestep = t.expand(batch).to(dtype) / 1000
            if not do_cfg:
                with ctx("cond"):
                    v = self._velocity(x, cond, timestep, txt_ids, img_ids)
            elif cfg_mode == "split":
                with ctx("cond"):
                    v_c = self._velocity(x, cond, timestep, txt_ids, img_ids)
                with ctx("uncond"):
                    v_u = self._velocity(x, uncond, timestep, txt_ids, img_ids)
                v = v_u + guidance_scale * (v_c - v_u)
            else:
                with ctx("cond_uncond"):
                    v_both = self._velocity(torch.cat([x, x]), torch.cat([uncond, cond]), timestep.repeat(2),
                                            txt_ids, img_ids)
                v_u, v_c = v_both.chunk(2)
                v = v_u + guidance_scale * (v_c - v_u)
            x = self.scheduler.step(v, t, x, return_dict=False)[0]
        self.maybe_free_model_hooks()
        return x


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_transformer(seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(**TRANSFORMER_CONFIG).float().eval()


def make_pipeline(seed: int = 0) -> CompatPipeline:
    transformer = make_transformer(seed)
    torch.manual_seed(seed + 1)
    encoder = LabelEncoder(num_classes=10, num_tokens=TXT_TOKENS, joint_attention_dim=JOINT_DIM,
                           pooled_projection_dim=POOLED_DIM).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    pipe = CompatPipeline(transformer, scheduler, encoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def hook_names(module: nn.Module) -> dict[str, list[str]]:
    """{qualified module name: hook names} for every module under `module` that carries a diffusers HookRegistry."""
    out = {}
    for name, m in module.named_modules():
        reg = getattr(m, "_diffusers_hook", None)
        if reg is not None and reg._hook_order:
            out[name] = list(reg._hook_order)
    return out


def dcache_hook_count(module: nn.Module) -> int:
    return sum(names.count("dcache") for names in hook_names(module).values())


def forward_is_pristine(module: nn.Module) -> bool:
    """No instance-level forward override left on any submodule (what diffusers hooks install)."""
    return all("forward" not in vars(m) for m in module.modules())


def scheduler_is_pristine(scheduler: Any) -> bool:
    return "set_timesteps" not in vars(scheduler) and "step" not in vars(scheduler)


def live_tensor_bytes() -> int:
    """Bytes held by live (non-parameter) tensors, after a full garbage collection."""
    gc.collect()
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch objects warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
                    total += obj.numel() * obj.element_size()
            except Exception:  # noqa: BLE001 - some objects refuse isinstance checks during collection
                continue
    return total
