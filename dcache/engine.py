"""The hook engine: executes a schedule's actions on a diffusers transformer, one call at a time.

Hooks (diffusers `HookRegistry`, name "dcache", removable, signature-preserving):
  * transformer: opens/closes a call (step, branch), listens to diffusers' `cache_context` names;
  * every block: COMPUTE / REUSE / FORECAST of the stack segment or of the block itself;
  * inner modules (MODULE granularity only): COMPUTE / REUSE / FORECAST of the module output.
The scheduler *instance* is wrapped (set_timesteps: new generation; step: next step index).

Stack reuse without rewriting any forward: the middle blocks of each block list form a segment; on REUSE the
first middle block of a list returns `input + cached segment residual` and the other middle blocks pass their
input through untouched (no compute), probe (front) and tail (back) blocks always run.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import StateManager
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from dcache.kernels import residual_capture

from .actions import POST_SIGNALS, PRE_SIGNALS, Action, Granularity, Signal
from .adapters import HIDDEN, Adapter, BlockList, UnsupportedModelError, composed_indices, submodule
from .call_scope import CALL_UNIT, check_scope, latent_input, output_layout
from .cache_ops import VALIDATED, ops_for
from .flops import FlopBook
from .generation import CallRecord, GenerationRecord, StepTracker, calling_pipeline
from .memo import install_memos
from .memory import branch_breakdown
from .parallel import sync_signals
from . import spectral
from .schedule import CallContext, GenerationInfo, Schedule, normalize_actions
from .state import BranchState, UnitHistory
from .streams import StreamSlots, bind_arguments

HOOK_NAME = "dcache"
_EPS = 1e-12
# Action letters as plain strings: the hot path compares them per block, and Enum.value is a property lookup.
_COMPUTE, _REUSE, _FORECAST = Action.COMPUTE.value, Action.REUSE.value, Action.FORECAST.value
_SIGNALS = {s.value: s for s in Signal}  # name -> Signal without Enum's by-value lookup
# Engine bookkeeping never runs inside a compiled graph (it branches on Python state every step).
_eager = torch.compiler.disable


@dataclass
class BlockSlot:
    index: int  # global execution order
    list_index: int
    block: nn.Module
    spec: BlockList
    slots: StreamSlots
    role: str = "middle"  # "probe" | "middle" | "tail" (STACK granularity)
    segment_first: bool = False
    segment_last: bool = False
    modules: tuple[str, ...] = ()
    exit_work: bool = True  # block_exit has more to do than FLOP accounting (set by Engine.__init__)


@dataclass
class CallState:
    record: GenerationRecord
    step: int
    branch: str
    call_index: int
    timestep: Any
    bstate: BranchState
    actions: str | None = None
    pre: dict[Signal, torch.Tensor] = field(default_factory=dict)
    stack_input: torch.Tensor | None = None
    stack_output: torch.Tensor | None = None
    # STACK: the open run of middle segments (start list, its hidden and encoder inputs) and a finished run whose
    # store waits for the next list's first block (which may continue it, see Engine._segment_start).
    run: tuple[int, torch.Tensor, torch.Tensor | None] | None = None
    finished_run: tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None
    probe_residual: torch.Tensor | None = None
    # STACK, computed call: what the transformer added *between* the open run's middle blocks (ControlNet / VACE
    # residuals: the next block's input is not the tensor the previous block returned). Kept out of the cached
    # residual, because on a reused call the forward loop adds this call's own samples after every pass-through
    # block again. run_last_out: (hidden, encoder) the previous middle block returned.
    run_last_out: tuple[Any, Any] | None = None
    run_between: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    # a segment of a list whose stream is edited in place (BlockList.adds_in_place): its blocks' own residuals,
    # summed as each block returns (run_block_in: the running block's inputs)
    run_own: list[torch.Tensor | None] | None = None
    run_block_in: tuple[Any, Any] | None = None
    counter: FlopCounterMode | None = None  # call scope: open around the first computed call of a shape
    module_calls: dict[int, int] = field(default_factory=dict)  # shared module unit -> its calls so far this call
    signal_values: dict[str, float] = field(default_factory=dict)
    flops_total: float = 0.0
    flops_computed: float = 0.0


class Engine:
    def __init__(self, transformer: nn.Module, adapter: Adapter, schedule: Schedule, *,
                 pipeline: Any = None, num_steps: int | None = None,
                 count_flops: bool = True, memoize: bool = True, scope: str = "blocks", leader: "Engine | None" = None,
                 cache_codec: Any = None):
        """leader: for the second expert of a two-transformer pipeline (Wan 2.2's transformer_2): the engine of the
        pipeline's first transformer, which hooks the scheduler and hands every generation and step on to this one
        (one scheduler, one wrapper; each expert keeps its own generation record, caches and schedule state).
        cache_codec: a dcache.cache_codec.CacheCodec storing cached unit tensors in a low dtype (None: as computed)."""
        self.transformer = transformer
        self.cache_codec = cache_codec
        self.leader = leader
        self.followers: list[Engine] = []
        if leader is not None:
            leader.followers.append(self)
        self.adapter = adapter
        self.schedule = schedule
        self.pipeline = pipeline
        self.tracker = StepTracker(num_steps)
        self.granularity = Granularity(schedule.granularity)
        self.wanted = frozenset(Signal(s) for s in schedule.signals)
        self.order = int(schedule.forecast_order)
        self.call_scope = check_scope(scope, schedule, self.granularity.value)  # dcache.call_scope
        self.scope = scope
        self.blocks = self._layout_blocks()
        self.units = self._unit_names()
        layout = (tuple((type(s.block), s.list_index, s.modules) for s in self.blocks), self.units)
        self.flops = FlopBook.for_model(transformer, layout, count_flops)
        self.module_unit: dict[tuple[int, str], int] = {}
        self.composed_units: list[tuple[int, tuple[int, ...]]] = []  # (unit, its input units), Adapter.composed
        if self.granularity is Granularity.MODULE:
            self.module_unit = {(b, m): i for i, (b, m) in enumerate(self._module_pairs())}
            self.composed_units = composed_indices(self.adapter, self.units)
        # MODULE units a block calls more than once per forward (Adapter.shared): one cache per call, in call order
        self.shared_units = frozenset(i for i, (_, m) in enumerate(self._module_pairs())
                                      if m in self.adapter.shared) if self.module_unit else frozenset()
        self.decision_block = schedule.probe_blocks if self.granularity is Granularity.STACK else 0
        # STACK, in order (call scope: none, the call is computed or replaced as a whole and no block is hooked)
        self.segment_lists = () if self.call_scope else tuple(s.list_index for s in self.blocks if s.segment_first)
        self.last_block = len(self.blocks) - 1
        stack = self.granularity is Granularity.STACK
        for s in self.blocks:
            s.exit_work = (self.granularity is Granularity.BLOCK or s.index == self.last_block
                           or (stack and s.role == "probe" and s.index == self.decision_block - 1)
                           or (stack and s.role == "middle"))  # between-block additions (_note_between)
        self.ops = VALIDATED  # kernel entry points, re-chosen at the first block of every call (cache_ops.py)
        self._bytes_seen: tuple[int, int] = (0, 0)  # (branches, units) when the cache bytes were last summed
        self.record: GenerationRecord | None = None
        self._ended: GenerationRecord | None = None  # the last record whose end the schedule was told
        self._verified_lists: set[int] = set()  # block lists whose output format was checked (first computed call)
        self.generations = 0
        self.branches: dict[str, BranchState] = {}
        self.call: CallState | None = None
        self.peak_cache_bytes = 0
        self.memory_at_end: dict[str, dict[str, int]] = {}  # {branch: {kind: bytes}} of the last generation
        self._hooked_scheduler: Any = None
        self.scheduler_name: str | None = None  # class of the scheduler driving generations (kept after remove)
        self._removed = False
        self._timestep_slot = _timestep_slot(transformer)
        self._call_inputs: tuple[tuple, dict] | None = None  # (args, kwargs) of the running transformer call
        self._latent: torch.Tensor | None = None  # call scope: the running call's latent input x
        self.memoize = memoize
        self.memos: list = []  # dcache.memo hooks on step-invariant modules (Adapter.invariants)
        self._install()

    # ------------------------------------------------------------------------------------------------ layout
    def _layout_blocks(self) -> list[BlockSlot]:
        slots: list[BlockSlot] = []
        slot_cache: dict[tuple[type, int], StreamSlots] = {}
        for list_index, block in self.adapter.blocks(self.transformer):
            spec = self.adapter.block_lists[list_index]
            key = (type(block), list_index)
            if key not in slot_cache:
                slot_cache[key] = StreamSlots.for_block(block, spec)
            slots.append(BlockSlot(len(slots), list_index, block, spec, slot_cache[key],
                                   modules=self.adapter.module_names(block)))
        n = len(slots)
        if n == 0:
            raise ValueError(f"{type(self.transformer).__name__} has no blocks in {self.adapter.block_lists}; "
                             f"nothing to cache.")
        fn, bn = int(self.schedule.probe_blocks), int(self.schedule.tail_blocks)
        if self.granularity is Granularity.STACK:
            if fn < 0 or bn < 0 or fn + bn >= n:
                fix = (f"use probe_blocks + tail_blocks <= {n - 1} (e.g. probe_blocks=1, tail_blocks=0)" if n > 1 else
                       "a model with one block has no room for a probe block and a cached middle: use a method that "
                       "needs no probe block (e.g. 'fixed_interval', 'magcache', or taylorseer with "
                       "granularity='block')")
                raise ValueError(f"probe_blocks={fn} and tail_blocks={bn} leave no block to cache in a model with "
                                 f"{n} block{'s' if n != 1 else ''}; {fix}.")
            for s in slots:
                s.role = "probe" if s.index < fn else "tail" if s.index >= n - bn else "middle"
            middle = [s for s in slots if s.role == "middle"]
            for li in {s.list_index for s in middle}:
                members = [s for s in middle if s.list_index == li]
                members[0].segment_first = True
                members[-1].segment_last = True
        elif fn or bn:
            raise ValueError(f"probe_blocks/tail_blocks apply to STACK granularity only, not {self.granularity.value}.")
        return slots

    def _module_pairs(self) -> list[tuple[int, str]]:
        return [(s.index, m) for s in self.blocks for m in s.modules]

    def _unit_names(self) -> tuple[str, ...]:
        if self.granularity is Granularity.STACK:
            return ("stack",)
        if self.granularity is Granularity.BLOCK:
            return tuple(f"b{s.index}" for s in self.blocks)
        return tuple(f"b{b}.{m}" for b, m in self._module_pairs())

    # ------------------------------------------------------------------------------------------------ hooks
    def _install(self) -> None:
        t = self.transformer
        # accelerate's offload hook (enable_model_cpu_offload) wraps `forward` and restores `_old_forward` when it
        # is removed after every pipeline call: dcache goes *under* it, as the forward accelerate calls.
        accelerate_forward = t.forward if _has_accelerate_hook(t) else None
        if accelerate_forward is not None:
            t.forward = t._old_forward
        HookRegistry.check_if_exists_or_initialize(t).register_hook(_TransformerHook(self), HOOK_NAME)
        self._installed_forward = t.forward
        if accelerate_forward is not None:
            t._old_forward, t.forward = t.forward, accelerate_forward
        for slot in self.blocks if not self.call_scope else ():  # call scope: the call is the unit, blocks run bare
            HookRegistry.check_if_exists_or_initialize(slot.block).register_hook(_BlockHook(self, slot), HOOK_NAME)
        if self.memoize:
            self.memos = install_memos(t, self.adapter.invariants, HOOK_NAME, self._call_arguments)
        self._module_hooked: dict[int, nn.Module] = {}
        if self.granularity is Granularity.MODULE:
            self._hook_modules()
        self._hook_scheduler()

    def _hook_modules(self) -> None:
        """(Re)hook module units; a module replaced since (e.g. by a LoRA layer loaded after apply) is re-hooked."""
        for slot in self.blocks:
            for name in slot.modules:
                unit = self.module_unit[(slot.index, name)]
                module = submodule(slot.block, name)
                old = self._module_hooked.get(unit)
                if module is old:
                    continue
                if old is not None:
                    HookRegistry.check_if_exists_or_initialize(old).remove_hook(HOOK_NAME, recurse=False)
                HookRegistry.check_if_exists_or_initialize(module).register_hook(_ModuleHook(self, unit), HOOK_NAME)
                self._module_hooked[unit] = module

    def _follow_calling_pipeline(self) -> None:
        """A call outside any generation of the hooked scheduler: when another pipeline object that shares this
        transformer is calling (`Pipeline(**pipe.components)` with its own scheduler), hook that scheduler and start
        the generation its set_timesteps (already run) began, so it is tracked like the pipeline applied to."""
        caller = calling_pipeline(self.transformer)
        if caller is None or caller is self.pipeline:
            return
        self.pipeline = caller
        self._hook_scheduler()
        if isinstance(getattr(self._hooked_scheduler, "timesteps", None), torch.Tensor):
            self._on_set_timesteps(self._hooked_scheduler)

    def _current_scheduler(self) -> Any:
        return getattr(self.pipeline, "scheduler", None) if self.pipeline is not None else None

    def _hook_scheduler(self) -> None:
        """Wrap the scheduler *instance*'s set_timesteps / step (never the class).

        The wrappers are methods bound to the instance, so a deep copy of the scheduler (some pipelines copy it)
        gets wrappers bound to the copy, which run the copy's own state and do not drive this engine.
        """
        scheduler = self._current_scheduler()
        if scheduler is None or scheduler is self._hooked_scheduler or self.leader is not None:
            return
        self._unhook_scheduler()
        engine = self
        set_timesteps, step = getattr(scheduler, "set_timesteps").__func__, getattr(scheduler, "step").__func__

        # functools.wraps keeps the scheduler's own name, docstring and (through __wrapped__) signature: diffusers'
        # retrieve_timesteps reads `inspect.signature(scheduler.set_timesteps)` to decide whether sigmas/timesteps
        # may be passed, and refuses them when it sees a bare (*args, **kwargs).
        @functools.wraps(set_timesteps)
        def wrapped_set_timesteps(sched, *args, **kwargs):
            out = set_timesteps(sched, *args, **kwargs)
            if sched is engine._hooked_scheduler:
                for eng in (engine, *engine.followers):
                    eng._on_set_timesteps(sched)
            return out

        @functools.wraps(step)
        def wrapped_step(sched, *args, **kwargs):
            out = step(sched, *args, **kwargs)
            if sched is engine._hooked_scheduler:
                for eng in (engine, *engine.followers):
                    if eng.tracker.on_scheduler_step():
                        eng._finish_generation()
            return out

        scheduler.set_timesteps = types.MethodType(wrapped_set_timesteps, scheduler)
        scheduler.step = types.MethodType(wrapped_step, scheduler)
        self._hooked_scheduler = scheduler
        self.scheduler_name = type(scheduler).__name__

    def _unhook_scheduler(self) -> None:
        scheduler = self._hooked_scheduler
        if scheduler is not None:
            for name in ("set_timesteps", "step"):
                scheduler.__dict__.pop(name, None)
        self._hooked_scheduler = None

    def remove(self) -> None:
        if self._removed:
            return
        self._finish_generation()
        t = self.transformer
        outer = t.forward
        HookRegistry.check_if_exists_or_initialize(t).remove_hook(HOOK_NAME, recurse=True)
        for module in self._module_hooked.values():  # modules swapped out of the tree since they were hooked
            HookRegistry.check_if_exists_or_initialize(module).remove_hook(HOOK_NAME, recurse=False)
        restored = t.forward
        if outer is not self._installed_forward:  # someone (accelerate) wrapped dcache: keep their wrapper
            t.forward = outer
        if getattr(t, "_old_forward", None) is self._installed_forward:
            t._old_forward = restored
        self._unhook_scheduler()
        if self.leader is not None and self in self.leader.followers:
            self.leader.followers.remove(self)
        self.branches.clear()
        self._removed = True

    # ------------------------------------------------------------------------------------------------ generations
    def _on_set_timesteps(self, scheduler: Any) -> None:
        self.scheduler_name = type(scheduler).__name__
        self._finish_generation()
        ts = getattr(scheduler, "timesteps", None)
        timesteps = tuple(float(t) for t in ts.tolist()) if isinstance(ts, torch.Tensor) else None
        self.tracker.on_set_timesteps(timesteps)
        self._start_generation(self.tracker.record)

    def _start_generation(self, record: GenerationRecord) -> None:
        if self.granularity is Granularity.MODULE:
            self._hook_modules()
        self.record = record
        self.generations += 1
        self.branches = {}
        self.schedule.reset(GenerationInfo(num_steps=record.num_steps, timesteps=record.timesteps, units=self.units,
                                           model_class=type(self.transformer).__name__, num_blocks=len(self.blocks)))
        # a schedule may change the signals it reads between generations (MagCache stops measuring once calibrated)
        self.wanted = frozenset(Signal(s) for s in self.schedule.signals)

    def _finish_generation(self) -> None:
        """Flush pending post-call signals into the record (one sync) and free every cached tensor."""
        rec = self.record
        if rec is None:
            return
        for bstate in self.branches.values():
            self._sync_post(bstate, rec)
        if self._ended is not rec:  # tell the schedule once per record, with the post signals flushed
            self._ended = rec
            self.schedule.end(rec.num_steps is not None and rec.step >= rec.num_steps)
        self.peak_cache_bytes = max(self.peak_cache_bytes, self._cache_bytes())
        if self.branches:  # handle.memory(): where the bytes were (dcache.memory)
            self.memory_at_end = branch_breakdown(self.branches, self.granularity.value)
        self.branches = {}
        self._bytes_seen = (0, 0)
        rec.finished = True

    def _cache_bytes(self) -> int:
        return sum(b.nbytes for b in self.branches.values())

    # ------------------------------------------------------------------------------------------------ calls
    def _call_arguments(self) -> dict[str, Any] | None:
        """The running transformer call's arguments by name (pipelines pass them as keywords: no binding)."""
        if self._call_inputs is None:
            return None
        args, kwargs = self._call_inputs
        return bind_arguments(self.transformer, args, kwargs) if args else kwargs

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        self._call_inputs = (args, kwargs)
        if self.pipeline is not None and self.leader is None and not self.tracker.in_generation():
            self._follow_calling_pipeline()
        self._hook_scheduler()
        name, pos = self._timestep_slot
        timestep = kwargs.get(name) if name in kwargs else args[pos] if pos is not None and pos < len(args) else None
        record, new = self.tracker.begin_call(timestep)
        if new or record is not self.record:
            if self.record is not record:
                self._finish_generation()
            self._start_generation(record)
        branch = self.tracker.branch_name(record)
        bstate = self.branches.get(branch)
        if bstate is None:
            bstate = self.branches[branch] = BranchState(codec=self.cache_codec)
        self.call = CallState(record, record.step, branch, len(record.calls), timestep, bstate)
        if Signal.SPECTRAL_REL_L1 in self.wanted:
            self._spectral_signal(self.call, args, kwargs)

    def end_call(self) -> None:
        call, self.call = self.call, None
        self._call_inputs = None
        self._latent = None
        if call is None or call.actions is None:
            return
        if call.finished_run is not None:  # the forward returned before the next list's first block
            self._store_run(call)
        rec = call.record
        signals = dict(call.signal_values, flops_total=call.flops_total, flops_computed=call.flops_computed)
        entry = CallRecord(call.step, call.branch, call.actions, signals)
        rec.calls.append(entry)
        if call.actions == _COMPUTE * len(call.actions):
            call.bstate.last_compute_step = call.step
            self._measure_post(call)
            call.bstate.pending_call = entry
        self._update_peak_bytes()

    def _update_peak_bytes(self) -> None:
        """Peak cache size. Summing every cached tensor each call costs more than a skipped block on small models,
        and after a unit's first store its buffers are rewritten in place (same shapes), so the sum is only taken
        when the number of cached units changes; generation end (`_finish_generation`) takes it again."""
        seen = (len(self.branches), sum(len(b.units) for b in self.branches.values()))
        if seen != self._bytes_seen:
            self._bytes_seen = seen
            self.peak_cache_bytes = max(self.peak_cache_bytes, self._cache_bytes())

    def _decide(self, call: CallState) -> None:
        bstate = call.bstate
        values = self._sync_signals(call)
        timesteps = call.record.timesteps
        timestep = timesteps[call.step] if timesteps and call.step < len(timesteps) else None
        ctx = CallContext(step=call.step, num_steps=call.record.num_steps, branch=call.branch,
                          call_index=call.call_index, timestep=timestep, signals=values,
                          last_compute_step=bstate.last_compute_step)
        call.signal_values = {k.value: v for k, v in values.items() if k in PRE_SIGNALS}
        row = normalize_actions(self.schedule.decide(ctx), len(self.units))
        call.actions = self._feasible(row, bstate)

    def _feasible(self, row: str, bstate: BranchState) -> str:
        """Force COMPUTE where a unit has nothing cached yet in this branch (e.g. first call, new shapes); REUSE
        the inputs of a composed module unit that is not computed (MODULE granularity)."""
        if _COMPUTE * len(row) == row:
            return row
        chars = list(row)
        for i, a in enumerate(chars):
            if a == _COMPUTE:
                continue
            if self.call_scope:
                hist = bstate.units.get(CALL_UNIT)
                ok = hist is not None and bstate.call_layout is not None and hist.matches([self._latent])
            elif self.granularity is Granularity.STACK:
                ok = bool(bstate.units) and all(bstate.units.get(("seg", li)) is not None
                                                for li in self.segment_lists if li not in bstate.chained)
            else:
                hist = bstate.units.get(i)
                ok = hist is not None and hist.tables is not None
            if not ok:
                chars[i] = _COMPUTE
        for unit, inputs in self.composed_units:  # a reused composed unit leaves its inputs' outputs unused:
            if chars[unit] != _COMPUTE:  # reuse them too (no compute, no Taylor evaluation)
                for i in inputs:
                    hist = bstate.units.get(i)
                    if hist is not None and hist.tables is not None:
                        chars[i] = _REUSE
        return "".join(chars)

    # ------------------------------------------------------------------------------------------------ signals
    def _sync_signals(self, call: CallState) -> dict[Signal, float]:
        """One host transfer for everything the schedule reads this call (pre signals + pending post signals)."""
        bstate = call.bstate
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        for sig, t in call.pre.items():
            names.append(sig.value)
            tensors.append(t.reshape(-1).float())
        for name, t in bstate.pending_post.items():
            names.append(name)
            tensors.append(t.reshape(-1).float())
        if not tensors:
            return {_SIGNALS[k]: v for k, v in bstate.post_values.items()}
        flat = torch.cat([t.to(tensors[0].device) for t in tensors])
        flat = sync_signals(flat, tensors, self.transformer).tolist()  # context parallel: global values
        values: dict[str, float] = {}
        i = 0
        for name, t in zip(names, tensors):
            n = t.numel()
            chunk = flat[i:i + n]
            i += n
            values[name] = chunk[0] / max(chunk[1], _EPS) if n == 2 else chunk[0]
        post = {k: v for k, v in values.items() if k in bstate.pending_post}
        if post:
            bstate.post_values = post
            bstate.pending_post = {}
            if bstate.pending_call is not None:
                bstate.pending_call.signals.update(post)
        merged = dict(bstate.post_values)
        merged.update(values)
        return {_SIGNALS[k]: v for k, v in merged.items()}

    def _sync_post(self, bstate: BranchState, rec: GenerationRecord) -> None:
        if not bstate.pending_post:
            return
        names = list(bstate.pending_post)
        tensors = [bstate.pending_post[k].reshape(-1).float() for k in names]
        flat = torch.cat([t.to(tensors[0].device) for t in tensors])
        flat = sync_signals(flat, tensors, self.transformer).tolist()  # context parallel: global values, as above
        post, i = {}, 0
        for name, t in zip(names, tensors):
            chunk, i = flat[i:i + t.numel()], i + t.numel()
            post[name] = chunk[0] / max(chunk[1], _EPS) if len(chunk) == 2 else chunk[0]
        bstate.post_values = post
        bstate.pending_post = {}
        if bstate.pending_call is not None:  # calibration reads these from the record
            bstate.pending_call.signals.update(post)

    def _spectral_signal(self, call: CallState, args: tuple, kwargs: dict) -> None:
        """SeaCache's indicator: the call's noisy latents filtered at this step's noise level, vs the previous call
        of the branch (dcache.spectral). Noise level sigma = scheduler timestep / 1000 (flow matching), else the
        step's position; the filter's power law is the schedule's `spectral_power` (SeaCache: 3)."""
        arguments = bind_arguments(self.transformer, args, kwargs)
        hidden = arguments.get("hidden_states", args[0] if args else None)
        latents = spectral.call_latents(hidden, self.adapter.latents, arguments)
        if latents is None and not isinstance(hidden, torch.Tensor):
            return  # no tensor to compare (e.g. a list of per-sample latents): no signal, the schedule computes
        timesteps, n = call.record.timesteps, call.record.num_steps
        sigma = (timesteps[call.step] / 1000.0 if timesteps and call.step < len(timesteps)
                 else 1.0 - call.step / n if n else 0.5)
        indicator = (spectral.sea_filter(latents, sigma, getattr(self.schedule, "spectral_power", 3.0))
                     if latents is not None else hidden.detach().float())
        prev = call.bstate.prev_spectral
        if prev is not None and prev.shape == indicator.shape:
            call.pre[Signal.SPECTRAL_REL_L1] = spectral.per_sample_rel_l1(indicator, prev)
        call.bstate.prev_spectral = indicator

    def _on_stack_input(self, call: CallState, slot: BlockSlot, hidden: torch.Tensor, args: tuple,
                        kwargs: dict) -> None:
        call.stack_input = hidden
        bstate = call.bstate
        if call.record.input_shape is None:
            call.record.input_shape = tuple(hidden.shape)
        if Signal.MODULATED_REL_L1 in self.wanted:
            fn = self.adapter.modulated_input
            mod = hidden
            if fn is not None:  # the probe (e.g. block 0's AdaLN) is compute an uncached call never does: count it
                key, shape = "modulated_input", tuple(hidden.shape)
                counter = self.flops.start(key, shape)
                mod = fn(slot.block, bind_arguments(slot.block, args, kwargs))
                self.flops.stop(counter, key, shape)
                call.flops_computed += self.flops.cost(key, shape) or 0.0
            if bstate.prev_modulated is not None and bstate.prev_modulated.shape == mod.shape:
                call.pre[Signal.MODULATED_REL_L1] = self.ops.rel_l1(mod, bstate.prev_modulated)
            bstate.prev_modulated = mod.detach()
        if Signal.INPUT_DELTA in self.wanted:
            self._input_delta(call, hidden.detach())

    @staticmethod
    def _input_delta(call: CallState, x: torch.Tensor) -> None:
        """INPUT_DELTA = mean|x - x of the branch's previous call| (x: the stack input, or the latents in call
        scope); x becomes the next call's reference."""
        bstate = call.bstate
        if bstate.prev_input is not None and bstate.prev_input.shape == x.shape:
            call.pre[Signal.INPUT_DELTA] = (x - bstate.prev_input).abs().mean()
        bstate.prev_input = x

    def _on_probe_output(self, call: CallState, hidden_out: torch.Tensor) -> None:
        bstate = call.bstate
        stack_in = call.stack_input
        if stack_in is None or stack_in.shape != hidden_out.shape:
            return
        residual = hidden_out - stack_in
        call.probe_residual = residual
        if Signal.PROBE_REL_L1 in self.wanted and bstate.probe_ref is not None \
                and bstate.probe_ref.shape == residual.shape:
            call.pre[Signal.PROBE_REL_L1] = self.ops.rel_l1(residual, bstate.probe_ref)
        if Signal.FORECAST_ERROR in self.wanted and bstate.probe_history is not None \
                and bstate.probe_history.filled > 1 and bstate.probe_history.matches([residual]):
            predicted = bstate.probe_history.forecast(call.step)[0]
            call.pre[Signal.FORECAST_ERROR] = self.ops.rel_l1(residual, predicted)

    def _after_probe_decision(self, call: CallState) -> None:
        """Probe references refresh only on computed calls (FBCache semantics: the diff accumulates since)."""
        residual = call.probe_residual
        if residual is None or call.actions is None or "C" not in call.actions[:1]:
            return
        bstate = call.bstate
        if Signal.PROBE_REL_L1 in self.wanted:
            bstate.probe_ref = residual.detach()
        if Signal.FORECAST_ERROR in self.wanted:
            if bstate.probe_history is None:
                bstate.probe_history = UnitHistory(max(self.order, 1))
            bstate.probe_history.update([residual], call.step)

    def _measure_post(self, call: CallState) -> None:
        wanted = self.wanted & POST_SIGNALS
        x, v = call.stack_input, call.stack_output
        if not wanted or x is None or v is None:
            return
        bstate = call.bstate
        if v.shape != x.shape:  # hidden stream changed length across lists: compare the image (tail) tokens
            x = x[:, -v.shape[1]:] if x.shape[1] > v.shape[1] else x
            if v.shape != x.shape:
                return
        residual = v - x
        pending: dict[str, torch.Tensor] = {}
        prev_r = bstate.residual_at_compute
        if ({Signal.RESIDUAL_NORM_RATIO, Signal.RESIDUAL_REL_L1} & wanted) and prev_r is not None \
                and prev_r.shape == residual.shape:
            _, stats = residual_capture(v, x, prev=prev_r)
            # stats = [sum|r-prev|, sum|prev|, sum r^2, sum prev^2, mean token norm ratio]
            if Signal.RESIDUAL_NORM_RATIO in wanted:
                pending[Signal.RESIDUAL_NORM_RATIO.value] = stats[4:5]
            if Signal.RESIDUAL_REL_L1 in wanted:
                pending[Signal.RESIDUAL_REL_L1.value] = stats[0:2]
        if Signal.OUTPUT_DELTA in wanted and bstate.output_at_compute is not None \
                and bstate.output_at_compute.shape == v.shape:
            pending[Signal.OUTPUT_DELTA.value] = (v - bstate.output_at_compute).abs().mean().reshape(1)
        if Signal.INPUT_DELTA_COMPUTED in wanted and bstate.input_at_compute is not None \
                and bstate.input_at_compute.shape == x.shape:
            pending[Signal.INPUT_DELTA_COMPUTED.value] = (x - bstate.input_at_compute).abs().mean().reshape(1)
        if Signal.OUTPUT_MEAN in wanted:
            pending[Signal.OUTPUT_MEAN.value] = v.abs().mean().reshape(1)
        bstate.residual_at_compute = residual.detach()
        bstate.input_at_compute = x.detach()
        bstate.output_at_compute = v.detach()
        bstate.pending_post = pending

    # ------------------------------------------------------------------------------------------------ call scope
    def call_enter(self, forward: Any, args: tuple, kwargs: dict, compiling: bool = False) -> tuple[bool, Any]:
        """Call scope (dcache.call_scope): decide before the transformer runs. (True, None) runs it; (False, out)
        returns x + Delta (or its Taylor forecast) without running it. The unit is the whole call, so its FLOPs
        (embedders and head included) are counted on the first computed call of each input shape."""
        call = self.call  # opened by begin_call
        x = latent_input(self._call_arguments() or {}, args)
        if x is None:
            raise ValueError(f"scope='call' reads the latent input `hidden_states` of the transformer call, but "
                             f"{type(self.transformer).__name__} got {type(x).__name__}; use scope='blocks'.")
        self.ops = ops_for(x)
        self._latent = x
        bstate = call.bstate
        if call.record.input_shape is None:
            call.record.input_shape = tuple(x.shape)
        if Signal.INPUT_DELTA in self.wanted:
            self._input_delta(call, x.detach().clone())  # pipelines may update their latents in place
        self._decide(call)
        action = call.actions[0]
        shape = x.shape
        if action == _COMPUTE:
            if compiling:
                self.flops.count(CALL_UNIT, shape, forward, args, kwargs)  # a dispatch mode would stop dynamo
            else:
                call.counter = self.flops.start(CALL_UNIT, shape)
            return True, None
        forecast = action == _FORECAST
        delta = bstate.units[CALL_UNIT].read(forecast, call.step)[0]
        call.flops_total = self.flops.cost(CALL_UNIT, shape) or 0.0
        return False, bstate.call_layout.build(self.ops.apply(x, delta))

    def call_exit(self, out: Any) -> Any:
        """Call scope, computed call: cache Delta = v - x and the output's layout; post signals read x and v."""
        call, x = self.call, self._latent
        if call is None or x is None:
            return out
        bstate = call.bstate
        if call.counter is not None:
            counter, call.counter = call.counter, None
            self.flops.stop(counter, CALL_UNIT, x.shape)
        call.flops_total = call.flops_computed = self.flops.cost(CALL_UNIT, x.shape) or 0.0
        layout, v = output_layout(out, x, type(self.transformer).__name__)
        bstate.call_layout = layout
        call.stack_input, call.stack_output = x, v
        if self.schedule.may_reuse(call.branch, 0):
            self._store(call, CALL_UNIT, [v], [x])
        return out

    # ------------------------------------------------------------------------------------------------ blocks
    # Every block call is split in three so that, under torch.compile, only the block's own forward is traced:
    #   block_enter (eager: bookkeeping, decision, reuse) -> forward (traced) -> block_exit (eager: caching).
    def block_enter(self, slot: BlockSlot, forward: Any, args: tuple, kwargs: dict,
                    compiling: bool = False) -> tuple[bool, Any]:
        """(True, state) when the block must run, (False, output) when its result comes from the cache."""
        call = self.call
        if call is None or self.flops.counting:  # outside a transformer call, or inside a FLOP-counting pass
            return True, None
        hidden, encoder = slot.slots.read(args, kwargs)
        if slot.index == 0:
            if isinstance(hidden, torch.Tensor):
                self.ops = ops_for(hidden)
            self._on_stack_input(call, slot, hidden, args, kwargs)
        if call.actions is None and slot.index == self.decision_block:
            self._decide(call)
            if self.granularity is Granularity.STACK:
                self._after_probe_decision(call)
        # torch.Size hashes and compares as the tuple it is: FLOP-book keys without a tuple() copy per block
        shape = hidden.shape if isinstance(hidden, torch.Tensor) else ()
        if compiling and not self.flops.known(slot.index, shape):
            self.flops.count(slot.index, shape, forward, args, kwargs)
        out = self._cached_block_output(call, slot, hidden, encoder)
        cost = self.flops.costs.get((slot.index, shape))
        if out is not None:
            call.flops_total += cost if cost is not None else self.flops.cost(slot.index, shape) or 0.0
            if slot.index == self.last_block:
                call.stack_output = slot.slots.split_output(out)[0]
            return False, out
        if slot.role == "middle" and self.granularity is Granularity.STACK:
            if slot.segment_first:
                self._segment_start(call, slot, hidden, encoder)
            elif call.run_own is None and call.run_last_out is not None:
                self._note_between(call, hidden, encoder)
            if call.run_own is not None:
                call.run_block_in = (hidden, encoder)
        counter = None if compiling or cost is not None else self.flops.start(slot.index, shape)
        return True, (call, hidden, encoder, shape, cost, counter)  # counter last (abort)

    def _cached_block_output(self, call: CallState, slot: BlockSlot, hidden, encoder) -> Any:
        """The block's result without running it, or None when the block must compute."""
        if slot.role != "middle":  # STACK probe / tail blocks; always "middle" at BLOCK and MODULE granularity
            return None
        granularity = self.granularity
        if granularity is Granularity.MODULE:
            return None
        if granularity is Granularity.BLOCK:
            action = call.actions[slot.index]
            if action == _COMPUTE:
                return None
            return self._apply_cached(slot, call.bstate.units[slot.index], action, call.step, hidden, encoder)
        action = call.actions[0]
        if action == _COMPUTE:
            return None
        if not slot.segment_first or slot.list_index in call.bstate.chained:
            return slot.slots.make_output(hidden, encoder)  # skipped: the run's residual was applied already
        return self._apply_cached(slot, call.bstate.units[("seg", slot.list_index)], action, call.step, hidden,
                                  encoder)

    def block_exit(self, slot: BlockSlot, state: Any, out: Any) -> Any:
        if state is None:
            return out
        call, hidden, encoder, shape, cost, counter = state
        if counter is not None or cost is None:
            if counter is not None:
                self.flops.stop(counter, slot.index, shape)
            cost = self.flops.cost(slot.index, shape) or 0.0
        call.flops_total += cost
        call.flops_computed += cost  # MODULE granularity: skipped modules subtract their share
        if slot.list_index not in self._verified_lists:
            self._verify_block_output(slot, hidden, out)
        if not slot.exit_work:
            return out
        if self.granularity is Granularity.STACK:
            if slot.role == "probe" and slot.index == self.decision_block - 1:
                self._on_probe_output(call, slot.slots.split_output(out)[0])
            elif slot.role == "middle" and call.run is not None:
                out_h, out_e = slot.slots.split_output(out)
                call.run_last_out = (out_h, out_e)
                if call.run_own is not None:  # read now: the transformer may write into out_h once we return
                    for i, (o, x) in enumerate(zip((out_h, out_e), call.run_block_in)):
                        if isinstance(o, torch.Tensor) and isinstance(x, torch.Tensor) and o.shape == x.shape:
                            call.run_own[i] = o - x if call.run_own[i] is None else call.run_own[i] + (o - x)
                if slot.segment_last:
                    start, seg_h, seg_e = call.run
                    call.run = None
                    call.finished_run = (start, seg_h, seg_e, out_h, out_e)
                    if slot.list_index == self.segment_lists[-1]:
                        self._store_run(call)
        elif self.granularity is Granularity.BLOCK and self.schedule.may_reuse(call.branch, slot.index):
            out_h, out_e = slot.slots.split_output(out)
            self._store(call, slot.index, [out_h, out_e], [hidden, encoder])
        if slot.index == self.last_block:
            call.stack_output = slot.slots.split_output(out)[0]
        return out

    def _verify_block_output(self, slot: BlockSlot, hidden: Any, out: Any) -> None:
        """First computed call of each block list: the block returned what its adapter says (a hidden-states tensor,
        or a tuple in the adapter's order). Checked before anything is cached, so a wrong adapter (generic discovery
        guesses the order) is refused with what the block returned instead of corrupting a reused call."""
        outputs = slot.slots.outputs
        if outputs == (HIDDEN,):
            ok = isinstance(out, torch.Tensor)
        else:
            ok = isinstance(out, (tuple, list)) and len(out) == len(outputs)
            if ok:
                got = out[outputs.index(HIDDEN)]
                ok = isinstance(got, torch.Tensor) and (not isinstance(hidden, torch.Tensor) or got.ndim == hidden.ndim)
        if ok:
            self._verified_lists.add(slot.list_index)
            return
        returned = (f"a tuple of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
                    if isinstance(out, (tuple, list)) else type(out).__name__)
        raise UnsupportedModelError(
            self.transformer,
            f"block list `{slot.spec.path}`: {type(slot.block).__name__} returned {returned}, but the adapter "
            f"({self.adapter.notes or 'registered'}) expects {outputs}; call handle.remove() and register an "
            f"adapter whose BlockList outputs match what the block returns")

    def _segment_start(self, call: CallState, slot: BlockSlot, hidden, encoder) -> None:
        """A computed call enters a list's middle segment. When the previous list's segment output flows into this
        block unchanged (the same tensor objects: the transformer does nothing between the two lists, as in Flux's
        double -> single blocks), the two segments are one run with one cached residual per stream, so a skipped
        call adds 2 residuals instead of 4 and a computed one stores 2 instead of 4. Exact for REUSE and Taylor
        FORECAST (both linear in the cached residuals: r_run = r_0 + r_1); `Schedule.segment_runs` turns it off
        (a learned forecaster keeps one unit per list, the units its predictor was trained on)."""
        bstate, li = call.bstate, slot.list_index
        done = call.finished_run
        if done is not None and hidden is done[3] and encoder is done[4] and self.schedule.segment_runs \
                and call.run_own is None and not slot.spec.adds_in_place:
            call.finished_run = None
            call.run = done[:3]  # continue the run: its inputs stay those of its first list
            bstate.chained.add(li)
            bstate.units.pop(("seg", li), None)  # a per-list residual from before would be stale
            return
        self._store_run(call)
        bstate.chained.discard(li)
        call.run_last_out, call.run_between = None, [None, None]
        call.run_own = [None, None] if slot.spec.adds_in_place else None
        if self.schedule.may_reuse(call.branch, 0):
            call.run = (li, hidden, encoder)

    @staticmethod
    def _note_between(call: CallState, hidden, encoder) -> None:
        """A middle block of the open run receives something other than what the previous one returned: the
        transformer added to the stream between them (`h = h + controlnet_block_samples[i]`). Accumulate it per
        stream; the run's cached residual is (out - in) - sum(additions), the blocks' own contribution."""
        for i, (now, before) in enumerate(zip((hidden, encoder), call.run_last_out)):
            if now is before or not isinstance(now, torch.Tensor) or not isinstance(before, torch.Tensor) \
                    or now.shape != before.shape:
                continue
            added = now - before
            total = call.run_between[i]
            call.run_between[i] = added if total is None else total + added

    def _store_run(self, call: CallState) -> None:
        """Cache the finished run's residual (out - in per stream) under its first list's key."""
        done, call.finished_run = call.finished_run, None
        if done is not None:
            start, seg_h, seg_e, out_h, out_e = done
            if call.run_own is not None:  # in-place edits: the residual is the blocks' own, summed block by block
                own_h, own_e = call.run_own
                out_h = seg_h + own_h if own_h is not None else out_h
                out_e = seg_e + own_e if own_e is not None and seg_e is not None else out_e
                call.run_own = None
            add_h, add_e = call.run_between
            if add_h is not None:
                out_h = out_h - add_h
            if add_e is not None:
                out_e = out_e - add_e
            self._store(call, ("seg", start), [out_h, out_e], [seg_h, seg_e])

    def abort(self, state: Any, whole_call: bool = False) -> None:
        """A forward raised: close an open FLOP counter and drop the call (its record entry is never written).
        whole_call: the transformer call itself raised, so its generation is over (StepTracker.abort)."""
        if whole_call:
            self.tracker.abort()
        if isinstance(state, tuple) and state and isinstance(state[-1], FlopCounterMode):
            self.flops.stop(state[-1], None, None)
        if self.call is not None and self.call.counter is not None:  # call scope: counting the whole call
            self.flops.stop(self.call.counter, None, None)
        self.call = None
        self._call_inputs = None
        self._latent = None

    def _store(self, call: CallState, key: Any, outs: list, ins: list) -> None:
        """Cache residual = out - in per stream (hidden, encoder), reusing the old buffer in place when possible."""
        hist = call.bstate.history(key, self.order)
        previous = hist.store_buffers()
        residuals = []
        for i, (o, x) in enumerate(zip(outs, ins)):
            if o is None or x is None or not isinstance(o, torch.Tensor):
                continue
            if o.shape != x.shape:  # stream changed length inside the segment: keep the tail tokens (image)
                x = x[:, -o.shape[1]:] if x.ndim >= 2 and x.shape[1] > o.shape[1] else x
            buffer = previous[len(residuals)] if len(previous) > len(residuals) else None
            if buffer is not None and (buffer.shape != o.shape or buffer.dtype != o.dtype):
                buffer = None
            residual = self.ops.store(o, x, buffer)
            residuals.append(residual)
        hist.update(residuals, call.step)

    def _apply_cached(self, slot: BlockSlot, hist: UnitHistory, action: str, step: int,
                      hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
        forecast = action == _FORECAST
        forecaster = self.schedule.forecaster if forecast else None  # a schedule's own forecast (e.g. learned)
        cached = forecaster(hist.plain(), step) if forecaster is not None else hist.read(forecast, step)
        out_h = self.ops.apply(hidden, cached[0])
        out_e = encoder
        if encoder is not None and len(cached) > 1:
            out_e = self.ops.apply(encoder, cached[1])
        return slot.slots.make_output(out_h, out_e)

    # ------------------------------------------------------------------------------------------------ modules
    def module_enter(self, unit: int, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else next(
            (v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        shape = tuple(first.shape) if first is not None else ()
        key = ("m", unit)
        if self.flops.counting:  # inside the block's fake counting pass: count this module's share
            self.flops.enter(key, shape)
            return True, "counting"
        call = self.call
        if call is None or call.actions is None:
            return True, None
        action = call.actions[unit]
        cache_key: Any = unit
        if unit in self.shared_units:  # the k-th call of a shared unit in this block has its own cache
            k = call.module_calls.get(unit, 0)
            call.module_calls[unit] = k + 1
            cache_key = unit if k == 0 else (unit, k)
        if action == _COMPUTE:  # the block counts its modules' FLOPs; measure this module's share
            return True, (call, key, shape, cache_key, self.flops.start(key, shape))  # counter last (abort)
        call.flops_computed -= self.flops.cost(key, shape) or 0.0
        hist = call.bstate.units.get(cache_key)
        if hist is None or hist.tables is None:  # a shared unit called more often than when it was computed
            raise RuntimeError(f"module unit {self.units[unit]} was called more times in this block than when it "
                               f"was last computed; its adapter's `shared` modules must be called the same number "
                               f"of times at every step.")
        forecast = action == _FORECAST
        forecaster = self.schedule.forecaster if forecast else None
        tensors = iter(forecaster(hist.plain(), call.step) if forecaster is not None
                       else hist.read(forecast, call.step))
        leaves = [next(tensors) if is_t else None for is_t in hist.is_tensor]  # type: ignore[attr-defined]
        return False, tree_unflatten(leaves, hist.spec)  # type: ignore[attr-defined]

    def module_exit(self, unit: int, state: Any, out: Any) -> Any:
        if state is None:
            return out
        if state == "counting":
            self.flops.exit()
            return out
        call, key, shape, cache_key, counter = state
        self.flops.stop(counter, key, shape)
        if self.schedule.may_reuse(call.branch, unit):
            leaves, spec = tree_flatten(out)
            hist = call.bstate.history(cache_key, self.order)
            hist.update([t for t in leaves if isinstance(t, torch.Tensor)], call.step)
            hist.spec = spec  # type: ignore[attr-defined]
            hist.is_tensor = [isinstance(t, torch.Tensor) for t in leaves]  # type: ignore[attr-defined]
        return out

    # The same entry points behind torch.compiler.disable, for hook frames that run while torch.compile traces the
    # model: dynamo must neither trace the bookkeeping nor compile its helpers as graphs of their own. In plain eager
    # (no tracer active) the hooks call the undecorated methods: the disable wrapper's frame switching costs more
    # than the rest of a skipped block's bookkeeping.
    begin_call_traced = _eager(begin_call)
    call_enter_traced = _eager(call_enter)
    call_exit_traced = _eager(call_exit)
    end_call_traced = _eager(end_call)
    block_enter_traced = _eager(block_enter)
    block_exit_traced = _eager(block_exit)
    module_enter_traced = _eager(module_enter)
    module_exit_traced = _eager(module_exit)
    abort_traced = _eager(abort)


def _has_accelerate_hook(module: nn.Module) -> bool:
    return hasattr(module, "_hf_hook") and hasattr(module, "_old_forward")


_TIMESTEP_NAMES = ("timestep", "timesteps", "t", "time_step", "sigma", "sigmas")


def _timestep_slot(transformer: nn.Module) -> tuple[str, int | None]:
    """(name, positional index) of the transformer forward's timestep argument, for transformer-only tracking."""
    import inspect

    params = [p for p in inspect.signature(transformer.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in _TIMESTEP_NAMES:
        for i, p in enumerate(params):
            if p.name == name:
                return name, i if p.kind != p.KEYWORD_ONLY else None
    return "timestep", None


class _ContextListener(StateManager):
    """Receives diffusers' `cache_context(name)` (set on every stateful hook's StateManager)."""

    def __init__(self, tracker: StepTracker):
        super().__init__(dict)
        self._tracker = tracker

    def set_context(self, context: Any) -> None:
        self._tracker.context_name = None if context is None else getattr(context, "name", context)


class _TransformerHook(ModelHook):
    _is_stateful = True

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine
        self.context_listener = _ContextListener(engine.tracker)

    @torch.compiler.disable(recursive=False)
    def new_forward(self, module: nn.Module, *args, **kwargs):
        engine = self.engine
        if get_eval_frame_callback() is None:  # plain eager (see Engine.begin_call_traced)
            begin, end, abort = engine.begin_call, engine.end_call, engine.abort
            enter, exit_ = engine.call_enter, engine.call_exit
        else:
            begin, end, abort = engine.begin_call_traced, engine.end_call_traced, engine.abort_traced
            enter, exit_ = engine.call_enter_traced, engine.call_exit_traced
        begin(args, kwargs)
        try:
            if engine.call_scope:  # dcache.call_scope: the whole call may come from the cache
                run, out = enter(self.fn_ref.original_forward, args, kwargs, enter is engine.call_enter_traced)
                if not run:
                    end()
                    return out
            out = self.fn_ref.original_forward(*args, **kwargs)
            if engine.call_scope:
                out = exit_(out)
        except BaseException:
            abort(None, True)
            raise
        end()
        return out

    def reset_state(self, module: nn.Module) -> nn.Module:
        return module


class _BlockHook(ModelHook):
    def __init__(self, engine: Engine, slot: BlockSlot):
        super().__init__()
        self.engine, self.slot = engine, slot

    @torch.compiler.disable(recursive=False)  # this frame stays eager; the original forward below is traced
    def new_forward(self, module: nn.Module, *args, **kwargs):
        # Inline on purpose: a helper frame here would be traced by dynamo (only this frame is skipped).
        engine = self.engine
        compiling = get_eval_frame_callback() is not None
        if compiling:
            enter, exit_, abort = engine.block_enter_traced, engine.block_exit_traced, engine.abort_traced
        else:  # plain eager (see Engine.begin_call_traced)
            enter, exit_, abort = engine.block_enter, engine.block_exit, engine.abort
        run, state = enter(self.slot, self.fn_ref.original_forward, args, kwargs, compiling)
        if not run:
            return state
        try:
            out = self.fn_ref.original_forward(*args, **kwargs)
        except BaseException:
            abort(state)
            raise
        return exit_(self.slot, state, out)


class _ModuleHook(ModelHook):
    def __init__(self, engine: Engine, unit: int):
        super().__init__()
        self.engine, self.unit = engine, unit

    @torch.compiler.disable(recursive=False)
    def new_forward(self, module: nn.Module, *args, **kwargs):
        engine = self.engine  # inline: see _BlockHook.new_forward
        if get_eval_frame_callback() is None:
            enter, exit_, abort = engine.module_enter, engine.module_exit, engine.abort
        else:
            enter, exit_, abort = engine.module_enter_traced, engine.module_exit_traced, engine.abort_traced
        run, state = enter(self.unit, args, kwargs)
        if not run:
            return state
        try:
            out = self.fn_ref.original_forward(*args, **kwargs)
        except BaseException:
            abort(state)
            raise
        return exit_(self.unit, state, out)
