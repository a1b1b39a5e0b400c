"""What a generation cost: units computed / reused / forecast per step and branch, and the ideal speed-up."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..actions import Action
from .records import GenerationRecord


@dataclass
class Stats:
    method: str
    granularity: str
    generations: int
    num_steps: int | None
    branches: list[str]
    calls: int
    units_per_call: int
    units_computed: int
    units_reused: int
    units_forecast: int
    calls_fully_computed: int  # calls where every unit ran ("steps computed")
    blocks_per_call: int
    block_flops_total: float  # block FLOPs an uncached generation would spend (call scope: the whole calls' FLOPs)
    block_flops_computed: float  # block FLOPs actually spent
    compute_ratio: float  # computed / total block FLOPs (1.0 = nothing saved; a signal's own compute, e.g.
    #                       TeaCache's modulated-input probe, counts as computed and can put it above 1)
    ideal_speedup: float  # 1 / compute_ratio
    cache_bytes: int  # peak bytes held by cached tensors
    per_step: list[dict[str, str]] = field(default_factory=list)  # per step: {branch: action row}
    experts: dict[str, "Stats"] = field(default_factory=dict)  # several denoising transformers: each one's own
    health: dict[str, Any] = field(default_factory=dict)  # the last finished generation's health facts
    # per-sample decisions of a batched generation (dcache.runtime.lanes): each sample's (each row's) own stats as a
    # dict, with its request id under "sample". Above, `calls` then counts batched calls, the units and FLOPs are
    # summed over the samples, and a per_step row has C where any sample computed the unit (what the batch computed)
    per_sample: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # experts become nested dicts

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def __str__(self) -> str:
        text = (f"dcache[{self.method}] {self.calls_fully_computed}/{self.calls} calls fully computed, units "
                f"{self.units_computed} computed / {self.units_reused} reused / {self.units_forecast} forecast; "
                f"compute ratio {self.compute_ratio:.3f} -> ideal speed-up {self.ideal_speedup:.2f}x; "
                f"cache {self.cache_bytes / 2**20:.2f} MiB")
        for name, part in self.experts.items():
            text += f"\n  {name}: " + str(part).split("] ", 1)[1]
        return text


def combine_stats(parts: dict[str, Stats]) -> Stats:
    """One generation's stats over several denoising transformers (experts): counts and FLOPs add up, the compute
    ratio is computed FLOPs / total FLOPs of all of them; per_step rows of later experts are keyed
    "<expert>/<branch>"."""
    first = next(iter(parts.values()))
    total = sum(p.block_flops_total for p in parts.values())
    computed = sum(p.block_flops_computed for p in parts.values())
    ratio = computed / total if total > 0 else 1.0
    per_step: list[dict[str, str]] = []
    for name, part in parts.items():
        for i, row in enumerate(part.per_step):
            while len(per_step) <= i:
                per_step.append({})
            per_step[i].update(row if part is first else {f"{name}/{b}": a for b, a in row.items()})
    methods = sorted({p.method for p in parts.values()})
    return Stats(
        method=first.method if len(methods) == 1 else "+".join(methods), granularity=first.granularity,
        generations=max(p.generations for p in parts.values()), num_steps=first.num_steps,
        branches=sorted({b for p in parts.values() for b in p.branches}),
        calls=sum(p.calls for p in parts.values()), units_per_call=first.units_per_call,
        units_computed=sum(p.units_computed for p in parts.values()),
        units_reused=sum(p.units_reused for p in parts.values()),
        units_forecast=sum(p.units_forecast for p in parts.values()),
        calls_fully_computed=sum(p.calls_fully_computed for p in parts.values()),
        blocks_per_call=first.blocks_per_call, block_flops_total=total, block_flops_computed=computed,
        compute_ratio=ratio, ideal_speedup=1.0 / ratio if ratio > 0 else float("inf"),
        cache_bytes=sum(p.cache_bytes for p in parts.values()), per_step=per_step, experts=dict(parts),
        health=dict(first.health))


# what a sample's own stats hold (the rest, such as the method, cache bytes and health, is the handle's)
_PER_SAMPLE = ("num_steps", "branches", "calls", "units_computed", "units_reused", "units_forecast",
               "calls_fully_computed", "block_flops_total", "block_flops_computed", "compute_ratio", "ideal_speedup",
               "per_step")


def _own(stats: Stats) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in _PER_SAMPLE}


def stats_from_lanes(lanes: list[tuple[Any, GenerationRecord]], **kwargs: Any) -> Stats:
    """Stats of a batched generation with per-sample decisions: `lanes` is (request id, its record) per sample; the
    totals are over every sample's calls, and `per_sample` holds each sample's own (kwargs: stats_from_record's)."""
    first = lanes[0][1]
    merged = GenerationRecord(num_steps=first.num_steps, timesteps=first.timesteps)
    merged.calls = [c for _, rec in lanes for c in rec.calls]
    stats = stats_from_record(merged, **kwargs)
    stats.per_sample = [{"sample": sample, **_own(stats_from_record(rec, **kwargs))} for sample, rec in lanes]
    stats.calls = max(s["calls"] for s in stats.per_sample)  # the batched calls (rows at other steps: the most)
    stats.calls_fully_computed = max(s["calls_fully_computed"] for s in stats.per_sample)
    compute = Action.COMPUTE.value
    per_step: list[dict[str, str]] = []
    for c in merged.calls:
        while len(per_step) <= c.step:
            per_step.append({})
        row = per_step[c.step].get(c.branch)
        per_step[c.step][c.branch] = c.actions if row is None else "".join(
            compute if compute in (a, b) else a for a, b in zip(row, c.actions))
    stats.per_step = per_step
    return stats


def stats_from_record(rec: GenerationRecord | None, *, method: str, granularity: str, generations: int,
                      units_per_call: int, blocks_per_call: int, cache_bytes: int,
                      health: dict[str, Any] | None = None) -> Stats:
    calls = rec.calls if rec is not None else []
    cells = "".join(c.actions for c in calls)
    total = sum(c.flops_total for c in calls)
    computed = sum(c.flops_computed for c in calls)
    if total <= 0:  # FLOP counting disabled: fall back to unit counts
        total, computed = float(len(cells)), float(cells.count(Action.COMPUTE.value))
    ratio = computed / total if total > 0 else 1.0
    per_step: list[dict[str, str]] = []
    for c in calls:
        while len(per_step) <= c.step:
            per_step.append({})
        per_step[c.step][c.branch] = c.actions
    return Stats(
        method=method, granularity=granularity, generations=generations,
        num_steps=rec.num_steps if rec is not None else None, branches=rec.branches() if rec is not None else [],
        calls=len(calls), units_per_call=units_per_call,
        units_computed=cells.count(Action.COMPUTE.value), units_reused=cells.count(Action.REUSE.value),
        units_forecast=cells.count(Action.FORECAST.value),
        calls_fully_computed=sum(set(c.actions) == {Action.COMPUTE.value} for c in calls),
        blocks_per_call=blocks_per_call, block_flops_total=total, block_flops_computed=computed,
        compute_ratio=ratio, ideal_speedup=1.0 / ratio if ratio > 0 else float("inf"),
        cache_bytes=cache_bytes, per_step=per_step, health=dict(health or {}))
