"""Profiling helpers shared by the profiled methods (ERTACache, InvarDiff, ProfilingDiT, BAC) and the searches.

Profiling runs the *uncached* pipeline (or transformer) under an all-compute dcache schedule, so that the engine
tells every transformer call its (generation, step, branch) exactly as a cached run will see it, and reads
per-step x per-block x per-module features with plain torch forward hooks:

    with ProfileSession(pipe) as session:
        session.on_block(lambda slot, where, h_in, e_in, h_out, e_out: ...)     # every block call
        session.on_module(lambda unit, where, output: ...)                       # every inner-module call
        session.on_scheduler_step(lambda where, model_output, sample, prev: ...) # pipeline use only
        session.run(run_fn)                                                      # e.g. lambda: pipe(labels=[0, 1])

`where` is `Where(generation, step, branch)`. This file is the only place of the profiled methods that touches
modules, hooks and tensors; the schedules (the method files) see the resulting numbers only. The statistics
collectors below accumulate on the fly (ring buffers of a few steps), so profiling memory does not grow with the
number of steps or calibration inputs.

The all-compute session output is bit-identical to the uncached pipeline (a dcache invariant), so what is profiled
is the uncached trajectory.
"""

from __future__ import annotations

import functools

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

import dcache
from dcache import Action, Granularity, Plan, Schedule
from dcache.compat.torch import tree_flatten
from dcache.model.adapters import composed_indices, reuse_composed_inputs
from dcache.schedule import CallContext

RunFn = Callable[[], Any]
_EPS = 1e-12

# Inner-module names that are feed-forward layers (BAC's bubbling union targets them).
# proj_out (Flux-style single blocks) and down_proj (inline MLPs) project the MLP branch: they are FFN layers too.
FFN_MODULES = frozenset({"ff", "ff_context", "ffn", "mlp", "proj_mlp", "img_mlp", "txt_mlp", "feed_forward",
                         "proj_out", "gate_proj", "up_proj", "down_proj"})


@dataclass(frozen=True)
class Where:
    generation: int  # engine generation counter (one per pipeline call / transformer-only run of steps)
    step: int
    branch: str


class TrackSchedule(Schedule):
    """All-compute and cache-free: the engine only tracks steps and branches (profiling, calibration)."""

    granularity = Granularity.STACK
    name = "profile"

    def decide(self, ctx: CallContext) -> Action:
        return Action.COMPUTE

    def may_reuse(self, branch: str, unit: int) -> bool:
        return False


def as_runs(run_fn: RunFn | Sequence[RunFn]) -> list[RunFn]:
    """A single callable or a list of callables (one per calibration input); each runs >= 1 generation."""
    runs = list(run_fn) if isinstance(run_fn, (list, tuple)) else [run_fn]
    if not runs or not all(callable(r) for r in runs):
        raise TypeError("run_fn must be a callable that runs the pipeline once (e.g. lambda: pipe(labels=[0, 1], "
                        "num_inference_steps=28, generator=torch.Generator().manual_seed(0))) or a list of them.")
    return runs


class ProfileSession:
    """dcache all-compute tracking + torch forward hooks on blocks / inner modules + a scheduler.step tap.

    target: a diffusers pipeline (with `.transformer`) or a transformer (then pass `num_steps`).
    schedule: what the engine runs (default all-compute, i.e. profiling); a Plan replays it (calibration passes).
    """

    def __init__(self, target: Any, *, num_steps: int | None = None, schedule: Any = None):
        self.target = target
        self.handle = dcache.apply(target, schedule if schedule is not None else TrackSchedule(),
                                   num_steps=num_steps, count_flops=False)
        self.engine = self.handle.engine
        self.transformer: nn.Module = self.engine.transformer
        self._torch_hooks: list[Any] = []
        self._scheduler: Any = None
        self._scheduler_prev: Any = None
        self._scheduler_wrapper: Any = None
        self._closed = False

    # ------------------------------------------------------------------------------------------------ layout
    @property
    def blocks(self):
        """Engine block slots in execution order (`.index`, `.block`, `.slots`, `.modules`, `.list_index`)."""
        return self.engine.blocks

    def module_pairs(self) -> list[tuple[int, str]]:
        """(block index, module name) for every inner module unit, in MODULE-granularity unit order."""
        return [(s.index, m) for s in self.engine.blocks for m in s.modules]

    def unit_names(self, granularity: Granularity) -> list[str]:
        if granularity is Granularity.STACK:
            return ["stack"]
        if granularity is Granularity.BLOCK:
            return [f"b{s.index}" for s in self.engine.blocks]
        return [f"b{b}.{m}" for b, m in self.module_pairs()]

    def where(self) -> Where | None:
        call = self.engine.call
        if call is None:
            return None
        return Where(self.engine.generations, call.step, call.branch)

    # ------------------------------------------------------------------------------------------------ taps
    def on_block(self, fn: Callable[..., None]) -> None:
        """fn(slot, where, hidden_in, encoder_in, hidden_out, encoder_out) after every block call."""
        for slot in self.engine.blocks:
            def hook(module, args, kwargs, output, slot=slot):
                where = self.where()
                if where is None:
                    return None
                h_in, e_in = slot.slots.read(args, kwargs)
                h_out, e_out = slot.slots.split_output(output)
                fn(slot, where, h_in, e_in, h_out, e_out)
                return None

            self._torch_hooks.append(slot.block.register_forward_hook(hook, with_kwargs=True))

    def on_module(self, fn: Callable[..., Any], every_call: bool = False) -> None:
        """fn(unit, where, output) after every inner-module call; a non-None return replaces the output.

        A module a block calls more than once per forward (Adapter.shared, e.g. CogView4's `ff` on the image, then the
        text tokens) reports its first call in each block call only (the image stream); with every_call=True every
        call reports, as fn(unit, where, output, k) with k = 0, 1, ... its order within the block call."""
        seen: dict[int, tuple[Any, int]] = {}  # unit -> (the engine's call object, calls of the unit in it)
        for unit, (b, name) in enumerate(self.module_pairs()):
            module = getattr(self.engine.blocks[b].block, name)

            def hook(module, args, kwargs, output, unit=unit):
                where = self.where()
                if where is None:
                    return None
                call, last = self.engine.call, seen.get(unit)
                k = last[1] + 1 if last is not None and last[0] is call else 0
                seen[unit] = (call, k)
                if every_call:
                    return fn(unit, where, output, k)
                return fn(unit, where, output) if k == 0 else None

            self._torch_hooks.append(module.register_forward_hook(hook, with_kwargs=True))

    def on_transformer_pre(self, fn: Callable[..., None]) -> None:
        """fn(args, kwargs) before every transformer call (before the engine opens the call)."""
        def hook(module, args, kwargs):
            fn(args, kwargs)
            return None

        self._torch_hooks.append(self.transformer.register_forward_pre_hook(hook, with_kwargs=True))

    def on_output(self, fn: Callable[..., None]) -> None:
        """fn(where, output) after every transformer call; output = the first returned tensor (the prediction)."""
        def hook(module, args, kwargs, output):
            rec = self.engine.record
            if rec is None or not rec.calls:
                return None
            last = rec.calls[-1]
            out = output[0] if isinstance(output, (tuple, list)) or hasattr(output, "to_tuple") else output
            fn(Where(self.engine.generations, last.step, last.branch), out)
            return None

        self._torch_hooks.append(self.transformer.register_forward_hook(hook, with_kwargs=True))

    def on_scheduler_step(self, fn: Callable[..., None]) -> None:
        """fn(where, model_output, sample, prev_sample) around the pipeline scheduler's step (pipeline use only)."""
        scheduler = getattr(self.target, "scheduler", None)
        if scheduler is None:
            raise ValueError("scheduler taps need a pipeline target (a bare transformer has no scheduler).")
        prev = scheduler.step  # the engine's instance wrapper (or the bound method)

        @functools.wraps(prev)  # the scheduler's own signature stays visible to inspect
        def wrapped_step(*args, **kwargs):
            rec = self.engine.record
            where = Where(self.engine.generations, rec.step if rec is not None else -1, "scheduler")
            out = prev(*args, **kwargs)
            model_output, sample = step_arguments(args, kwargs)
            prev_sample = out[0] if isinstance(out, tuple) else out.prev_sample
            fn(where, model_output, sample, prev_sample)
            return out

        scheduler.step = wrapped_step
        self._scheduler, self._scheduler_prev, self._scheduler_wrapper = scheduler, prev, wrapped_step

    # ------------------------------------------------------------------------------------------------ run
    @torch.no_grad()
    def run(self, run_fn: RunFn | Sequence[RunFn]) -> int:
        """Run every calibration callable; returns the number of generations the engine saw."""
        start = self.engine.generations
        for fn in as_runs(run_fn):
            fn()
        return self.engine.generations - start

    def plan_header(self) -> dict[str, Any]:
        """The model / layout part of a Plan for this target (what `handle.plan()` would write)."""
        eng = self.engine
        layout = Counter(s.list_index for s in eng.blocks)
        rec = eng.record
        scheduler = getattr(self.target, "scheduler", None) if self.target is not self.transformer else None
        return dict(model_class=type(eng.transformer).__name__,
                    block_layout=[layout[i] for i in range(len(eng.adapter.block_lists))],
                    scheduler=type(scheduler).__name__ if scheduler is not None else None,
                    resolution=list(rec.input_shape) if rec is not None and rec.input_shape else None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._torch_hooks:
            h.remove()
        self._torch_hooks = []
        sched = self._scheduler
        if sched is not None and sched.__dict__.get("step") is self._scheduler_wrapper:
            if getattr(self._scheduler_prev, "__self__", None) is sched:  # it was the plain bound method
                del sched.__dict__["step"]
            else:
                sched.step = self._scheduler_prev
        self.handle.remove()

    def __enter__(self) -> "ProfileSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def step_arguments(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(model_output, sample) of a diffusers `scheduler.step(model_output, timestep, sample, ...)` call."""
    model_output = kwargs["model_output"] if "model_output" in kwargs else args[0]
    sample = kwargs["sample"] if "sample" in kwargs else args[2]
    return model_output, sample


def make_plan(header: dict[str, Any], *, granularity: Granularity, units: list[str], num_steps: int,
              actions: dict[str, list[str]], forecast_order: int = 0, extras: dict | None = None,
              provenance: dict | None = None, adapter: Any = None) -> Plan:
    """A Plan of the profiled model. MODULE rows are written as the engine executes them: with the `adapter`'s
    composed units (e.g. Flux single blocks' proj_out), a reused composed unit's inputs are reused too, so a replay
    records exactly the plan's rows.

    The plan interpolates to other step counts (interpolate_steps): a generation of M steps replays at step i the
    planned row round(i (N - 1) / (M - 1)) of the N calibrated ones, as MagCache maps its ratio table. Calibrating at
    the step count one generates with stays the most accurate."""
    if granularity is Granularity.MODULE and adapter is not None:
        composed = composed_indices(adapter, units)
        actions = {b: [reuse_composed_inputs(r, composed) for r in rows] for b, rows in actions.items()}
    return Plan(granularity=granularity.value, units=list(units), num_steps=num_steps, actions=actions,
                forecast_order=forecast_order, interpolate_steps=True, extras=extras or {},
                provenance=provenance or {}, **header)


# ----------------------------------------------------------------------------------------------------------------
# Tensor statistics (float64 accumulation on the host, one sync per statistic).
# ----------------------------------------------------------------------------------------------------------------

def _leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _pairs(a: Any, b: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    la, lb = _leaves(a), _leaves(b)
    return [(x.float(), y.float()) for x, y in zip(la, lb) if x.shape == y.shape]


def abs_sum(x: Any) -> float:
    return float(sum(t.float().abs().sum() for t in _leaves(x)))


def diff_abs_sum(a: Any, b: Any) -> float:
    return float(sum((x - y).abs().sum() for x, y in _pairs(a, b)))


def dot(a: Any, b: Any) -> float:
    return float(sum((x * y).sum() for x, y in _pairs(a, b)))


def token_change_quantile(new: Any, old: Any, q: float) -> float:
    """Quantile over tokens of ||new[tok] - old[tok]|| / ||old[tok]|| (norm over the last dim; all leaves pooled)."""
    ratios = []
    for x, y in _pairs(new, old):
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        ratios.append((x2 - y2).norm(dim=-1) / y2.norm(dim=-1).clamp_min(1e-6))
    if not ratios:
        return float("nan")
    r = torch.cat(ratios)
    return (float(torch.quantile(r, q)) if r.numel() <= 16_000_000
            else float(torch.quantile(r[:: r.numel() // 16_000_000 + 1], q)))


def detach(x: Any, dtype: torch.dtype | None = torch.float32) -> Any:
    """Detached copies of the tensor leaves of x (a tensor, or a tuple/list of tensors or None)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(dtype) if dtype is not None else x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(detach(v, dtype) for v in x)
    return x


def residual(h_out: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
    """h_out - h_in over the image (tail) tokens when the stream length changed (engine convention)."""
    if h_out.shape != h_in.shape and h_in.ndim >= 2 and h_in.shape[1] > h_out.shape[1]:
        h_in = h_in[:, -h_out.shape[1]:]
    return h_out.float() - h_in.float()


# ----------------------------------------------------------------------------------------------------------------
# Collectors
# ----------------------------------------------------------------------------------------------------------------

class PairwiseCollector:
    """Per branch, statistics of a per-step feature F_i between steps within `window` of each other.

    For every generation and branch, at step i and each earlier step j with i - j <= window:
        err[j, i] += sum|F_i - F_j|,  ref[j, i] += sum|F_i|          (relL1 pooled over inputs = err / ref)
        cos_num[j, i] += <F_i, F_j>,  cos_a[j, i] += |F_j|^2, cos_b[j, i] += |F_i|^2
    With `triples`, also for j' < j < i with j - j' <= window + 1 (D = F_j - F_j', c = (i - j) / (j - j')):
        kdot[j', j, i] += <F_i - F_j, D>,  kden[j', j, i] += |D|^2,  lin_err[j', j, i] += sum|F_i - F_j - c D|
    Features are kept only for the last 2 * window + 2 steps of the current generation.
    """

    def __init__(self, window: int, triples: bool = False):
        self.window = int(window)
        self.triples = triples
        self.err: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.ref: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.cos_num: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.cos_a: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.cos_b: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.kdot: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.kden: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.lin_err: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)  # branch -> number of steps seen (max over generations)
        self._buffers: dict[tuple[int, str], dict[int, Any]] = {}

    def add(self, where: Where, feature: Any, key: str | None = None) -> None:
        branch = where.branch if key is None else key
        buf = self._buffers.setdefault((where.generation, branch), {})
        i = where.step
        self.steps[branch] = max(self.steps[branch], i + 1)
        ref_i = abs_sum(feature)
        for j, fj in buf.items():
            if not 0 < i - j <= self.window:
                continue
            self.err[branch][(j, i)] += diff_abs_sum(feature, fj)
            self.ref[branch][(j, i)] += ref_i
            self.cos_num[branch][(j, i)] += dot(feature, fj)
            self.cos_a[branch][(j, i)] += dot(fj, fj)
            self.cos_b[branch][(j, i)] += dot(feature, feature)
            if not self.triples:
                continue
            for jp, fjp in buf.items():
                if not 0 < j - jp <= self.window + 1:
                    continue
                d = [x - y for x, y in _pairs(fj, fjp)]
                e = [x - y for x, y in _pairs(feature, fj)]
                c = (i - j) / (j - jp)
                self.kdot[branch][(jp, j, i)] += float(sum((a * b).sum() for a, b in zip(e, d)))
                self.kden[branch][(jp, j, i)] += float(sum((b * b).sum() for b in d))
                self.lin_err[branch][(jp, j, i)] += float(sum((a - c * b).abs().sum() for a, b in zip(e, d)))
        buf[i] = detach(feature)
        keep = 2 * self.window + 2 if self.triples else self.window
        for k in [k for k in buf if k < i - keep]:
            del buf[k]
        for key_ in [k for k in self._buffers if k[0] != where.generation]:
            del self._buffers[key_]

    def rel_l1(self, branch: str, j: int, i: int) -> float:
        ref = self.ref[branch].get((j, i), 0.0)
        return self.err[branch].get((j, i), math.inf) / ref if ref > 0 else math.inf

    def cosine(self, branch: str, j: int, i: int) -> float:
        a, b = self.cos_a[branch].get((j, i), 0.0), self.cos_b[branch].get((j, i), 0.0)
        if a <= 0 or b <= 0:
            return 0.0
        return self.cos_num[branch].get((j, i), 0.0) / math.sqrt(a * b)

    def branches(self) -> list[str]:
        return list(self.steps)


def stack_residual_tap(session: ProfileSession, sink: Callable[[Where, torch.Tensor], None]) -> None:
    """sink(where, R) once per transformer call, R = stack output - stack input (hidden stream, image tokens)."""
    last = len(session.blocks) - 1
    inputs: dict[tuple[int, str, int], torch.Tensor] = {}

    def on_block(slot, where, h_in, e_in, h_out, e_out):
        key = (where.generation, where.branch, where.step)
        if slot.index == 0:
            inputs.clear()
            inputs[key] = h_in
        if slot.index == last and key in inputs:
            sink(where, residual(h_out, inputs.pop(key)))

    session.on_block(on_block)


def stack_output_tap(session: ProfileSession, sink: Callable[[Where, torch.Tensor], None]) -> None:
    """sink(where, h_out) once per transformer call: the hidden stream after the last block."""
    last = len(session.blocks) - 1

    def on_block(slot, where, h_in, e_in, h_out, e_out):
        if slot.index == last:
            sink(where, h_out)

    session.on_block(on_block)


def block_residual_tap(session: ProfileSession, sink: Callable[[int, Where, tuple], None]) -> None:
    """sink(block index, where, (hidden residual, encoder residual or None)) after every block call."""

    def on_block(slot, where, h_in, e_in, h_out, e_out):
        r_h = residual(h_out, h_in)
        r_e = residual(e_out, e_in) if isinstance(e_out, torch.Tensor) and isinstance(e_in, torch.Tensor) \
            and e_out.shape == e_in.shape else None
        sink(slot.index, where, (r_h, r_e))

    session.on_block(on_block)


class AdjacentCollector:
    """Per (branch, unit, step): the mean over generations of a statistic of (F_step, F_previous step)."""

    def __init__(self, stat: Callable[[Any, Any], float]):
        self.stat = stat
        self.sums: dict[tuple[str, Any, int], float] = defaultdict(float)
        self.counts: dict[tuple[str, Any, int], int] = defaultdict(int)
        self.steps: dict[str, int] = defaultdict(int)
        self._prev: dict[tuple[int, str, Any], tuple[int, Any]] = {}

    def add(self, where: Where, unit: Any, feature: Any) -> None:
        key = (where.generation, where.branch, unit)
        self.steps[where.branch] = max(self.steps[where.branch], where.step + 1)
        prev = self._prev.get(key)
        if prev is not None and prev[0] == where.step - 1:
            value = self.stat(feature, prev[1])
            if math.isfinite(value):
                self.sums[(where.branch, unit, where.step)] += value
                self.counts[(where.branch, unit, where.step)] += 1
        self._prev[key] = (where.step, detach(feature))
        for k in [k for k in self._prev if k[0] != where.generation]:
            del self._prev[k]

    def value(self, branch: str, unit: Any, step: int) -> float:
        n = self.counts.get((branch, unit, step), 0)
        return self.sums[(branch, unit, step)] / n if n else math.nan


def quantile(values: Iterable[float], q: float) -> float:
    """Linear-interpolation quantile of finite values (numpy's default); nan if none."""
    v = sorted(x for x in values if math.isfinite(x))
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


__all__ = ["Where", "TrackSchedule", "ProfileSession", "make_plan", "PairwiseCollector", "AdjacentCollector",
           "stack_residual_tap", "stack_output_tap", "block_residual_tap", "token_change_quantile", "quantile",
           "FFN_MODULES", "as_runs", "residual", "detach", "abs_sum", "diff_abs_sum", "dot"]
