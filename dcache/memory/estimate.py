"""Know a method's cache memory and FLOPs before the run: the engine's own accounting on meta tensors.

    est = dcache.memory.estimate.estimate(transformer, "taylorseer", inputs, branches=("cond", "uncond"), num_steps=28)
    est.memory.peak_bytes, est.memory.by_kind, est.flops_per_call, est.ratio_floor

How: the transformer is rebuilt from its config on the meta device (no weights, no memory), the method is attached to
it by the engine factory `dcache.apply` uses (dcache.api.engine_factory.attach; a stand-in scheduler opens the
generation), and one call per branch runs on meta tensors of the real shapes. A branch's first call always computes
every unit, and it allocates every cached tensor with the shapes it keeps for the generation (dcache.memory.report),
so the bytes summed after it are the peak a real run reaches; `handle.memory()` of a real run reports the same numbers
(tests/memory). FLOPs come from the engine's FlopBook, counted by torch's FlopCounterMode on the meta forward.
Each op's output metadata is remembered on the model (dcache.memory.meta_ops): the 40 identical blocks of a large
transformer, and every method estimated after the first, run ~5x faster than torch's Python meta kernels.

Compute ratio without content: `simulate_ratio` replays the schedule's `decide` over every step and branch with
every change signal reading "no change" (relative changes 0, norm ratios 1) and prices each row with the counted
per-unit FLOPs. For a schedule driven by signals that is the lowest ratio its structural knobs allow (warm-up,
cutoff, maximum consecutive reuse, probe / tail blocks): what a threshold at the top of its range reaches. For a
schedule driven by tables or intervals (calibrated MagCache, FORA, fixed-interval, plans) it is the ratio itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..api.engine_factory import attach
from ..compat.torch import tree_map
from .cache_codec import cache_codec
from .meta_ops import MetaOpMemo
from .report import MemoryReport
from ..methods import DEFAULT_METHOD, preset_scope
from ..schedule import CallContext, GenerationInfo, Schedule, normalize_actions
from ..api.setup_file import setup_file
from ..runtime.engine import Engine
from ..runtime.signal_providers import provider, providers_for, resolve_signal

# What each signal reads when consecutive calls are (nearly) identical is its provider's `quiet`: changes a vanishing
# 1e-9 rather than 0, so that ratios of changes (EasyCache's k = output change / input change) stay defined; norm
# ratios and means 1.


class _StandInScheduler:
    """Drives one generation as a diffusers scheduler would: the engine wraps these two methods on the instance."""

    def __init__(self) -> None:
        self.timesteps: torch.Tensor | None = None

    def set_timesteps(self, num_inference_steps: int, device: Any = None) -> None:
        # timesteps 1000 -> 1000/n (flow matching); only their count and order matter to a schedule
        self.timesteps = torch.linspace(1000.0, 1000.0 / num_inference_steps, num_inference_steps)

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None


class _StandInPipeline:
    def __init__(self, transformer: nn.Module) -> None:
        self.transformer = transformer
        self.scheduler = _StandInScheduler()


def meta_model(model_or_class: Any, config: dict | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The transformer rebuilt from its config on the meta device: every parameter and buffer has its real shape
    and dtype and no storage. `model_or_class`: a model (its class and `.config` are used) or a diffusers class
    with `config` (a config.json dict)."""
    cls = type(model_or_class) if isinstance(model_or_class, nn.Module) else model_or_class
    if config is None:
        config = dict(model_or_class.config)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"), _quiet_diffusers():  # published configs carry fields a class ignores (warned)
        model = cls.from_config(config)
    if dtype is None and isinstance(model_or_class, nn.Module):
        dtype = next((p.dtype for p in model_or_class.parameters() if p.is_floating_point()), None)
    if dtype is not None and dtype != torch.float32:
        with _quiet_diffusers():  # a cast of a meta model: its warning about fp32-kept modules does not apply
            model = model.to(dtype)
    return model.eval()


@contextlib.contextmanager
def _quiet_diffusers():
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def to_meta(inputs: Any) -> Any:
    """Every tensor of a (nested) call-argument structure as a meta tensor of the same shape and dtype."""
    return tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, inputs)


@dataclass
class CacheEstimate:
    method: str
    granularity: str
    scope: str
    forecast_order: int
    units: int
    num_steps: int
    memory: MemoryReport
    flops_per_call: dict[str, float]  # branch -> FLOPs of one computed call (blocks; call scope: the whole call)
    ratio_floor: float | None  # simulate_ratio of the configured method (None: its decide needs real signals)
    ratio_ceiling: float | None  # every call computed, signal probes included (can exceed 1.0 by the probes)
    notes: list[str] = field(default_factory=list)
    ratio_sweep: list[tuple[Any, float]] = field(default_factory=list)  # (knob value, simulate_ratio) per value

    @property
    def ratio_range(self) -> tuple[float, float] | None:
        """(lowest, highest) compute ratio over the configured method and the swept knob values."""
        lows = [r for _, r in self.ratio_sweep] + ([self.ratio_floor] if self.ratio_floor is not None else [])
        if not lows or self.ratio_ceiling is None:
            return None
        return min(lows), max(self.ratio_ceiling, *lows)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "granularity": self.granularity, "scope": self.scope,
                "forecast_order": self.forecast_order, "units": self.units, "num_steps": self.num_steps,
                "memory": self.memory.to_dict(), "flops_per_call": self.flops_per_call,
                "ratio_floor": self.ratio_floor, "ratio_ceiling": self.ratio_ceiling, "ratio_range": self.ratio_range,
                "ratio_sweep": self.ratio_sweep, "notes": self.notes}


def estimate(model: nn.Module, method: Any = DEFAULT_METHOD, inputs: dict | None = None, *,
             branches: Sequence[str | None] = ("cond", "uncond"), num_steps: int = 28, scope: str | None = None,
             sweep: tuple[str, Sequence[Any]] | None = None, cache_dtype: Any = None, cache_scale: Any = None,
             cache_device: Any = None, memory_only: bool = False, **overrides: Any) -> CacheEstimate:
    """Cache memory and FLOPs of `method` on `model` for transformer calls shaped like `inputs` (forward kwargs).

    model:    a transformer (real or meta; a real one is rebuilt on the meta device from its config).
    branches: one transformer call per branch and step, named as diffusers' cache_context names them ("cond",
              "uncond"; a pipeline with batched CFG has one branch of twice the batch); None entries are named by
              call order ("call0", "call1", ...) as for pipelines that set no cache context.
    sweep:    (knob, values): also simulate the compute ratio of the method name with each value of that config
              field (e.g. a threshold grid), for the range its knob reaches.
    cache_dtype / cache_scale: a low-precision cache, as for dcache.apply (its stored bytes are counted).
    cache_device: an offloaded cache ("cpu"): the same bytes, reported as held in host memory.
    memory_only: the memory report alone (no FLOP counting, no compute-ratio simulation: several times faster; the
              budget's check at a first call uses it).
    overrides: config fields, as for dcache.apply.
    """
    if inputs is None:
        raise ValueError("estimate needs `inputs`: the transformer's forward keyword arguments for one call (real "
                         "or meta tensors of the real shapes), e.g. from dcache.pipelines.estimate.model_inputs.")
    meta = model if _on_meta(model) else meta_model(model)
    kwargs = to_meta(inputs)
    pipe = _StandInPipeline(meta)
    cache_codec(cache_dtype, cache_scale, cache_device)  # the field errors apply would give
    setup = setup_file(method)
    if setup is not None:  # a setup file: its method, knobs and scope, under the ones given here
        method, overrides, scope = setup.method, {**setup.knobs, **overrides}, scope or setup.scope
    if scope is None:
        scope = preset_scope(method)  # a preset that names its scope (the default runs whole calls)
    # meta tensors cannot be copied to the host: count the bytes on the meta device, report them where they will live
    handle = attach(pipe, meta, method, overrides, decisions="batch", scope=scope,
                    cache_codec=cache_codec(cache_dtype, cache_scale, None), count_flops=not memory_only)
    engine = handle.engine
    if engine.adapter.latents is not None:  # latent layouts read grid sizes off position ids: give them the real ones
        engine.adapter = dataclasses.replace(engine.adapter, latents=_with_real_inputs(engine.adapter.latents, inputs))
    try:
        pipe.scheduler.set_timesteps(num_steps)
        for name in branches:
            context = meta.cache_context(name) if name is not None and hasattr(meta, "cache_context") \
                else contextlib.nullcontext()
            with context, torch.no_grad(), MetaOpMemo.for_model(meta):  # ops seen before: outputs remembered
                try:
                    meta(**kwargs)
                except (RuntimeError, NotImplementedError) as exc:  # .item(), bincount, autocast: need values
                    raise ValueError(
                        f"{type(meta).__name__}'s forward cannot run on meta tensors ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160]}): it reads tensor values, not only shapes, so its cache "
                        f"cannot be estimated without weights. Measure it instead: run one generation and read "
                        f"handle.memory().") from None
        report = handle.memory()
        if cache_device is not None:
            report = dataclasses.replace(report, cache_device=str(cache_device))
        calls = engine.record.calls if engine.record is not None else []
        flops = {c.branch: float(c.flops_total) for c in calls}
        branch_names = [c.branch for c in calls]
        notes: list[str] = []
        floor = ceiling = None
        swept: list[tuple[Any, float]] = []
        if memory_only:
            notes.append("memory only: FLOPs and compute ratios not counted")
        else:
            try:
                floor = simulate_ratio(engine, engine.schedule, num_steps, branch_names)
            except Exception as exc:  # a decide that needs a signal value no "no change" reading satisfies
                notes.append(f"compute ratio floor not simulated: {type(exc).__name__}: {exc}")
            ceiling = simulate_ratio(engine, _AllCompute(engine.schedule), num_steps, branch_names)
            swept = _sweep(engine, meta, method, sweep, overrides, num_steps, branch_names, notes) if sweep else []
    finally:
        for bstate in engine.branches.values():
            bstate.pending_post = {}  # measured on meta tensors: no value to read back at removal
        handle.remove()
    return CacheEstimate(method=handle.method, granularity=engine.granularity.value, scope=engine.scope,
                         forecast_order=engine.order, units=len(engine.units), num_steps=num_steps, memory=report,
                         flops_per_call=flops, ratio_floor=floor, ratio_ceiling=ceiling, notes=notes,
                         ratio_sweep=swept)


def _sweep(engine: Engine, meta: nn.Module, method: Any, sweep: tuple[str, Sequence[Any]], overrides: dict,
           num_steps: int, branches: Sequence[str], notes: list[str]) -> list[tuple[Any, float]]:
    from ..methods import config_for

    knob, values = sweep
    out = []
    for value in values:
        try:
            schedule = config_for(method, **{**overrides, knob: value}).build(meta)
            out.append((value, simulate_ratio(engine, schedule, num_steps, branches)))
        except Exception as exc:  # noqa: BLE001 - reported, the estimate itself stands
            notes.append(f"{knob}={value!r} not simulated: {type(exc).__name__}: {exc}")
    return out


def _with_real_inputs(latents_fn: Any, inputs: dict) -> Any:
    """The adapter's latents fn with the caller's own (non-meta) tensors in place of their meta copies: a grid size
    read off `img_ids` needs values, the latents themselves only shapes."""
    real = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}

    def latents(arguments: dict) -> Any:
        return latents_fn({k: real.get(k, v) if k != "hidden_states" else v for k, v in arguments.items()})

    return latents


def _on_meta(model: nn.Module) -> bool:
    p = next(iter(model.parameters()), None)
    return p is not None and p.device.type == "meta"


class _AllCompute(Schedule):
    """The ceiling: `schedule`'s signals (their probes cost FLOPs) with every unit computed."""

    def __init__(self, schedule: Schedule) -> None:
        self.signals = schedule.signals
        self.granularity = schedule.granularity

    def decide(self, ctx: CallContext) -> str:
        return "C"


def simulate_ratio(engine: Engine, schedule: Schedule, num_steps: int, branches: Sequence[str]) -> float:
    """Compute ratio of `schedule` over a generation of `num_steps` steps x `branches` calls per step, with every
    signal reading "no change" (see the module docstring), priced with the FLOPs `engine` counted on its first call.

    Per call: total = sum of block FLOPs (call scope: the call's); computed =
      stack:  total if the stack unit computes, else the probe and tail blocks;
      block:  the computing blocks;   module: total minus the modules not computed;   call: total or 0;
    plus the work of the signals that run part of the model (MODULATED_REL_L1's modulated-input probe: a provider's
    `compute` key in the FLOP book), as the engine counts it.
    A branch's first call computes everything (nothing is cached yet), as do units the schedule never reuses."""
    book = engine.flops.by_unit
    if engine.call_scope:
        total = book.get("call", 0.0)
    else:
        total = sum(book.get(s.index, 0.0) for s in engine.blocks)
    if total <= 0:
        raise ValueError("no FLOPs were counted on the first call (count_flops=False?)")
    wanted = frozenset(resolve_signal(s) for s in schedule.signals)
    probe = sum((book.get(p.compute, 0.0) for p in providers_for(wanted) if p.compute is not None), 0.0)
    always = sum(book.get(s.index, 0.0) for s in engine.blocks if s.role != "middle")
    n_units = len(engine.units)
    timesteps = tuple(1000.0 - 1000.0 * i / num_steps for i in range(num_steps))
    schedule.reset(GenerationInfo(num_steps=num_steps, timesteps=timesteps, units=engine.units,
                                  model_class=type(engine.transformer).__name__, num_blocks=len(engine.blocks)))
    quiet = {s: provider(s).quiet for s in wanted}
    last: dict[str, int | None] = {}
    spent = 0.0
    calls = 0
    for step in range(num_steps):
        for i, branch in enumerate(branches):
            ctx = CallContext(step=step, num_steps=num_steps, branch=branch, call_index=step * len(branches) + i,
                              timestep=timesteps[step], signals=dict(quiet) if step else {},
                              last_compute_step=last.get(branch))
            row = normalize_actions(schedule.decide(ctx), n_units)
            if step == 0:
                row = "C" * n_units
            row = "".join(a if a == "C" or schedule.may_reuse(branch, u) else "C" for u, a in enumerate(row))
            if row == "C" * n_units:
                last[branch] = step
            spent += probe + _row_flops(engine, row, total, always, book)
            calls += 1
    return spent / (total * calls)


def _row_flops(engine: Engine, row: str, total: float, always: float, book: dict) -> float:
    granularity = engine.granularity.value
    if engine.call_scope:
        return total if row[0] == "C" else 0.0
    if granularity == "stack":
        return total if row[0] == "C" else always
    if granularity == "block":
        return sum(book.get(s.index, 0.0) for s, a in zip(engine.blocks, row) if a == "C")
    skipped = sum(book.get(("m", u), 0.0) for u, a in enumerate(row) if a != "C")
    return total - skipped
