"""Which adapter a transformer gets: the per-family adapter data for diffusers transformers, and the lookup.

    adapter = adapter_for(pipe.transformer)      # its family's adapter, else generic discovery, else a teaching error

One `register_adapter(Adapter(...))` per transformer class, checked against diffusers 0.42 source. For each family:

- `block_lists`: only the `ModuleList`s that run inside the main denoising pass over the latent token stream, in
  execution order. Refiner lists that run first over a *different* token set (text-only context refiners, image-only
  noise refiners, VACE control blocks) are left out and named in `notes`: reuse of the main stack stays correct
  because they run before it on every call.
- `hidden` / `encoder`: the block-forward argument names. `encoder` is set only where the block RETURNS an updated
  text stream; a cross-attention context the block only reads is not a stream (encoder=None), so reuse leaves it be.
- `outputs`: the order of the block's returned tensors (Flux-style blocks return (encoder, hidden); HunyuanVideo /
  CogVideoX-style return (hidden, encoder); single-stream and cross-attention blocks return hidden alone).
- `modules`: inner units whose output can be cached and returned as-is. A module that a block calls more than once
  (one FFN shared by the text and image streams: CogView4, EasyAnimate) is also listed in `shared`, and gets one
  cache per call within the block.
- `modulated_input`: TeaCache's signal, the timestep-modulated input of the first block, computed from that block's
  bound forward arguments without side effects (TeaCache, arXiv 2411.19108). None where the family has no AdaLN-style
  modulation of the hidden stream.

One module per family or family group (`flux.py`: Flux and the Flux-style MMDiTs; `wan.py`; `hunyuan_video.py`;
...) holds its adapter rows, the input functions only it uses, and `TINY`: its tiny test models as plain data
(`tiny.py`), which tests/zoo.py turns into models and inputs and tests/test_zoo.py checks this data against.
`patterns.py` holds what several families share (modulated-input forms, a latent layout, RoPE invariants).
`family_modules()` imports the modules of `FAMILY_MODULES` at the first lookup, not with this package, so a user's
`register_adapter` before it takes a class of their own first. `source_analysis.py` reads a class's source to tell
whether generic discovery may run on it (and SUPPORT.md). Adding a family: docs/architecture.md, "A model family".
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

from torch import nn

from ..adapters import (ENCODER, HIDDEN, Adapter, BlockList, UnsupportedModelError, adapter_registry, block_list,
                        loading_builtins)
from .source_analysis import discovery_refusal

# The built-in family modules, alphabetically: importing one registers its adapters (in this order).
FAMILY_MODULES = ("allegro", "auraflow", "cogvideox", "cogview", "cosmos", "dit", "easyanimate", "flux", "hidream",
                  "hunyuan_image", "hunyuan_video", "joy_image", "kandinsky", "ltx", "lumina", "mochi", "nucleus_moe",
                  "omnigen", "pixart", "prx", "qwen_image", "sana", "sd3", "stable_audio", "wan", "z_image")

_BUILTINS_LOADED = False


def family_modules() -> tuple[ModuleType, ...]:
    """The built-in family modules in FAMILY_MODULES order, imported (their adapters registered) on the first call."""
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in FAMILY_MODULES)


def _load_builtin_families() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        with loading_builtins():  # a user's adapter registered before this keeps its class
            family_modules()


def registered_adapters() -> dict[str, Adapter]:
    """Every registered adapter by class name: the built-in families and the users' own."""
    _load_builtin_families()
    return adapter_registry()


def adapter_for(transformer: nn.Module) -> Adapter:
    """The registered adapter of this transformer's class (walking its MRO), else generic discovery."""
    registry = registered_adapters()
    for cls in type(transformer).__mro__:
        if cls.__name__ in registry:
            adapter = registry[cls.__name__]
            _check_paths(transformer, adapter)
            return adapter
    return discover_adapter(transformer)


def discover_adapter(transformer: nn.Module) -> Adapter:
    """Generic discovery: top-level `ModuleList`s whose children take `hidden_states` and return it first or alone.

    Works for DiTs whose blocks take `hidden_states` (and optionally `encoder_hidden_states`) and return either one
    tensor or a tuple whose order follows the argument order. Anything else needs an explicit adapter.
    """
    refusal = discovery_refusal(type(transformer))  # the static analysis behind SUPPORT.md's "not yet" rows
    if refusal is not None:
        raise UnsupportedModelError(transformer, refusal)
    if _is_unet(transformer):
        raise UnsupportedModelError(transformer, _UNET_REASON)
    lists = []
    for name, child in transformer.named_children():
        if not isinstance(child, nn.ModuleList) or len(child) == 0 or name in _UNET_LISTS:
            continue
        params = inspect.signature(child[0].forward).parameters
        if HIDDEN not in params:
            continue
        encoder = ENCODER if ENCODER in params else None
        lists.append(BlockList(name, encoder=encoder, outputs=(HIDDEN,) if encoder is None else (HIDDEN, ENCODER)))
    if not lists:
        raise UnsupportedModelError(transformer)
    # Unknown tuple order is verified at run time by shape (engine); a mismatch raises UnsupportedModelError.
    return Adapter(model_class=type(transformer).__name__, block_lists=tuple(lists), notes="generic discovery")


# A UNet's down/up blocks take `hidden_states` too, but they change resolution and return skip connections: a
# residual cached across them is meaningless. Generic discovery refuses them instead of caching them wrongly.
_UNET_LISTS = frozenset({"down_blocks", "up_blocks", "mid_blocks"})
_UNET_REASON = ("it is a UNet (down/up blocks change resolution and pass skip connections), and dcache caches the "
                "repeated blocks of diffusion transformers (DiT / MM-DiT), so it has nothing to cache here; apply it "
                "to a transformer model (pipe.transformer) instead")


def _is_unet(model: nn.Module) -> bool:
    return any("unet" in cls.__name__.lower() for cls in type(model).__mro__)


def _check_paths(transformer: nn.Module, adapter: Adapter) -> None:
    for spec in adapter.block_lists:
        block_list(transformer, spec.path)


__all__ = ["FAMILY_MODULES", "adapter_for", "discover_adapter", "family_modules", "registered_adapters"]
