"""What every plan search shares: the calibration set, the plan template of a model, FLOP costs, evaluation.

A search never imports the evaluation or pipeline layers: the caller hands it a `Calibration`, i.e. the pipeline,
a `generate()` callable that runs the calibration inputs through it (fresh, seeded generators on every call, so
two calls give bit-identical images) and a `quality_fn(images, reference) -> float` (higher is better). The
search applies plans with `dcache.apply`, calls `generate()`, and removes the handle again.

Cost is counted, not guessed: one all-compute MODULE-granularity generation runs under torch's FlopCounterMode
(the engine's FlopBook), which gives the FLOPs of every block and of every inner module at the calibration shapes.
The cost of a plan is then

    compute_ratio = sum_calls sum_blocks (block cost if the block runs, minus the cost of the modules it reuses)
                    / sum_calls sum_blocks block cost

for stack, block and module plans alike, so plans of different granularity compare on one axis.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

import dcache
from dcache.actions import Action, Granularity
from dcache.generations.health import quiet
from dcache.model.adapters import reuse_composed_inputs
from dcache.files.atomic import atomic_write_text, atomic_write_with, check_inside
from dcache.plans.plan import KEYFRAMES, Plan

from ..profiling import TrackSchedule

QualityFn = Callable[[torch.Tensor, torch.Tensor], float]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], dict]


@dataclass
class Calibration:
    """The calibration set of a search, as callables (the search layer knows no pipeline internals).

    pipe:       a diffusers pipeline (or anything `dcache.apply` accepts) that `generate` runs.
    generate:   () -> images tensor of the whole calibration set; must be deterministic (seeded inside).
    quality_fn: (images, reference images) -> float, higher is better (e.g. PSNR to the uncached images).
    metrics_fn: optional (images, reference) -> dict of extra numbers to report (e.g. classifier accuracy).
    settings:   what the calibration set is (prompts, seed, steps, guidance ...); JSON values, recorded in the
                provenance of every plan the search writes.
    fit_runs:   callables a fitted forecaster (L2P) is fitted on: the same kind of inputs as `generate` at other
                seeds, so the ridge and the forecaster a search keeps are chosen on samples the fit never saw.
                Empty: fitted on `generate` itself, and every score of a fitted forecaster is in-sample (optimistic).
    """

    pipe: Any
    generate: Callable[[], torch.Tensor]
    quality_fn: QualityFn
    metrics_fn: MetricsFn | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    fit_runs: list[Callable[[], Any]] = field(default_factory=list)
    _reference: torch.Tensor | None = field(default=None, repr=False)

    def reference(self) -> torch.Tensor:
        """The uncached images of the calibration set (computed once)."""
        if self._reference is None:
            with torch.no_grad():
                self._reference = self.generate().detach().float().cpu()
        return self._reference


class _AllCompute(TrackSchedule):
    """profiling's all-compute, cache-free schedule at module granularity (the template sees every unit)."""

    granularity = Granularity.MODULE
    name = "search-template"


@dataclass
class Template:
    """Model layout, branches, steps and FLOP costs of one calibration generation; makes Plans for this model."""

    header: dict[str, Any]  # model_class, block_layout, scheduler, resolution
    num_steps: int
    branches: list[str]
    module_units: list[str]  # "b3.attn", ... in MODULE unit order
    module_block: list[int]  # block index of each module unit
    block_cost: list[float]  # FLOPs of each block per call (all branches have the same shapes in split CFG)
    module_cost: list[float]  # FLOPs of each module unit per call
    composed: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (unit, input units), see Adapter
    calibration: dict[str, Any] = field(default_factory=dict)  # Calibration.settings, into every plan's provenance

    @property
    def num_blocks(self) -> int:
        return len(self.block_cost)

    def units(self, granularity: Granularity | str) -> list[str]:
        g = Granularity(granularity)
        if g is Granularity.STACK:
            return ["stack"]
        if g is Granularity.BLOCK:
            return [f"b{i}" for i in range(self.num_blocks)]
        return list(self.module_units)

    def plan(self, granularity: Granularity | str, rows: Sequence[str] | dict[str, Sequence[str]], *,
             method: str, config: dict | None = None, extras: dict | None = None,
             quality: dict | None = None) -> Plan:
        """A Plan with `rows` (one per step) for every branch, or per branch when a dict is given."""
        actions = ({b: list(r) for b, r in rows.items()} if isinstance(rows, dict)
                   else {b: list(rows) for b in self.branches})
        if Granularity(granularity) is Granularity.MODULE and self.composed:  # rows as the engine executes them
            actions = {b: [reuse_composed_inputs(r, self.composed) for r in rs] for b, rs in actions.items()}
        import time

        return Plan(granularity=Granularity(granularity).value, units=self.units(granularity),
                    num_steps=self.num_steps, actions=actions, extras=extras or {},
                    provenance={"method": method, "config": config or {}, "quality": quality or {},
                                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                **({"calibration": self.calibration} if self.calibration else {})},
                    **self.header)

    # -------------------------------------------------------------------------------------------- cost
    def row_cost(self, plan: Plan, row: str) -> float:
        g = Granularity(plan.granularity)
        if g is Granularity.STACK:
            if row[0] == Action.COMPUTE.value:
                return sum(self.block_cost)
            n = self.num_blocks
            kept = [i for i in range(n) if i < plan.probe_blocks or i >= n - plan.tail_blocks]
            return sum(self.block_cost[i] for i in kept)
        if g is Granularity.BLOCK:
            return sum(c for c, a in zip(self.block_cost, row) if a == Action.COMPUTE.value)
        skipped = sum(c for c, a in zip(self.module_cost, row) if a != Action.COMPUTE.value)
        return sum(self.block_cost) - skipped

    def compute_ratio(self, plan: Plan) -> float:
        """Block FLOPs a replay of `plan` computes / block FLOPs of the uncached generation."""
        total = computed = 0.0
        for branch in self.branches:
            rows = plan._rows_for(branch)
            for row in rows:
                total += sum(self.block_cost)
                computed += self.row_cost(plan, row)
        return computed / total if total > 0 else 1.0

    def to_dict(self) -> dict:
        return dict(header=self.header, num_steps=self.num_steps, branches=self.branches,
                    module_units=self.module_units, module_block=self.module_block,
                    block_cost=self.block_cost, module_cost=self.module_cost, composed=self.composed,
                    calibration=self.calibration)


def make_template(calib: Calibration) -> Template:
    """Run one all-compute MODULE generation with FLOP counting: layout, branches, steps and per-unit FLOPs."""
    handle = dcache.apply(calib.pipe, _AllCompute(), count_flops=True)
    try:
        with torch.no_grad():
            calib.generate()
        eng = handle.engine
        rec = eng.record
        plan = handle.plan()
        header = dict(model_class=plan.model_class, block_layout=plan.block_layout, scheduler=plan.scheduler,
                      resolution=plan.resolution)
        pairs = [(s.index, m) for s in eng.blocks for m in s.modules]
        costs = eng.flops.costs
        block_cost = [_last_cost(costs, s.index) for s in eng.blocks]
        module_cost = [_last_cost(costs, ("m", u)) for u in range(len(pairs))]
        branches = list(dict.fromkeys(c.branch for c in rec.calls))  # in call order within a step
        return Template(header=header, num_steps=plan.num_steps, branches=branches,
                        module_units=[f"b{b}.{m}" for b, m in pairs], module_block=[b for b, _ in pairs],
                        block_cost=block_cost, module_cost=module_cost, composed=list(eng.composed_units),
                        calibration=dict(calib.settings))
    finally:
        handle.remove()


def _last_cost(costs: dict, unit: Any) -> float:
    found = [v for (u, _shape), v in costs.items() if u == unit]
    if not found:
        raise RuntimeError(f"no FLOP count for unit {unit!r}; the calibration generation did not run it.")
    return float(found[-1])


# ------------------------------------------------------------------------------------------------ evaluation
@dataclass
class Measured:
    quality: float
    compute_ratio: float
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"quality": self.quality, "compute_ratio": self.compute_ratio, "metrics": self.metrics}


def run_plan(calib: Calibration, plan: Plan | None) -> torch.Tensor:
    """Images of the calibration set with `plan` replayed (None: uncached)."""
    if plan is None:
        return calib.reference()
    handle = dcache.apply(calib.pipe, plan, count_flops=False)
    with quiet():  # a search replays plans that reuse almost everything on purpose
        try:
            with torch.no_grad():
                return calib.generate().detach().float().cpu()
        finally:
            handle.remove()


def measure(calib: Calibration, template: Template, plan: Plan) -> Measured:
    images = run_plan(calib, plan)
    ref = calib.reference()
    quality = float(calib.quality_fn(images, ref))
    if not math.isfinite(quality):
        quality = -1e9 if quality != float("inf") else 1e9
    metrics = dict(calib.metrics_fn(images, ref)) if calib.metrics_fn is not None else {}
    return Measured(quality, template.compute_ratio(plan), metrics)


def distributed_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """[fn(x) for x in items], split over the processes of an `accelerate launch` (one process: the same path).

    Process r evaluates items r, r + W, r + 2W, ...; the results are gathered so every process gets all of them.
    """
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState()
    world, rank = state.num_processes, state.process_index
    mine = [(i, fn(items[i])) for i in range(rank, len(items), world)]
    gathered = gather_object([mine]) if world > 1 else [mine]
    out: list[Any] = [None] * len(items)
    for part in gathered:
        for i, value in part:
            out[i] = value
    return out


def is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


# ------------------------------------------------------------------------------------------------ model outputs
def first_output(output: Any) -> torch.Tensor:
    """The prediction in a transformer's return value (a tensor, a tuple/list, or a diffusers output's `.sample`)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    return output.sample


def replace_first_output(output: Any, value: torch.Tensor) -> Any:
    """`output` with its prediction replaced by `value` (same container type)."""
    if isinstance(output, torch.Tensor):
        return value
    if isinstance(output, tuple):
        return (value,) + tuple(output[1:])
    if isinstance(output, list):
        return [value] + list(output[1:])
    output.sample = value
    return output


# ------------------------------------------------------------------------------------------------ Pareto
def pareto_mask(quality: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Non-dominated points for (maximise quality, minimise cost); ties keep the first occurrence."""
    n = len(quality)
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        better_eq = (quality >= quality[i]) & (cost <= cost[i])
        strictly = (quality > quality[i]) | (cost < cost[i])
        dominated = better_eq & strictly
        dup = (quality == quality[i]) & (cost == cost[i]) & (np.arange(n) < i)
        if dominated.any() or dup.any():
            keep[i] = False
    return keep


def convert_rows(plan: Plan, template: Template, granularity: Granularity | str,
                 branch: str | None = None) -> list[str]:
    """Rows of `plan` (any granularity) expressed at a finer granularity: a reused stack/block reuses its modules.

    FORECAST becomes REUSE. Used to seed module-level searches with step- and block-level schedules.
    """
    g = Granularity(granularity)
    src = Granularity(plan.granularity)
    rows = plan._rows_for(branch or template.branches[0])
    n = template.num_blocks
    out = []
    for row in rows:
        if src is Granularity.STACK:
            reused = row[0] != Action.COMPUTE.value
            blocks = ["R" if reused and plan.probe_blocks <= i < n - plan.tail_blocks else "C" for i in range(n)]
        elif src is Granularity.BLOCK:
            blocks = ["C" if a == Action.COMPUTE.value else "R" for a in row]
        else:
            if g is not Granularity.MODULE:
                raise ValueError("a module plan cannot be expressed at a coarser granularity.")
            out.append("".join("C" if a == Action.COMPUTE.value else "R" for a in row))
            continue
        if g is Granularity.BLOCK:
            out.append("".join(blocks))
        elif g is Granularity.MODULE:
            out.append("".join(blocks[b] for b in template.module_block))
        else:
            out.append("C" if all(a == "C" for a in blocks) else "R")
    return out


# ------------------------------------------------------------------------------------------------ output
def write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=1, default=_json_default))


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


@dataclass
class FrontPoint:
    name: str
    plan: Plan
    measured: Measured
    path: str | None = None


def transfer_mode(plan: Plan) -> bool | str:
    """How a searched plan replays at other step counts: a plan that forecasts places its computed steps in
    normalised time ("keyframes": the gaps between computes scale with the step count, so the Taylor differences
    keep the spacing they were searched with; nearest-step replay repeats computed rows and collapses, 15-29 dB on
    the bundled model at 10 and 50 steps against 36-48 dB); a plan that only reuses keeps its compute ratio with the
    nearest planned step (True)."""
    forecasts = any(Action.FORECAST.value in row for rows in plan.actions.values() for row in rows)
    return KEYFRAMES if forecasts else True


def write_front(out_dir: str | Path, method: str, points: list[FrontPoint], *, others: list[dict] | None = None,
                config: dict | None = None, title: str | None = None) -> dict:
    """Save each plan (with its measured quality in the provenance), front.json, front.png and summary.md."""
    out = Path(out_dir)
    # a `plans` folder linked out of the output folder would receive the plans elsewhere
    check_inside(out, "plans", "the plans folder", f"remove the link {out / 'plans'} or pass a new --out").mkdir(
        parents=True, exist_ok=True)
    if not is_main_process():
        return {}
    rows = []
    for p in sorted(points, key=lambda p: p.measured.compute_ratio):
        p.plan.provenance["quality"] = p.measured.to_dict()
        if p.plan.interpolate_steps is False:
            p.plan.interpolate_steps = transfer_mode(p.plan)
        path = out / "plans" / f"{p.name}.plan.json"
        p.plan.save(path)
        p.path = str(path.relative_to(out))
        rows.append({"name": p.name, "plan": p.path, **p.measured.to_dict()})
    front = {"format": "dcache.front", "version": 1, "method": method, "config": config or {},
             "objectives": {"quality": "maximise (calibration quality_fn)", "compute_ratio": "minimise (block FLOPs)"},
             "points": rows, "evaluated": others or []}
    write_json(out / "front.json", front)
    _plot(out / "front.png", method, rows, others or [], title)
    # what the calibration's quality_fn measures, as its settings name it (Calibration.settings["quality"])
    quality = next((p.plan.provenance.get("calibration", {}).get("quality") for p in points), None)
    lines = [f"# {method} search", "", f"{len(rows)} plans on the front. Quality: "
             f"{quality or 'the calibration quality_fn'} on the calibration set; compute ratio: block FLOPs "
             f"computed / uncached.", "",
             "| plan | compute ratio | ideal speed-up | quality | metrics |", "|---|---|---|---|---|"]
    for r in rows:
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items())
        lines.append(f"| `{r['plan']}` | {r['compute_ratio']:.3f} | {1 / max(r['compute_ratio'], 1e-9):.2f}x | "
                     f"{r['quality']:.4g} | {metrics} |")
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    return front


def _plot(path: Path, method: str, rows: list[dict], others: list[dict], title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    if others:
        ax.scatter([o["compute_ratio"] for o in others], [o["quality"] for o in others], s=8, c="0.7",
                   label="evaluated")
    ax.plot([r["compute_ratio"] for r in rows], [r["quality"] for r in rows], "o-", c="C0", label=f"{method} front")
    ax.set_xlabel("compute ratio (block FLOPs)")
    ax.set_ylabel("quality")
    ax.set_title(title or f"{method} Pareto front")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        atomic_write_with(path, fig.savefig)  # front.png: never half-written either
    finally:
        plt.close(fig)
