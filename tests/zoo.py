"""A zoo of tiny diffusers transformers, one per family with a dcache adapter, for tests.

    ZOO["flux"].make_model()                       -> FluxTransformer2DModel, random weights (seeded), fp32, eval
    ZOO["flux"].make_inputs(step, batch=1, generator=None) -> forward kwargs for that denoising step

Every model is tiny (2 blocks per block list, width 32, a few dozen tokens; a CPU forward takes milliseconds) and is
built from a config: nothing is downloaded. Each family module (dcache/model/families/<family>.py) holds its tiny
models as plain data, `TINY` (the words: dcache/model/families/tiny.py); this file builds them.

Inputs imitate a denoising trajectory so that caching has something to exploit: fixed base latents plus a small
smooth drift that grows with the step, fixed text conditioning, and a noise level sigma(step) = exp(-step /
ZOO_STEPS) that decreases with the step, written in each model's own timestep convention (t = 1000*sigma, t = sigma,
or t = 1 - sigma for Lumina / Z-Image, which count from noise to image).

Determinism: `make_inputs` is a pure function of (step, batch, seed); the seed is `generator.initial_seed()` when a
generator is given, else 0. Sample i of a batch depends only on (seed, i), so a batch of 2 starts with the batch of 1.

Import from another test file (pytest runs with --import-mode=importlib, so tests/ is not a package):

    import importlib.util, pathlib, sys
    def _zoo():
        if "dcache_test_zoo" not in sys.modules:
            spec = importlib.util.spec_from_file_location("dcache_test_zoo",
                                                          pathlib.Path(__file__).with_name("zoo.py"))
            sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        return sys.modules["dcache_test_zoo"]
    ZOO = _zoo().ZOO
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dcache.model.families import family_modules
from dcache.model.families.tiny import Input, Tiny

ZOO_STEPS = 10  # sigma(step) falls from 1 to e^-1 over ZOO_STEPS steps and keeps falling after
DRIFT = 0.05  # how far the latents move along a fixed direction as sigma goes from 1 to 0
WIDTH = 32  # hidden size of every zoo model: 2 heads x 16


@dataclass(frozen=True)
class ZooEntry:
    name: str  # short family name, the ZOO key
    model_class: str  # diffusers class name == the dcache adapter's model_class
    make_model: Callable[[], nn.Module]  # tiny config, random weights (seeded), fp32, eval mode
    make_inputs: Callable[..., dict[str, Any]]  # (step, batch=1, generator=None) -> forward kwargs
    notes: str = ""


ZOO: dict[str, ZooEntry] = {}
# families whose forward reads tensor values (MoE token counts, .item(), autocast): they cannot run on meta tensors,
# so a cache-memory estimate refuses them (dcache.memory.estimate)
READS_TENSOR_VALUES = frozenset({"hunyuan_video15", "lumina2", "hidream", "mochi", "hunyuan_video_framepack",
                                 "omnigen"})


# ---- deterministic inputs ---------------------------------------------------------------------------------------

def sigma(step: int) -> float:
    """Noise level of `step`: 1.0 at step 0, exp(-1) at ZOO_STEPS, smooth and strictly decreasing."""
    return math.exp(-step / ZOO_STEPS)


def _seed(generator: torch.Generator | None) -> int:
    return 0 if generator is None else int(generator.initial_seed())


def _randn(key: str, shape: tuple[int, ...], batch: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[batch, *shape] standard normal; sample i depends only on (key, seed, i)."""
    samples = []
    for i in range(batch):
        g = torch.Generator().manual_seed((zlib.crc32(key.encode()) + 7919 * seed + 104729 * i) % (2**63))
        samples.append(torch.randn(shape, generator=g) * scale)
    return torch.stack(samples)


def _latents(key: str, shape: tuple[int, ...], step: int, batch: int, seed: int) -> torch.Tensor:
    """Base latents + DRIFT * (1 - sigma(step)) * a fixed direction: consecutive steps differ by ~DRIFT/ZOO_STEPS."""
    base = _randn(key + "/base", shape, batch, seed)
    direction = _randn(key + "/direction", shape, batch, seed)
    return base + DRIFT * (1.0 - sigma(step)) * direction


def _t(step: int, batch: int, scale: float = 1000.0) -> torch.Tensor:
    """Timestep [batch] = scale * sigma(step) (1000-step or [0, 1] conventions)."""
    return torch.full((batch,), scale * sigma(step))


def _t_reversed(step: int, batch: int) -> torch.Tensor:
    """Timestep [batch] = 1 - sigma(step): Lumina / Z-Image count from noise (0) to image (1)."""
    return torch.full((batch,), 1.0 - sigma(step))


def _ids(*axes: int, offset_axis: int | None = None) -> torch.Tensor:
    """Position ids [prod(axes), len(axes)] of a grid; used for Flux-style RoPE (img_ids / txt_ids)."""
    grids = torch.meshgrid(*[torch.arange(n) for n in axes], indexing="ij")
    return torch.stack([g.flatten() for g in grids], dim=-1).float()


def _build(cls: Callable[..., nn.Module], seed: int = 0, **config) -> nn.Module:
    torch.manual_seed(seed)
    model = cls(**config)
    return model.float().eval()


def _diffusers(name: str):
    import diffusers

    return getattr(diffusers, name, None) or getattr(diffusers.models.transformers, name)


# ---- the family modules' tiny models (dcache/model/families/*.py, TINY) --------------------------------------------
# Shapes in comments: B batch, C latent channels, F frames, H/W latent height/width, L tokens, T text tokens.

def _value(spec: Any, key: str, step: int, batch: int, seed: int) -> Any:
    """One forward argument of a tiny model (dcache/model/families/tiny.py says what each kind means)."""
    if isinstance(spec, list):
        return [_value(item, key, step, batch, seed) for item in spec]
    if isinstance(spec, dict):
        return {name: _value(item, key, step, batch, seed) for name, item in spec.items()}
    if not isinstance(spec, Input):
        return copy.deepcopy(spec)
    args, options = spec.args, spec.options
    if spec.kind == "latents":
        value = _latents(key + (f"/{options['key']}" if options["key"] else ""), args, step, batch, seed)
    elif spec.kind == "noise":
        value = _randn(f"{key}/{args[0]}", args[1:], batch, seed)
        if options["batch_dim"]:
            value = value.transpose(0, options["batch_dim"])
    elif spec.kind == "timestep":
        value = _t_reversed(step, batch) if options["reverse"] else _t(step + options["ahead"], batch, args[0])
        if options["tokens"]:
            value = value[:, None].repeat(1, options["tokens"])
            value[:, :options["clean"]] = 0.0
    elif spec.kind == "filled":
        dtype = getattr(torch, options["dtype"]) if options["dtype"] else None
        shape = (batch, *args[1:]) if options["batched"] else args[1:]
        value = torch.full(shape, args[0], dtype=dtype)
    elif spec.kind == "repeated":
        value = torch.tensor([args[0]]).repeat(batch, 1)
    elif spec.kind == "per_sample":
        value = [copy.deepcopy(args[0])] * batch
    elif spec.kind == "arange":
        value = torch.arange(*(a for a in args if a is not None))
        value = value.unsqueeze(0).repeat(batch, 1) if options["batched"] else value
    elif spec.kind == "ids":
        value = _ids(*args)
    elif spec.kind == "sample_index":
        value = torch.arange(batch) % args[0]
    elif spec.kind == "token_ids":
        name, length, vocab = args
        value = (_randn(f"{key}/{name}", (length,), batch, seed).abs() * 20).long() % (vocab - 1) + 1
    elif spec.kind == "embedding":
        import diffusers.models.embeddings as embeddings

        value = getattr(embeddings, args[0])(*args[1:], **options)
    else:
        raise ValueError(f"unknown tiny input kind {spec.kind!r}")
    if options.get("unbind") is not None:
        value = list(value.unbind(options["unbind"]))
    return value


def _entry(name: str, tiny: Tiny) -> ZooEntry:
    key = tiny.key or name

    def make_model():
        return _build(_diffusers(tiny.model_class), **copy.deepcopy(tiny.config))

    def make_inputs(step, batch=1, generator=None):
        seed = _seed(generator)
        return {arg: _value(spec, key, step, batch, seed) for arg, spec in tiny.inputs.items()}

    return ZooEntry(name, tiny.model_class, make_model, make_inputs, tiny.notes)


for _module in family_modules():
    for _name, _tiny in _module.TINY.items():
        assert _name not in ZOO, f"two tiny models named {_name!r}"
        ZOO[_name] = _entry(_name, _tiny)


# A static schedule per unit kind (method, config for forecast order k, scope): decisions depend on the step only, so
# two runs of one model that differ in how the cache is stored (dtype, device) take the same decisions.
STATIC_UNIT_SCHEDULES = {
    "stack": ("fixed_interval", lambda k: {"interval": 2, "forecast_order": k}, "blocks"),
    "block": ("taylorseer", lambda k: {"granularity": "block", "interval": 2, "order": k, "warmup_steps": 1},
              "blocks"),
    "module": ("taylorseer", lambda k: {"granularity": "module", "interval": 2, "order": k, "warmup_steps": 1},
               "blocks"),
    "call": ("fixed_interval", lambda k: {"interval": 2, "forecast_order": k}, "call"),
}
