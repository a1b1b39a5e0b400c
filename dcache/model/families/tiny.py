"""The words a family's tiny test model is written in: plain data that tests/zoo.py turns into a model and inputs.

Each family module ends with its `TINY` dict, zoo name -> `Tiny`:

    TINY = {"flux": Tiny("FluxTransformer2DModel",
                         config=dict(patch_size=1, in_channels=8, num_layers=2, ...),   # constructor kwargs
                         inputs=dict(hidden_states=latents(16, 8),                       # forward kwargs
                                     encoder_hidden_states=noise("txt", TXT, 24),
                                     timestep=timestep(1.0), img_ids=ids(1, 4, 4), ...))}

tests/zoo.py builds `model_class(**config)` with seeded random weights and evaluates `inputs` for a denoising step,
a batch size and a seed. A value in `inputs` is an `Input` below (shapes are per sample unless it says otherwise),
a list or dict of values, or a plain Python value passed as it is. Keep the model tiny: 2 blocks per block list,
width 32 (2 heads x 16), a few dozen tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TXT = 8  # text tokens of every tiny model


@dataclass(frozen=True)
class Tiny:
    model_class: str  # the diffusers class, also the adapter's model_class
    config: dict[str, Any]  # its constructor kwargs
    inputs: dict[str, Any]  # its forward kwargs: Input, list / dict of values, or a plain value
    key: str = ""  # what the random inputs are seeded by; "" = the zoo name
    notes: str = ""


@dataclass(frozen=True)
class Input:
    """One forward argument, evaluated by tests/zoo.py for (step, batch, seed): `kind` names the rule."""

    kind: str
    args: tuple = ()
    options: dict[str, Any] = field(default_factory=dict)


def latents(*shape: int, key: str = "", unbind: int | None = None) -> Input:
    """The noisy latents [B, *shape]: fixed base + a small drift that grows with the step (seeded by the zoo key,
    plus "/key"); `unbind` = a dim to split the batched tensor over into a list."""
    return Input("latents", shape, {"key": key, "unbind": unbind})


def noise(key: str, *shape: int, batch_dim: int = 0, unbind: int | None = None) -> Input:
    """Fixed conditioning, standard normal [B, *shape], the same at every step (seeded by "<zoo key>/<key>");
    `batch_dim` moves the batch dim there, `unbind` splits the result over a dim into a list."""
    return Input("noise", (key, *shape), {"batch_dim": batch_dim, "unbind": unbind})


def timestep(scale: float = 1000.0, *, reverse: bool = False, tokens: int = 0, clean: int = 0,
             ahead: int = 0) -> Input:
    """The step's timestep [B]: scale * sigma(step) (or 1 - sigma with `reverse`, for models counting from noise to
    image); `tokens` > 0 repeats it per token [B, tokens], of which the first `clean` get t = 0; `ahead` = the
    timestep that many steps later."""
    return Input("timestep", (scale,), {"reverse": reverse, "tokens": tokens, "clean": clean, "ahead": ahead})


def filled(value: float | int | bool, *shape: int, dtype: str | None = None, batched: bool = True) -> Input:
    """torch.full([B, *shape] (or [*shape] unbatched), value, dtype=torch.<dtype>): masks, guidance, zeros."""
    return Input("filled", (value, *shape), {"dtype": dtype, "batched": batched})


def repeated(values: list) -> Input:
    """torch.tensor(values) repeated over the batch, [B, len(values)]: per-sample sizes and metadata."""
    return Input("repeated", (tuple(values),))


def per_sample(value: Any) -> Input:
    """A Python list with `value` once per sample (img_shapes)."""
    return Input("per_sample", (value,))


def arange(start: int, stop: int | None = None, *, batched: bool = False) -> Input:
    """torch.arange(start, stop) (frame indices, RoPE positions); `batched` repeats it, [B, n]."""
    return Input("arange", (start, stop), {"batched": batched})


def ids(*axes: int) -> Input:
    """Position ids [prod(axes), len(axes)] of a grid, float (Flux-style RoPE img_ids / txt_ids); unbatched."""
    return Input("ids", axes)


def sample_index(modulo: int) -> Input:
    """torch.arange(B) % modulo: class labels."""
    return Input("sample_index", (modulo,))


def token_ids(key: str, length: int, vocab: int) -> Input:
    """Fixed random token ids [B, length] in 1 .. vocab - 1 (seeded by "<zoo key>/<key>")."""
    return Input("token_ids", (key, length, vocab))


def embedding(function: str, *args: Any, **kwargs: Any) -> Input:
    """diffusers.models.embeddings.<function>(*args, **kwargs): a RoPE table the model takes as an argument."""
    return Input("embedding", (function, *args), kwargs)


__all__ = ["TXT", "Input", "Tiny", "arange", "embedding", "filled", "ids", "latents", "noise", "per_sample",
           "repeated", "sample_index", "timestep", "token_ids"]
