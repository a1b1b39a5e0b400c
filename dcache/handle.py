"""What `dcache.apply` returns: stats, the plan actually taken, and a clean removal."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from .engine import Engine
from .plan import Plan
from .stats import Stats, stats_from_record


class Handle:
    def __init__(self, engine: Engine, method: str, config: dict, target: Any = None):
        self._engine = engine
        self.method = method
        self.config = config
        self.target = target  # dcache.apply(speed= / quality=): the sweep that chose the config (TargetResult)
        self._removed = False

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def removed(self) -> bool:
        return self._removed

    def _record(self):
        rec = self._engine.record
        if rec is None or not rec.calls:
            raise RuntimeError("no generation has run through this handle yet; call the pipeline first, then ask "
                               "for stats() or plan().")
        return rec

    def stats(self) -> Stats:
        """Stats of the last generation (units, ideal speed-up, cache memory)."""
        eng = self._engine
        rec = eng.record if eng.record is not None and eng.record.calls else None
        return stats_from_record(rec, method=self.method, granularity=eng.granularity.value,
                                 generations=eng.generations, units_per_call=len(eng.units),
                                 blocks_per_call=len(eng.blocks),
                                 cache_bytes=max(eng.peak_cache_bytes, eng._cache_bytes()))

    def plan(self, *, interpolate_steps: bool = False, quality: dict | None = None) -> Plan:
        """The decisions of the last generation as a replayable static Plan."""
        rec = self._record()
        eng = self._engine
        steps = max(c.step for c in rec.calls) + 1
        num_steps = rec.num_steps or steps
        actions: dict[str, list[str | None]] = {}
        for c in rec.calls:
            rows = actions.setdefault(c.branch, [None] * num_steps)
            if c.step < num_steps:
                rows[c.step] = c.actions
        for branch, rows in actions.items():
            if any(r is None for r in rows):
                missing = [i for i, r in enumerate(rows) if r is None]
                raise RuntimeError(f"the last generation did not finish (branch {branch!r} has no call at steps "
                                   f"{missing[:5]}...); run a complete generation before exporting its plan.")
        layout = Counter(s.list_index for s in eng.blocks)
        extras = dict(getattr(eng.schedule, "plan_extras", lambda: {})())
        extras.pop("scope", None)  # a replayed plan's: this generation ran in eng.scope
        if eng.scope != "blocks":  # replays in the scope it was recorded in (dcache.apply reads it)
            extras["scope"] = eng.scope
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
            provenance={"method": self.method, "config": self.config, "scope": eng.scope, "quality": quality or {},
                        "created": time.strftime("%Y-%m-%dT%H:%M:%S")},
        )

    def remove(self) -> None:
        """Unhook everything; the pipeline then produces bit-identical outputs to before `apply`."""
        if self._removed:
            raise RuntimeError("this dcache handle was already removed; call dcache.apply(...) again to re-enable "
                               "caching.")
        self._engine.remove()
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
