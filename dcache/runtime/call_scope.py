"""Call scope: cache the whole transformer map x -> v instead of the block stack (EasyCache's own formulation).

With scope="blocks" (the default) a reused call still runs everything outside the blocks: patch / time / text
embedders, RoPE, the output norm and projection. On a small model at batch 1 that work is several percent of a call,
so no block cache reaches its ideal speed-up there (BENCHMARKS.md, "cache-path overhead"). With scope="call" the
engine decides before the transformer runs and, on REUSE / FORECAST, returns without running it:

    v_t = x_t + Delta,   Delta = v_c - x_c at the branch's last computed call c      (EasyCache, arXiv 2507.02860)
    (FORECAST: Delta is the Taylor forecast of the Delta history over the steps since c)

x is the call's latent input (`hidden_states`), v the output sample; both must have one shape (an output with
learned variance or an input with extra conditioning channels has none). The schedule's decision is the stack
unit's ("stack"), so any stack schedule that decides without running a block works unchanged, and plans replay in
either scope. Signals are measured on x and v instead of the stack's hidden states. The blocks are not hooked (a
computed call runs the bare model), and the FLOPs behind the compute ratio are the whole call's, counted once per
input shape.

Not exact with respect to scope="blocks": the output head (AdaLN norm with this step's timestep, projection) is
reused with the rest instead of being recomputed on the reused hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..compat.torch import tree_flatten, tree_unflatten
from .signal_providers import call_scope_names, signal_name

if TYPE_CHECKING:
    from ..schedule import Schedule

SCOPES = ("blocks", "call")
CALL_UNIT = "call"  # the branch's cache key of the Delta history


def check_scope(scope: str, schedule: Schedule, granularity: str) -> bool:
    """True for call scope; raise a teaching error when the schedule cannot decide before the call runs."""
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not one of {SCOPES}: 'blocks' caches the block stack (exact head), "
                         f"'call' the whole transformer map x -> v (also skips embedders and head).")
    if scope == "blocks":
        if getattr(schedule, "cfg_difference", False):
            raise ValueError("cfg_difference serves the unconditional call as the conditional one minus a forecast "
                             "of the CFG difference of the whole transformer output, so it needs scope='call'; "
                             "pass scope='call', or cfg_difference=False to cache each branch on its own.")
        return False
    name = getattr(schedule, "name", type(schedule).__name__)
    problems = []
    if granularity != "stack":
        problems.append(f"its granularity is {granularity!r} (call scope replaces the whole stack: 'stack' only)")
    if schedule.probe_blocks or schedule.tail_blocks:
        problems.append(f"it runs probe/tail blocks every call (probe_blocks={schedule.probe_blocks}, "
                        f"tail_blocks={schedule.tail_blocks}) and decides from their output")
    # a call-scope decision can have the signals measured from the call's arguments, on its latent input, or after a
    # computed call on x and v = the call's output (dcache.runtime.signal_providers.call_scope_names)
    inside = sorted({signal_name(s) for s in schedule.signals} - call_scope_names())
    if inside:
        problems.append(f"it reads signals measured inside the call ({', '.join(inside)})")
    if schedule.forecaster is not None and not getattr(schedule.forecaster, "any_history", False):
        problems.append("its learned forecaster predicts per-list block residuals, not the call's Delta")
    if problems:
        raise ValueError(f"scope='call' needs a schedule that decides before the transformer runs, but "
                         f"{name!r}: " + "; ".join(problems) + ". Use scope='blocks' with it, or a method that "
                         "decides ahead (magcache, easycache, seacache, fixed_interval, taylorseer with "
                         "granularity='stack', or a stack plan such as lemica's or ecad's).")
    return True


@dataclass
class OutputLayout:
    """How a transformer call's return value is built around its sample (pytree spec + the sample's leaf)."""

    spec: Any
    leaves: list  # the computed call's leaves; the sample's slot is replaced on reuse
    index: int  # leaf index of the sample

    def build(self, sample: torch.Tensor) -> Any:
        if self.spec is tuple:  # `return_dict=False`: (sample,), the pipelines' usual call
            return (sample,)
        leaves = list(self.leaves)
        leaves[self.index] = sample
        return tree_unflatten(leaves, self.spec)


def latent_input(arguments: dict[str, Any], args: tuple) -> torch.Tensor | None:
    x = arguments.get("hidden_states", args[0] if args else None)
    return x if isinstance(x, torch.Tensor) else None


def output_layout(out: Any, x: torch.Tensor, model_class: str) -> tuple[OutputLayout, torch.Tensor]:
    """The call's sample (the one tensor leaf; it must have x's shape) and the layout to rebuild the output."""
    if type(out) is tuple and len(out) == 1 and isinstance(out[0], torch.Tensor) and out[0].shape == x.shape:
        return _SAMPLE_TUPLE, out[0]  # the common case without a pytree walk
    leaves, spec = tree_flatten(out)
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if len(tensors) != 1 or leaves[tensors[0]].shape != x.shape:
        shapes = [tuple(leaves[i].shape) for i in tensors]
        raise ValueError(f"scope='call' reuses Delta = v - x, so {model_class} must return one tensor shaped like "
                         f"its latent input {tuple(x.shape)}; this call returned tensors of shapes {shapes} (learned "
                         f"variance, extra outputs or conditioning channels concatenated to the input). Use "
                         f"scope='blocks' for this model.")
    index = tensors[0]
    layout = OutputLayout(spec, [None if i == index else leaf for i, leaf in enumerate(leaves)], index)
    return layout, leaves[index]


_SAMPLE_TUPLE = OutputLayout(tuple, [None], 0)  # `(sample,)`
