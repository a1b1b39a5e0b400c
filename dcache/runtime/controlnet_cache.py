"""A ControlNet model's whole-call cache: `dcache.apply(pipe, method, controlnet=...)` (options:
dcache.api.controlnet).

The unit is one ControlNet call, c = ControlNet(x_t, control, t, text; s). It returns per-block samples that the
transformer adds to its stream between its blocks (`h = block_i(h) + c_i`):
    Flux:       (controlnet_block_samples, controlnet_single_block_samples), tuples of [B, L_img, D] (or None)
    SD3, Sana:  (block_samples,), one [B, L_img, D] per ControlNet block
    Qwen-Image: (block_samples), one [B, L_img, D] per ControlNet block;   Z-Image: {layer index: [B, L, D]}
each made inside the model as c_i = s * P_i(h_i): P_i a (zero-initialised) projection of the ControlNet's i-th block
output h_i, s the call's `conditioning_scale`.

What is cached, per branch: the samples themselves (the output pytree's spec and its tensor leaves, held by
reference: the pipelines only read them). There is no residual form: the samples do not live in the ControlNet's
input space (x_t is [B, L, C_in] latents, c_i has the hidden width D), so the call scope's x + Delta means nothing
here. The change c(t_j) - c(t_k) between the served step j and the branch's last computed step k is what a reuse
leaves out: REUSE serves c(t_k), whose error the transformer adds to its stream unchanged (its own cached stack
residual keeps every addition out, dcache/runtime/executors/stack.py, so a transformer call reused at the same step
gets x + R_k + sum_i c_i(t_k): exactly the stack output delta of step k, ControlNet included). FORECAST serves the
Taylor forecast of the sample history (dcache.runtime.cache_state.UnitHistory); at order 1
    c(t_j) ~ c(t_k) + (j - k) (c(t_k) - c(t_k')) / (k - k'),      k' the computed step before k.

The conditioning scale: pipelines switch the ControlNet on and off with control_guidance_start / _end, so
s_j = scale * keep_j with keep_j in {0, 1}. The samples are linear in s, so a reused call serves c(t_k) * s_j / s_k;
a branch cached at s_k = 0 cannot be rescaled and computes; a scale that is not a number (Cosmos' per-block
lists) must equal the cached call's, else the call computes. A scale change on a computed call starts the branch's
history over (a Taylor table never mixes scales).

Steps come from the transformer's engine (the pipeline's scheduler, hooked by it): a ControlNet call outside a
generation the engine tracks runs uncached and is not recorded. Branches: the ControlNet calls of one step in their
order (call0, call1, ...): one per step in Flux / Qwen-Image (shared by both CFG branches of the transformer), one
batched call in SD3 / Sana, a cond and an uncond call in Cosmos. The first call of every branch computes; a new
generation starts with an empty cache, and the cache of a branch is dropped after its call at the last step.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import ModelHook
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..actions import Action
from .flops import FlopBook
from ..generations.records import CallRecord, GenerationRecord
from .hooks import install_outer_hook, remove_outer_hook, traced_twins
from ..memory.report import MemoryReport
from .cache_state import UnitHistory
from ..generations.stats import Stats, stats_from_record
from .block_io import bind_arguments

COMPUTE, REUSE, FORECAST = Action.COMPUTE.value, Action.REUSE.value, Action.FORECAST.value
UNIT = "controlnet"  # the FLOP book's unit name


@dataclass
class CachedSamples:
    """One branch's cache: the samples of its last computed call(s) and what they were computed with."""

    history: UnitHistory  # the tensor leaves (order 0: the samples; order k: their Taylor table)
    spec: Any  # the output's pytree spec
    leaves: list  # the computed call's leaves, None where a cached tensor goes
    scale: Any  # conditioning_scale of the computed calls in the history
    signature: tuple  # shapes of the call's tensor arguments (a reused call must match)
    last_compute_step: int | None = None


@dataclass
class PendingCall:
    """A ControlNet call being computed: where it belongs and what its cache entry needs."""

    step: int
    branch: str
    scale: Any
    signature: tuple
    counter: Any = None  # the FlopCounterMode open around its forward (eager, first call of a shape)


class ControlNetHook(ModelHook):
    """The diffusers hook on a ControlNet model: `ControlNetCache.enter` serves the call or lets it run, `exit`
    stores what it returned. This frame stays eager under torch.compile and calls the bookkeeping's `_traced` twins
    (behind torch.compiler.disable) there, so that only the model's own forward is traced."""

    def __init__(self, cache: "ControlNetCache"):
        super().__init__()
        self.cache = cache

    @torch.compiler.disable(recursive=False)
    def new_forward(self, module: nn.Module, *args, **kwargs):
        cache, forward = self.cache, self.fn_ref.original_forward
        compiling = get_eval_frame_callback() is not None
        if compiling:
            enter, exit_, abort = cache.enter_traced, cache.exit_traced, cache.abort_traced
        else:
            enter, exit_, abort = cache.enter, cache.exit, cache.abort
        run, state = enter(forward, args, kwargs, compiling)
        if not run:
            return state
        try:
            out = forward(*args, **kwargs)
        except BaseException:
            abort(state)
            raise
        return exit_(state, out)


class ControlNetCache:
    """One ControlNet model (or one net of a multi-ControlNet wrapper) and its cache.

    decider: what the call does at a step (dcache.api.controlnet: FollowTransformer or OwnSchedule); engine: the
    transformer's engine, whose generation record gives the step."""

    def __init__(self, name: str, module: nn.Module, decider: Any, engine: Any, count_flops: bool = True):
        self.name, self.module, self.decider, self.engine = name, module, decider, engine
        self.flops = FlopBook.for_model(module, (UNIT,), count_flops)
        self.record: GenerationRecord | None = None  # this ControlNet's calls in the last generation
        self.generations = 0
        self.branches: dict[str, CachedSamples] = {}
        self.peak_cache_bytes = 0
        self.memory_at_end: dict[str, dict[str, int]] = {}  # {branch: {"controlnet": bytes}} of the last generation
        self._dropped: dict[str, dict[str, int]] = {}  # the same for branches this generation already let go
        self._leader_record: GenerationRecord | None = None  # the transformer engine's record it belongs to
        self._step_calls: tuple[int, int] = (-1, 0)  # (step, ControlNet calls seen in it)
        self._removed = False
        self._install()

    # ------------------------------------------------------------------------------------------------ lifetime
    def _install(self) -> None:
        self._installed_forward = install_outer_hook(self.module, ControlNetHook(self))  # under accelerate's hook
        self.module._dcache_controlnet = self

    def remove(self) -> None:
        """Unhook: the model's forward is its own again (bit-identical outputs); stats stay readable."""
        if self._removed:
            return
        self._finish_generation()
        remove_outer_hook(self.module, self._installed_forward, recurse=False)
        if getattr(self.module, "_dcache_controlnet", None) is self:
            del self.module._dcache_controlnet
        self._removed = True

    # ------------------------------------------------------------------------------------------------ generations
    def _start_generation(self, leader: GenerationRecord) -> None:
        self._finish_generation()
        self._leader_record = leader
        self.record = GenerationRecord(num_steps=leader.num_steps, timesteps=leader.timesteps)
        self.generations += 1
        self._step_calls = (-1, 0)
        self._dropped = {}
        self.decider.start(leader, type(self.module).__name__)

    def _finish_generation(self) -> None:
        leader = self._leader_record
        if leader is None:
            return
        self._leader_record = None
        self.decider.end(leader.num_steps is not None and leader.step >= leader.num_steps)
        if self.branches or self._dropped:  # handle.memory(): where the bytes were
            self.peak_cache_bytes = max(self.peak_cache_bytes, self._cache_bytes())
            self.memory_at_end = self._breakdown()
        self.branches = {}
        if self.record is not None:
            self.record.finished = True

    def _cache_bytes(self) -> int:
        return sum(b.history.nbytes for b in self.branches.values())

    def _breakdown(self) -> dict[str, dict[str, int]]:
        return {**self._dropped,
                **{branch: {"controlnet": cached.history.nbytes} for branch, cached in self.branches.items()}}

    def memory(self) -> MemoryReport:
        """This ControlNet's cached samples: peak and live bytes, per call of the step (the running generation's
        breakdown if one runs, else the last one's), as handle.memory() reports a transformer's."""
        live = self._cache_bytes()
        by_branch = self._breakdown() if self._leader_record is not None else dict(self.memory_at_end)
        return MemoryReport(peak_bytes=max(self.peak_cache_bytes, live), live_bytes=live, by_branch=by_branch)

    # ------------------------------------------------------------------------------------------------ calls
    def _place(self) -> tuple[int, str] | None:
        """(step, branch) of this call, or None outside a generation the transformer's engine tracks through the
        scheduler (a call without one runs uncached: its step is unknown until the transformer runs)."""
        tracker = self.engine.tracker
        leader = tracker.record
        if leader is None or leader.finished or not tracker.scheduler_driven:
            return None
        if leader is not self._leader_record:
            self._start_generation(leader)
        step = leader.step
        seen_step, calls = self._step_calls
        calls = calls + 1 if seen_step == step else 1
        self._step_calls = (step, calls)
        return step, f"call{calls - 1}"

    def enter(self, forward: Any, args: tuple, kwargs: dict, compiling: bool = False) -> tuple[bool, Any]:
        """Before the ControlNet runs: (False, served output) on REUSE / FORECAST; (True, PendingCall or None) when
        it runs (None: outside a generation, uncached and unrecorded)."""
        place = self._place()
        if place is None:
            return True, None
        step, branch = place
        signature = tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        arguments = kwargs if "conditioning_scale" in kwargs or not args else bind_arguments(self.module, args,
                                                                                               kwargs)
        scale = arguments.get("conditioning_scale")
        cached = self.branches.get(branch)
        action = self.decider.decide(step, branch, self._leader_record, len(self.record.calls),
                                     cached.last_compute_step if cached is not None else None)
        factor = _rescale(cached.scale, scale) if cached is not None else None
        if action != COMPUTE and (cached is None or cached.signature != signature or factor is None):
            action = COMPUTE  # nothing servable: no samples yet, other shapes, or a scale it cannot rescale to
        if action == COMPUTE:
            pending = PendingCall(step, branch, scale, signature)
            if compiling:  # a dispatch mode around the traced forward would stop dynamo: count on fake tensors
                self.flops.count(UNIT, signature, forward, args, kwargs)
            else:
                pending.counter = self.flops.start(UNIT, signature)
            return True, pending
        out = self._serve(cached, action, step, factor)
        self._finish_call(step, branch, action, signature)
        return False, out

    def exit(self, pending: PendingCall | None, out: Any) -> Any:
        """The ControlNet ran: cache its samples (for the branch's next reused calls) and record the call."""
        if pending is None:
            return out
        self.flops.stop(pending.counter, UNIT, pending.signature)
        self._store(pending.branch, pending.step, out, pending.scale, pending.signature)
        self._finish_call(pending.step, pending.branch, COMPUTE, pending.signature)
        return out

    def abort(self, pending: PendingCall | None) -> None:
        """The forward raised: close its FLOP counter; the call is not recorded."""
        if pending is not None:
            self.flops.stop(pending.counter, None, None)

    def _finish_call(self, step: int, branch: str, action: str, signature: tuple) -> None:
        cost = self.flops.cost(UNIT, signature) or 0.0
        computed = cost if action == COMPUTE else 0.0
        self.record.calls.append(CallRecord(step, branch, action, {"flops_total": cost, "flops_computed": computed}))
        leader = self._leader_record
        if leader.num_steps is not None and step >= leader.num_steps - 1:
            dropped = self.branches.pop(branch, None)  # its last call of the generation: nothing reads it again
            if dropped is not None:  # handle.memory() still reports where the generation's bytes were
                self._dropped[branch] = {"controlnet": dropped.history.nbytes}

    def _store(self, branch: str, step: int, out: Any, scale: Any, signature: tuple) -> None:
        if not self.decider.may_reuse(branch):
            return
        leaves, spec = tree_flatten(out)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        kept = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        cached = self.branches.get(branch)
        if cached is None or cached.spec != spec or cached.signature != signature or not _same(cached.scale, scale):
            cached = self.branches[branch] = CachedSamples(UnitHistory(self.decider.forecast_order), spec, kept,
                                                           scale, signature)
        cached.history.update(tensors, step)
        cached.leaves, cached.last_compute_step = kept, step
        self.peak_cache_bytes = max(self.peak_cache_bytes, self._cache_bytes())

    @staticmethod
    def _serve(cached: CachedSamples, action: str, step: int, factor: float) -> Any:
        tensors = iter(cached.history.read(action == FORECAST, step))
        leaves = [next(tensors) if leaf is None else leaf for leaf in cached.leaves]
        if factor != 1.0:
            leaves = [leaf * factor if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return tree_unflatten(leaves, cached.spec)

    # ------------------------------------------------------------------------------------------------ reports
    def stats(self) -> Stats:
        """This ControlNet's calls in the last generation: one unit per call (computed / reused / forecast) and its
        FLOPs, the whole call's (counted once per input shape)."""
        rec = self.record if self.record is not None and self.record.calls else None
        return stats_from_record(rec, method=self.decider.label, granularity="call", generations=self.generations,
                                 units_per_call=1, blocks_per_call=0,
                                 cache_bytes=max(self.peak_cache_bytes, self._cache_bytes()))


def _same(a: Any, b: Any) -> bool:
    """Two conditioning scales are the same (numbers, lists of numbers, None); tensors only when the same object."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _rescale(cached: Any, scale: Any) -> float | None:
    """The factor s_j / s_k that turns samples computed at scale s_k into those at s_j (samples are linear in the
    scale); None when there is none (s_k = 0, or scales that are not numbers and differ)."""
    if _same(cached, scale):
        return 1.0
    real = (numbers.Real,)
    if isinstance(cached, real) and isinstance(scale, real) and not isinstance(cached, bool) and cached != 0:
        return float(scale) / float(cached)
    return None


# The entry points behind torch.compiler.disable, for hook frames that run while torch.compile traces the ControlNet
# (dcache.runtime.hooks): `enter_traced`, `exit_traced`, `abort_traced`.
traced_twins(ControlNetCache, ("enter", "exit", "abort"))
