"""What `dcache.apply` returns: stats, the plan actually taken, and a clean removal."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from ..runtime.engine import Engine
from ..memory.report import MemoryReport, combine_reports, engine_report
from ..plans.plan import Plan
from ..generations.records import GenerationRecord
from ..generations.stats import Stats, combine_stats, stats_from_lanes, stats_from_record

if TYPE_CHECKING:  # dcache.apply(budget=...) attaches one
    from ..memory.budget import BudgetCheck


class Handle:
    def __init__(self, engine: Engine, method: str, config: dict, target: Any = None,
                 setup: Callable[[], Any] | None = None):
        self._engine = engine
        self._setup = setup  # builds the dcache.api.setup_file.Setup of the arguments apply was given
        self.method = method
        self.config = config
        self.target = target  # dcache.apply(speed= / quality=): the sweep that chose the config (TargetResult)
        self.experts: dict[str, Handle] = {}  # the pipeline's other denoising transformers (dcache.api.experts)
        self.controlnets: dict[str, Any] = {}  # cached ControlNet models (dcache.api.controlnet)
        self.fit_choice: str | None = None  # max_cache_memory with fit="auto": the cache storage it switched to
        self._budget: BudgetCheck | None = None  # the memory budget's check, attach_budget
        self._removed = False

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def removed(self) -> bool:
        return self._removed

    def stats(self, expert: str | None = None) -> Stats:
        """Stats of the last generation (units, ideal speed-up, cache memory). With several experts (Wan 2.2's
        transformer_2) or a cached ControlNet (dcache.api.controlnet): their sum, each model's own in `.experts`;
        stats(expert=name) is one model's ("transformer", "transformer_2", "controlnet", "controlnet.nets.0")."""
        if expert is not None:
            if expert in self.controlnets:
                return self.controlnets[expert].stats()
            return model_stats(self._expert(expert))
        if not self.experts and not self.controlnets:
            return model_stats(self)
        parts = {"transformer": model_stats(self), **{n: model_stats(h) for n, h in self.experts.items()},
                 **{n: c.stats() for n, c in self.controlnets.items()}}
        return combine_stats(parts)

    def _expert(self, name: str) -> "Handle":
        if name == "transformer":
            return self
        if name not in self.experts:
            raise ValueError(f"expert={name!r}: this handle caches {['transformer', *self.experts]}.")
        return self.experts[name]

    def requests(self, ids: Any) -> Any:
        """`with handle.requests(["a", "b", "c"]):` the transformer calls inside are batches of these requests, one
        id per row in row order (batched CFG: one per CFG half). With per-sample decisions each request keeps its
        own cache and step, so a serving loop may admit and retire requests between calls (continuous batching);
        a request whose id leaves the batch is finished and its cache freed. docs/serving.md."""
        lanes = self._engine.lanes
        if lanes is None:
            raise ValueError("handle.requests() names the requests of a batch for per-sample decisions, but this "
                             "handle was applied with decisions='batch' (the default); apply with "
                             "decisions='sample'.")
        return lanes.requests(ids)

    def loop(self, num_steps: int, timesteps: Any = None):
        """`with handle.loop(num_steps=N) as loop:` one generation of a denoising loop that is not a diffusers
        pipeline, with explicit signals: `loop.step(i)` before step i's transformer calls, `with loop.branch(name):`
        around each call of a split-CFG step. timesteps (optional, one per step) reach the schedule as a pipeline's
        would. dcache.api.custom_loop, docs/serving.md."""
        from .custom_loop import DenoisingLoop

        if self._removed:
            raise RuntimeError("handle.loop() on a removed handle: dcache.apply the transformer again first.")
        return DenoisingLoop((self._engine, *self._engine.followers), num_steps, timesteps)

    def memory(self, expert: str | None = None) -> MemoryReport:
        """Cache memory: peak and live bytes, and where they were (by unit kind and branch) in the last generation
        (dcache.memory.report.MemoryReport; `dcache estimate` predicts the same figures before a run). With several
        experts: their sum (each keeps its cache for the whole generation), each expert's report in `.experts`; a
        cached ControlNet's samples are one more part ("controlnet", kind "controlnet")."""
        if expert is not None:
            if expert in self.controlnets:
                return self.controlnets[expert].memory()
            return engine_report(self._expert(expert).engine)
        if not self.experts and not self.controlnets:
            return engine_report(self._engine)
        return combine_reports({"transformer": engine_report(self._engine),
                                **{n: engine_report(h.engine) for n, h in self.experts.items()},
                                **{n: c.memory() for n, c in self.controlnets.items()}})

    def plan(self, *, interpolate_steps: bool | str = False, quality: dict | None = None,
             expert: str | None = None) -> Plan:
        """The decisions of the last generation as a replayable static Plan (one expert's, for a pipeline with
        several: replay with dcache.apply(pipe, plan, experts={"transformer_2": plan_2})).

        interpolate_steps: how the plan replays at another step count: False (refused), True (the nearest planned
        step) or "keyframes" (each computed step once, at its place in normalised time: the form that keeps a
        forecasting plan's quality at other step counts)."""
        if expert is not None:
            return model_plan(self._expert(expert), interpolate_steps, quality, expert_steps=True)
        if self.experts:
            raise ValueError(f"this pipeline has several denoising transformers ({['transformer', *self.experts]}), "
                             f"each with its own decisions: ask for one, handle.plan(expert='transformer').")
        return model_plan(self, interpolate_steps, quality, expert_steps=False)

    def setup(self):
        """What this handle was applied with, as a dcache.api.setup_file.Setup: `handle.setup().save("setup.json")`
        writes a file that `dcache.apply(pipe, "setup.json")` and `dcache generate --cache setup.json` apply again
        (a speed= / quality= target is saved as the knobs it chose)."""
        if self._setup is None:
            raise RuntimeError("this handle was not made by dcache.apply, so it holds no setup; apply a method name "
                               "to get one.")
        return self._setup()

    def attach_budget(self, check: BudgetCheck) -> None:
        """Keep a memory budget's check with this handle (it reads the engine at each generation's first call);
        `check.remove()` unhooks it with the handle. dcache.apply(budget=...) attaches one."""
        if self._budget is not None:
            raise RuntimeError("this handle has a memory budget already; apply again with the budget you want.")
        self._budget = check

    def remove(self) -> None:
        """Unhook everything; the pipeline then produces bit-identical outputs to before `apply`."""
        if self._removed:
            raise RuntimeError("this dcache handle was already removed; call dcache.apply(...) again to re-enable "
                               "caching.")
        for cached in self.controlnets.values():  # their forwards are their own again
            cached.remove()
        for sub in self.experts.values():  # followers first: they leave the leader's scheduler hook
            if not sub.removed:
                sub.remove()
        self._engine.remove()
        if self._budget is not None:  # dcache.memory.budget's forward pre-hook
            self._budget.remove()
        if getattr(self._engine.transformer, "_dcache_engine", None) is self._engine:
            del self._engine.transformer._dcache_engine
        self._removed = True

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        if not self._removed:
            self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"<dcache.Handle {self.method} on {type(self._engine.transformer).__name__} ({state})>"


def lane_records(engine: Engine) -> list:
    """(request id, record) per sample when the last generation was batched with per-sample decisions
    (dcache.runtime.lanes), else []."""
    if engine.lanes is None or (engine.record is not None and engine.record.calls):
        return []
    return engine.lanes.records()


def model_stats(handle: Handle) -> Stats:
    """The stats of the handle's own transformer (no experts, no ControlNet)."""
    eng = handle.engine
    rec = eng.record if eng.record is not None and eng.record.calls else None
    common = dict(method=handle.method, granularity=eng.granularity.value, units_per_call=len(eng.units),
                  blocks_per_call=len(eng.blocks), cache_bytes=max(eng.peak_cache_bytes, eng.cache_bytes()),
                  health=eng.health.last.to_dict())
    lanes = lane_records(eng)
    if lanes:  # transformer-only lanes count their own generations (the engine's own count is the pipeline's)
        generations = max(eng.generations, *(lane.generations for lane in eng.lanes.lanes.values()))
        return stats_from_lanes(lanes, generations=generations, **common)
    return stats_from_record(rec, generations=eng.generations, **common)


def last_record(engine: Engine) -> GenerationRecord:
    """The last generation's record (per-sample decisions: the first sample's, with a warning)."""
    lanes = lane_records(engine)  # per-sample decisions: the plan is the first sample's
    if len(lanes) > 1:
        warnings.warn(f"the last generation decided each of its {len(lanes)} samples on its own "
                      f"(decisions='sample'); this plan holds the first sample's decisions, which another "
                      f"sample replayed with it does not reproduce. Record a plan from one sample run alone, or "
                      f"apply with decisions='batch' for one set of decisions over the batch.", UserWarning,
                      stacklevel=3)
    rec = lanes[0][1] if lanes else engine.record
    if rec is None or not rec.calls:
        raise RuntimeError("no generation has run through this handle yet; call the pipeline first, then ask "
                           "for stats() or plan().")
    return rec


def model_plan(handle: Handle, interpolate_steps: bool | str, quality: dict | None, expert_steps: bool) -> Plan:
    """The plan of the handle's own transformer (Handle.plan). expert_steps: the steps other experts run are
    recorded as COMPUTE, the active range in the plan's extras."""
    eng = handle.engine
    rec = last_record(eng)
    steps = max(c.step for c in rec.calls) + 1
    num_steps = rec.num_steps or steps
    actions: dict[str, list[str | None]] = {}
    for c in rec.calls:
        rows = actions.setdefault(c.branch, [None] * num_steps)
        if c.step < num_steps:
            rows[c.step] = c.actions
    active = None
    if expert_steps:  # an expert runs a range of steps: the others are never asked, recorded as COMPUTE
        first, last = min(c.step for c in rec.calls), max(c.step for c in rec.calls)
        active = [first, last + 1]
        for rows in actions.values():
            for i in [*range(first), *range(last + 1, num_steps)]:
                rows[i] = rows[i] or "C" * len(eng.units)
    for branch, rows in actions.items():
        if any(r is None for r in rows):
            missing = [i for i, r in enumerate(rows) if r is None]
            raise RuntimeError(f"the last generation did not finish (branch {branch!r} has no call at steps "
                               f"{missing[:5]}...); run a complete generation before exporting its plan.")
    layout = Counter(s.list_index for s in eng.blocks)
    extras = dict(getattr(eng.schedule, "plan_extras", lambda: {})())
    extras.pop("scope", None)  # a replayed plan's: this generation ran in eng.scope
    if active is not None:
        extras["expert_steps"] = active
    if eng.scope != "blocks":  # replays in the scope it was recorded in (dcache.apply reads it)
        extras["scope"] = eng.scope
    extras.pop("cfg_difference", None)
    if getattr(eng.schedule, "cfg_difference", False):  # replays serving uncond through the CFG difference
        extras["cfg_difference"] = True
    return Plan(
        model_class=type(eng.transformer).__name__,
        block_layout=[layout[i] for i in range(len(eng.adapter.block_lists))],
        granularity=eng.granularity.value, units=list(eng.units), num_steps=num_steps,
        actions=actions,  # type: ignore[arg-type]
        probe_blocks=eng.schedule.probe_blocks if eng.granularity.value == "stack" else 0,
        tail_blocks=eng.schedule.tail_blocks if eng.granularity.value == "stack" else 0,
        forecast_order=eng.order,
        scheduler=eng.scheduler_name,  # recorded when hooked: a removed handle still knows it
        resolution=list(rec.input_shape) if rec.input_shape else None,
        interpolate_steps=interpolate_steps,
        extras=extras,
        provenance={"method": handle.method, "config": handle.config, "scope": eng.scope, "quality": quality or {},
                    "created": rec.started},
    )
