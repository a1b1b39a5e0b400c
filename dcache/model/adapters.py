"""Model adapters: where a diffusers transformer keeps its blocks and what the blocks take and return.

An adapter is data, not code: per transformer class, the ordered block lists (`ModuleList` attribute paths), the
argument names that carry the hidden / encoder streams into a block, the order of the block's returned tensors,
the inner modules that module-level caching may address, and (optionally) how to read the timestep-modulated input
of the first block (TeaCache's signal). A registry keyed by class name holds the known families (and the users'
own adapters); `dcache.model.families.adapter_for` looks a transformer up there, falls back to generic discovery for
unknown DiTs and raises `UnsupportedModelError`, which shows how to register one.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

HIDDEN = "hidden_states"
ENCODER = "encoder_hidden_states"

# Names of block children that module-level units may address, in the order they are offered.
CONVENTIONAL_MODULES = ("attn", "attn1", "attn2", "ff", "ff_context", "mlp", "proj_mlp", "self_attn", "cross_attn",
                        "ffn", "feed_forward")

# fn(block, bound_arguments) -> tensor: the modulated input of the first block (computed before the block runs).
ModulatedInputFn = Callable[[nn.Module, dict[str, Any]], torch.Tensor]


@dataclass(frozen=True)
class Invariant:
    """A transformer submodule whose output is the same at every step for the same key
    (dcache.runtime.step_invariant)."""

    module: str  # dotted path under the transformer, e.g. "pos_embed"
    key: str = "inputs"  # "inputs" | "shapes" (ignored when depends_on is given)
    depends_on: tuple[str, ...] = ()  # transformer forward arguments the output is a function of

    def __post_init__(self) -> None:
        if self.key not in ("inputs", "shapes"):
            raise ValueError(f"Invariant({self.module!r}).key={self.key!r} must be 'inputs' or 'shapes'.")


@dataclass(frozen=True)
class BlockList:
    """One `ModuleList` of blocks inside the transformer.

    path:    attribute path from the transformer, e.g. "transformer_blocks" or "single_transformer_blocks".
    hidden:  name of the block-forward argument that carries the image/video tokens [B, L, D].
    encoder: name of the argument carrying text tokens [B, L_txt, D], or None if the block has no text stream.
    outputs: what the block returns, in order: HIDDEN / ENCODER, or None for a returned slot that is passed through
             untouched (e.g. an extra tensor). A block that returns one tensor has outputs=(HIDDEN,).
    adds_in_place: the transformer may write into a block's returned stream in place before the next block (Chroma's
             single-block ControlNet samples: `h[:, L_txt:] = h[:, L_txt:] + c`). The engine cannot see such an
             addition by tensor identity, so a stack segment of this list sums its blocks' own residuals
             (out_i - in_i, read as each block returns) instead of taking out_last - in_first.
    """

    path: str
    hidden: str = HIDDEN
    encoder: str | None = ENCODER
    outputs: tuple[str | None, ...] = (HIDDEN,)
    adds_in_place: bool = False

    def __post_init__(self) -> None:
        if HIDDEN not in self.outputs:
            raise ValueError(f"BlockList({self.path!r}): outputs={self.outputs} must name {HIDDEN!r} once.")


@dataclass(frozen=True)
class Adapter:
    """Everything the engine needs to know about one transformer family."""

    model_class: str
    block_lists: tuple[BlockList, ...]
    modules: tuple[str, ...] = ()  # inner modules for module-level units; () = discover CONVENTIONAL_MODULES
    modulated_input: ModulatedInputFn | None = None
    notes: str = ""
    # Module units whose input is made of other units' outputs only, as (unit, (input units, ...)); e.g. a Flux
    # single block's proj_out(cat[attn, gelu(proj_mlp)]). When such a unit is reused or forecast its inputs' outputs
    # are not used, so the engine reuses them too instead of computing them (a unit missing in a block is skipped).
    composed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # fn(the transformer's bound forward arguments) -> the call's noisy latents [B, C, T, H, W]
    # (dcache.runtime.latents, for signals that read the latents' grid), or None; unset: a 4-D / 5-D `hidden_states`
    # argument is taken as it is.
    latents: Callable[[dict[str, Any]], torch.Tensor | None] | None = None
    # Step-invariant modules outside the blocks (RoPE tables) that the engine computes once
    # (dcache.runtime.step_invariant).
    invariants: tuple[Invariant, ...] = ()
    # Module units a block calls more than once per forward (CogView4's `ff` runs on the image tokens, then on the
    # text tokens): the engine keeps one cache per call of the unit within a block, in call order (k-th call reuses
    # the k-th cached output); the unit's action covers all of its calls.
    shared: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not set(self.shared) <= set(self.modules):
            raise ValueError(f"Adapter({self.model_class!r}).shared={self.shared} must name module units listed in "
                             f"modules={self.modules}.")
        for unit, inputs in self.composed:
            unknown = [n for n in (unit, *inputs) if n not in self.modules]
            if unknown or not inputs or unit in inputs:
                raise ValueError(f"Adapter({self.model_class!r}).composed entry ({unit!r}, {inputs!r}) must name a "
                                 f"module unit and the other units that make its input, all listed in modules="
                                 f"{self.modules}; not in modules: {unknown}.")

    def blocks(self, transformer: nn.Module) -> list[tuple[int, nn.Module]]:
        """All blocks in execution order as (list index, block)."""
        found = []
        for list_index, spec in enumerate(self.block_lists):
            for block in block_list(transformer, spec.path):
                found.append((list_index, block))
        return found

    def module_names(self, block: nn.Module) -> tuple[str, ...]:
        """Inner modules of `block` that exist (dotted paths allowed, e.g. HiDream's "block.attn1")."""
        names = self.modules or CONVENTIONAL_MODULES
        return tuple(n for n in names if isinstance(submodule(block, n), nn.Module))


def submodule(root: nn.Module, path: str) -> Any:
    """`root.a.b` for path "a.b", or None."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def composed_indices(adapter: Adapter, units: Sequence[str]) -> list[tuple[int, tuple[int, ...]]]:
    """`adapter.composed` over MODULE unit names ("b3.proj_out"): (unit index, its input units' indices) for every
    block that has the unit and all of its inputs."""
    index = {u: i for i, u in enumerate(units)}
    pairs = []
    for name, i in index.items():
        block, _, module = name.partition(".")
        for unit, inputs in adapter.composed:
            if module == unit and all(f"{block}.{m}" in index for m in inputs):
                pairs.append((i, tuple(index[f"{block}.{m}"] for m in inputs)))
    return pairs


def reuse_composed_inputs(row: str, composed: Sequence[tuple[int, tuple[int, ...]]],
                          servable: Callable[[int], bool] = lambda unit: True) -> str:
    """A MODULE action row in which the inputs of every reused / forecast composed unit are reused: their outputs
    are not used, so computing (or forecasting) them would be wasted. What the engine executes for such a row.

    servable(i): whether input unit i has an output cached to reuse; an input without one keeps its action. The
    module executor passes its branch's cache (`ModuleExecutor.feasible`); plans and searches, which shape rows
    before any run, take every input as servable."""
    chars = list(row)
    for unit, inputs in composed:
        if any(i >= len(chars) for i in (unit, *inputs)):
            continue  # a row of another layout: the plan's own checks report it
        if chars[unit] != "C":
            for i in inputs:
                if servable(i):
                    chars[i] = "R"
    return "".join(chars)


_REGISTRY: dict[str, Adapter] = {}


def adapter_registry() -> dict[str, Adapter]:
    """The adapters registered so far, by class name (`dcache.model.families.registered_adapters` loads the built-in
    families first)."""
    return dict(_REGISTRY)


_LOADING_BUILTINS = False  # set while dcache.model.families imports the built-in family files


@contextmanager
def loading_builtins() -> Iterator[None]:
    """While the built-in families register: a class a user registered before the first lookup keeps the user's
    adapter (the documented order: users first), instead of the built-in row raising "already registered"."""
    global _LOADING_BUILTINS
    _LOADING_BUILTINS = True
    try:
        yield
    finally:
        _LOADING_BUILTINS = False


def register_adapter(adapter: Adapter, *, overwrite: bool = False) -> Adapter:
    """Register the adapter for `adapter.model_class`. Users call this for their own DiTs."""
    if adapter.model_class in _REGISTRY and _LOADING_BUILTINS and not overwrite:
        return _REGISTRY[adapter.model_class]  # the user's, registered before the built-in families loaded
    if adapter.model_class in _REGISTRY and not overwrite:
        raise ValueError(f"An adapter for {adapter.model_class} is already registered; pass overwrite=True to "
                         f"replace it.")
    _REGISTRY[adapter.model_class] = adapter
    return adapter


class UnsupportedModelError(TypeError):
    def __init__(self, transformer: nn.Module, reason: str = ""):
        name = type(transformer).__name__
        lists = [n for n, c in transformer.named_children() if isinstance(c, nn.ModuleList)]
        super().__init__(
            f"dcache cannot cache {name}: {reason or 'it does not know where its transformer blocks are'}. "
            f"Its ModuleLists are {lists or 'none'}. If it is a diffusion transformer whose blocks dcache may cache, "
            f"register an adapter before calling dcache.apply:\n"
            f"    from dcache.model.adapters import Adapter, BlockList, register_adapter\n"
            f"    register_adapter(Adapter('{name}', block_lists=(BlockList('<list attribute>', "
            f"outputs=('encoder_hidden_states', 'hidden_states')),)))\n"
            f"where `outputs` names what each block returns, in order."
        )


def block_list(root: nn.Module, path: str) -> nn.ModuleList:
    """The ModuleList at the dotted attribute `path` of `root`; UnsupportedModelError if there is none."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if not isinstance(obj, nn.ModuleList):
        raise UnsupportedModelError(root, f"adapter path {path!r} is not a ModuleList")
    return obj


__all__ = ["HIDDEN", "ENCODER", "BlockList", "Adapter", "register_adapter", "adapter_registry", "block_list",
           "UnsupportedModelError", "composed_indices", "reuse_composed_inputs"]
