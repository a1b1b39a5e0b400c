"""The diffusers `ModelHook`s dcache registers (name "dcache", removable, signature-preserving).

  * `TransformerHook` on the transformer: opens and closes every call (Engine.begin_call / end_call) and, in call
    scope, lets the call executor serve the whole call from the cache;
  * `UnitHook` on every block and, at module granularity, every inner module: asks its executor whether the unit
    runs (enter), runs the original forward, and hands the output back (exit).

Under torch.compile (docs/architecture.md, "torch.compile"):
  * the transformer's bookkeeping runs in `transformer_call`, put in front of the diffusers hook chain as the
    module's `forward` and skipped by dynamo (`torch.compiler.disable(recursive=False)`): it is the first frame under
    the module's `__call__`, so the chain below it (the model's own forward) is traced as one frame, with no break
    above it. The functions it calls are the plain methods in eager mode and their `_traced` twins (behind
    `torch.compiler.disable`) while dynamo runs, so that the bookkeeping is never traced itself;
  * a block hook traced by dynamo takes the executor's `traced` path when the call was decided before it started
    (a schedule that decides from the step alone, `Engine.step_decided`): plain tensor work that dynamo captures in
    the model's graph, specialised on the call's action row. Otherwise it calls `eager_forward`, skipped by dynamo
    (one graph break per block), whose enter and exit run eagerly around the traced block forward.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from .call_state import BlockSlot, CallDecided
from ..compat.accelerate import has_offload_hook, set_wrapped_forward, wrapped_forward
from ..compat.diffusers import ContextHook, diffusers_cache, original_forward
from ..compat.torch import eval_frame_callback

if TYPE_CHECKING:  # the engine builds its transformer hook
    from .engine import Engine

HOOK_NAME = "dcache"
# Engine bookkeeping never runs inside a compiled graph (it branches on Python state every step).
eager = torch.compiler.disable


def traced_twins(cls: type, names: tuple[str, ...]) -> None:
    """Give `cls` a `<name>_traced` (behind torch.compiler.disable) for each method `name` it defines or inherits."""
    for name in names:
        setattr(cls, f"{name}_traced", eager(getattr(cls, name)))


# What a unit's traced path returns when its call was not decided before it started (it then runs eagerly).
NOT_DECIDED = object()


class Entries(NamedTuple):
    """A unit hook's three entry points: enter(key, forward, args, kwargs, compiling) -> (run, state or output),
    exit(key, state, out) -> out, abort(state) (the forward raised)."""

    enter: Callable[..., tuple[bool, Any]]
    exit: Callable[..., Any]
    abort: Callable[..., None]


class TransformerHook(ContextHook):
    """The transformer's hook: hands diffusers' `cache_context` name to the engine's tracker and holds the chain
    below dcache's `transformer_call` (`chain`: the diffusers hook chain ending in the model's own forward)."""

    def __init__(self, engine: Engine):
        tracker = engine.tracker
        super().__init__(lambda name: setattr(tracker, "context_name", name))
        self.engine = engine
        self.chain: Callable | None = None


@torch.compiler.disable(recursive=False)  # this frame stays eager; `hook.chain` below it is traced whole
def transformer_call(hook: TransformerHook, *args, **kwargs):
    """One transformer call. With per-sample decisions (dcache.runtime.lanes) each row of a batched call decides in its
    own generation state, and the rows that decided alike run together; otherwise the whole batch is one call
    (`run_call`)."""
    engine = hook.engine
    compiling = eval_frame_callback() is not None
    lanes = engine.lanes
    # eager: under compile, rows() may warn that the batch decides as one, and dynamo cannot trace warnings.warn
    rows = eager(lanes.rows)(args, kwargs, compiling) if lanes is not None and not lanes.swapped else 0
    if rows:
        return lanes.run(rows, functools.partial(run_opened, hook, False), args, kwargs)
    return run_call(hook, compiling, *args, **kwargs)


@torch.compiler.disable(recursive=False)  # as transformer_call: eager itself, `hook.chain` below it traced
def run_call(hook: TransformerHook, compiling: bool, *args, **kwargs):
    """Open the call, let the call executor serve it (call scope), run the chain, close it."""
    engine = hook.engine
    (engine.begin_call_traced if compiling else engine.begin_call)(args, kwargs, compiling)
    return run_opened(hook, compiling, *args, **kwargs)


@torch.compiler.disable(recursive=False)
def run_opened(hook: TransformerHook, compiling: bool, *args, **kwargs):
    """Run a call `Engine.begin_call` opened (per-sample lanes open their rows' calls themselves, dcache.runtime.lanes)
    and close it. A call opened only to decide (CallDecided at its decision point) stays open for its caller."""
    engine = hook.engine
    if compiling:
        end, abort = engine.end_call_traced, engine.abort_traced
    else:  # plain eager
        end, abort = engine.end_call, engine.abort
    try:
        whole = engine.call_executor  # dcache.runtime.executors.call: the whole call may come from the cache
        if whole is not None:
            enter = whole.call_enter_traced if compiling else whole.call_enter
            run, out = enter(hook.chain, args, kwargs, compiling)
            if not run:
                if compiling:  # compiled here: x + Delta is a graph of its own (executors.call.serve_call)
                    out = out()
                end()
                return out
        out = hook.chain(*args, **kwargs)
        if whole is not None:
            out = (whole.call_exit_traced if compiling else whole.call_exit)(out)
    except CallDecided:
        raise
    except BaseException:
        abort(None, True)
        raise
    end()
    return out


class UnitHook(ModelHook):
    """A block or an inner module: `key` is its BlockSlot or its module unit index. `traced_path`: the executor's
    traceable path for calls decided before they started (None: the unit always takes `eager_forward`)."""

    def __init__(self, key: BlockSlot | int, entries: Entries, traced: Entries,
                 traced_path: Callable[[BlockSlot | int, Callable, tuple, dict], Any] | None = None):
        super().__init__()
        self.key, self.entries, self.traced = key, entries, traced
        self.traced_path = traced_path

    def new_forward(self, module: nn.Module, *args, **kwargs):
        # is_compiling() is a constant True while dynamo traces and False in eager: the check costs nothing there
        if torch.compiler.is_compiling() and self.traced_path is not None:
            out = self.traced_path(self.key, original_forward(self), args, kwargs)
            if out is not NOT_DECIDED:
                return out
        return self.eager_forward(module, *args, **kwargs)

    @torch.compiler.disable(recursive=False)  # this frame stays eager; the original forward below is traced
    def eager_forward(self, module: nn.Module, *args, **kwargs):
        # Inline on purpose: a helper frame here would be traced by dynamo (only this frame is skipped).
        compiling = eval_frame_callback() is not None
        forward = self.fn_ref.original_forward  # dcache.compat.diffusers.original_forward, inline (see above)
        enter, exit_, abort = self.traced if compiling else self.entries
        run, state = enter(self.key, forward, args, kwargs, compiling)
        if not run:
            return state
        try:
            out = forward(*args, **kwargs)
        except BaseException:
            abort(state)
            raise
        return exit_(self.key, state, out)


def other_cache(transformer: nn.Module) -> str | None:
    """A description of a feature cache other than dcache's on `transformer` (diffusers' enable_cache / apply_*
    hooks on it or its submodules), or None. Two caches on one transformer would each skip work on the other's
    outputs; dcache's stats would count its own calls as computed while the image is the other cache's."""
    return diffusers_cache(transformer)


def refuse_other_cache(transformer: nn.Module, when: str) -> None:
    """Raise when another feature cache is on `transformer` (see other_cache)."""
    found = other_cache(transformer)
    if found is None:
        return
    raise RuntimeError(
        f"{type(transformer).__name__} already has a feature cache: {found}, {when}. Two caches on one transformer "
        f"serve each other's outputs (the image would be the other cache's, while dcache's stats count every call "
        f"as computed). Use one: call transformer.disable_cache() (or remove the other library's cache) before "
        f"dcache.apply, or handle.remove() before enable_cache.")


def install_outer_hook(module: nn.Module, hook: ModelHook, call: Callable | None = None) -> Callable:
    """Register `hook` as dcache's hook on `module`; returns the forward it installed (for `remove_outer_hook`).
    accelerate's offload hook (enable_model_cpu_offload) wraps `forward` and restores the forward it wrapped when it
    is removed after every pipeline call: dcache goes *under* it, as the forward accelerate calls
    (dcache.compat.accelerate).
    call: a frame put in front of the hook chain, `call(hook, *args, **kwargs)` with the chain as `hook.chain`
    (`transformer_call`); removing the hook removes it with the chain (the registry restores the forward it saw)."""
    accelerate_forward = module.forward if has_offload_hook(module) else None
    if accelerate_forward is not None:
        module.forward = wrapped_forward(module)
    own_forward = module.forward
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
    if call is not None:
        hook.chain = module.forward
        # update_wrapper: inspect.signature follows __wrapped__ to the model's own forward, as the chain's does
        module.forward = functools.update_wrapper(functools.partial(call, hook), own_forward)
    installed = module.forward
    if accelerate_forward is not None:
        set_wrapped_forward(module, module.forward)
        module.forward = accelerate_forward
    return installed


def remove_outer_hook(module: nn.Module, installed: Callable, recurse: bool) -> None:
    """Remove dcache's hook from `module` (recurse: from its submodules too); a wrapper put around dcache's forward
    since (accelerate) is kept."""
    outer = module.forward
    HookRegistry.check_if_exists_or_initialize(module).remove_hook(HOOK_NAME, recurse=recurse)
    restored = module.forward
    if outer is not installed:  # someone (accelerate) wrapped dcache: keep their wrapper
        module.forward = outer
    if wrapped_forward(module) is installed:
        set_wrapped_forward(module, restored)


_TIMESTEP_NAMES = ("timestep", "timesteps", "t", "time_step", "sigma", "sigmas")


def timestep_slot(transformer: nn.Module) -> tuple[str, int | None]:
    """(name, positional index) of the transformer forward's timestep argument, for transformer-only tracking."""
    params = [p for p in inspect.signature(transformer.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in _TIMESTEP_NAMES:
        for i, p in enumerate(params):
            if p.name == name:
                return name, i if p.kind != p.KEYWORD_ONLY else None
    return "timestep", None
