"""Plans: the per-step x per-unit action table of a generation, as a versioned JSON file, and its replay.

File format (version 1):
{
  "format": "dcache.plan", "version": 1,
  "model_class": "FluxTransformer2DModel", "block_layout": [2, 6],      # blocks per block list
  "granularity": "stack", "units": ["stack"], "probe_blocks": 1, "tail_blocks": 0, "forecast_order": 0,
  "num_steps": 28, "scheduler": "FlowMatchEulerDiscreteScheduler", "resolution": [1, 64, 128],
  "interpolate_steps": false,                # another step count: false (refused), true (nearest step) or
                                             # "keyframes" (each computed step once, at its place in normalised time)
  "actions": {"cond": ["C", "R", ...], "uncond": [...]},   # one row per step, one character per unit
  "extras": {...},                           # method data (e.g. per-step coefficients)
  "provenance": {"method": ..., "config": ..., "quality": ..., "created": ...}
}
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..actions import ACTION_CHARS, Action, Granularity
from ..files.atomic import atomic_write_text, read_json  # atomic_write_text: re-exported
from ..runtime.cache_state import MAX_FORECAST_ORDER
from .extensions import PlanError  # defined below this module: the extension loaders raise it too
from ..schedule import CallContext, GenerationInfo, Schedule

PLAN_FORMAT = "dcache.plan"
PLAN_VERSION = 1
# The largest plan file read: action rows are steps x units characters per branch (1000 x 1000 = 1 MB), but a DisCa
# plan carries its predictor's weights as base64 (one net per cached tensor: ~0.75 GB for every tensor of a 12B
# model). A larger file is refused from its size, before it is read.
MAX_PLAN_BYTES = 1 << 30
# How to make a plan for the model at hand, for the errors of a plan that does not fit it
MAKE_A_PLAN = ("make a plan for this model: `dcache generate --model <model> --cache magcache` writes the run's "
               "plan.json (in Python: handle.plan().save('plan.json') after a cached generation), `dcache calibrate "
               "--model <model> --method bac` a profiled one, `dcache search --model <model> --method lemica` "
               "searched ones.")


REEXPORT = "re-export the plan (handle.plan().save(path) after a generation, or dcache calibrate / dcache search)"


@dataclass
class Plan:
    model_class: str
    block_layout: list[int]
    granularity: str
    units: list[str]
    num_steps: int
    actions: dict[str, list[str]]
    probe_blocks: int = 0
    tail_blocks: int = 0
    forecast_order: int = 0
    scheduler: str | None = None
    resolution: list[int] | None = None
    interpolate_steps: bool = False
    extras: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        # tuples (engine units, shapes) are stored as the lists JSON gives back, so save/load round-trips exactly
        for name in ("block_layout", "units", "resolution"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        if isinstance(self.actions, dict):
            self.actions = {b: list(rows) if isinstance(rows, tuple) else rows for b, rows in self.actions.items()}
        self.validate()

    # ------------------------------------------------------------------------------------------------ checks
    def validate(self) -> None:
        self._check_types()
        try:
            Granularity(self.granularity)
        except ValueError:
            raise PlanError(f"plan granularity {self.granularity!r:.40} is not one of "
                            f"{[g.value for g in Granularity]}; {REEXPORT}.") from None
        if self.num_steps < 1:
            raise PlanError(f"plan num_steps={self.num_steps} must be >= 1; {REEXPORT}.")
        self._check_bounds()
        if not self.actions:
            raise PlanError(f"plan has no action rows; {REEXPORT}.")
        for branch, rows in self.actions.items():
            if len(rows) != self.num_steps:
                raise PlanError(f"plan branch {branch!r:.40} has {len(rows)} rows but num_steps={self.num_steps}; "
                                f"the file is truncated or edited by hand: {REEXPORT}.")
            for i, row in enumerate(rows):
                bad = sorted(set(row) - ACTION_CHARS)
                if len(row) != len(self.units) or bad:
                    what = f"has the letters {bad}" if bad else f"has {len(row)} characters"
                    raise PlanError(f"plan branch {branch!r:.40} step {i}: row {row[:40]!r} {what}; a row must have "
                                    f"{len(self.units)} characters from 'C', 'R', 'F' (compute, reuse, forecast), "
                                    f"one per unit. Fix the row or {REEXPORT}.")
                if i == 0 and set(row) != {Action.COMPUTE.value}:
                    raise PlanError(f"plan branch {branch!r:.40}: step 0 must compute every unit (nothing is cached "
                                    f"yet), got {row[:40]!r}; make its row all 'C' or {REEXPORT}.")

    def _check_types(self) -> None:
        """Each field's JSON type, so that a corrupted or hand-edited file fails here, naming the field, and never
        later with a TypeError / KeyError deep inside a generation."""

        def count(v: Any) -> bool:
            return type(v) is int and v >= 0  # noqa: E721 - bool is not a count

        expected = {
            "model_class": (isinstance(self.model_class, str), "the transformer class name (a string)"),
            "block_layout": (isinstance(self.block_layout, list) and bool(self.block_layout)
                             and all(count(n) for n in self.block_layout), "a list of block counts (ints >= 0)"),
            "granularity": (isinstance(self.granularity, str), f"one of {[g.value for g in Granularity]}"),
            "units": (isinstance(self.units, list) and bool(self.units)
                      and all(isinstance(u, str) for u in self.units),
                      "a non-empty list of unit names (strings)"),
            "num_steps": (count(self.num_steps), "the number of denoising steps (an int >= 1)"),
            "actions": (isinstance(self.actions, dict) and all(
                isinstance(b, str) and isinstance(rows, list) and all(isinstance(r, str) for r in rows)
                for b, rows in self.actions.items()), 'a dict {branch: ["C...", ...]}, one string per step'),
            "probe_blocks": (count(self.probe_blocks), "an int >= 0"),
            "tail_blocks": (count(self.tail_blocks), "an int >= 0"),
            "forecast_order": (count(self.forecast_order), "an int >= 0"),
            "scheduler": (self.scheduler is None or isinstance(self.scheduler, str), "a scheduler class name or null"),
            "resolution": (self.resolution is None or (isinstance(self.resolution, list) and all(
                count(n) for n in self.resolution)), "a list of ints (the latent shape) or null"),
            "interpolate_steps": (isinstance(self.interpolate_steps, bool) or self.interpolate_steps == KEYFRAMES,
                                  f'true, false or "{KEYFRAMES}"'),
            "extras": (isinstance(self.extras, dict), "a JSON object"),
            "provenance": (isinstance(self.provenance, dict), "a JSON object"),
        }
        for name, (ok, what) in expected.items():
            if not ok:
                raise PlanError(f"plan field {name}={getattr(self, name)!r:.60} is invalid: it must be {what}. The "
                                f"file is corrupted or edited by hand; {REEXPORT}.")

    def _check_bounds(self) -> None:
        """Numbers that size what a replay allocates, bounded by the plan's own layout before anything is built:
        the Taylor tables hold forecast_order + 1 tensors per cached unit (state.MAX_FORECAST_ORDER), probe and
        tail blocks must leave a cached middle, and only STACK plans have them."""
        blocks = sum(self.block_layout)
        if self.forecast_order > MAX_FORECAST_ORDER:
            raise PlanError(f"plan field forecast_order={self.forecast_order} is out of range: it must be in "
                            f"0..{MAX_FORECAST_ORDER} (the Taylor order of forecast cells; each order keeps one more "
                            f"cached tensor per unit). Fix the field or {REEXPORT}.")
        if self.granularity != Granularity.STACK.value and (self.probe_blocks or self.tail_blocks):
            raise PlanError(f"plan fields probe_blocks={self.probe_blocks} / tail_blocks={self.tail_blocks} apply to "
                            f"stack plans only, this plan is {self.granularity}: set them to 0 or {REEXPORT}.")
        if self.probe_blocks + self.tail_blocks >= max(blocks, 1):
            raise PlanError(f"plan fields probe_blocks={self.probe_blocks} and tail_blocks={self.tail_blocks} leave "
                            f"no block to cache of the {blocks} in block_layout={self.block_layout}; their sum must "
                            f"be <= {max(blocks - 1, 0)}. Fix the fields or {REEXPORT}.")

    def check_model(self, model_class: str, block_layout: list[int], units: tuple[str, ...]) -> None:
        if model_class != self.model_class:
            raise PlanError(f"this plan was made for {self.model_class} but the model is {model_class}; "
                            f"{MAKE_A_PLAN}")
        if list(block_layout) != list(self.block_layout):
            raise PlanError(f"this plan expects block lists of sizes {self.block_layout} but the model has "
                            f"{list(block_layout)} (another variant of {model_class}); {MAKE_A_PLAN}")
        if tuple(units) != tuple(self.units):
            if len(units) != len(self.units):
                raise PlanError(f"this plan addresses {len(self.units)} units but the model exposes {len(units)} at "
                                f"{self.granularity} granularity; {MAKE_A_PLAN}")
            differ = [(i, mine, theirs) for i, (mine, theirs) in enumerate(zip(self.units, units)) if mine != theirs]
            shown = ", ".join(f"#{i}: plan {mine!r:.40} vs model {theirs!r:.40}" for i, mine, theirs in differ[:4])
            more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
            raise PlanError(f"this plan's units differ from the model's at {len(differ)} of {len(units)} places "
                            f"({shown}{more}); fix the unit names in the file, or {MAKE_A_PLAN}")

    # ------------------------------------------------------------------------------------------------ rows
    def row(self, step: int, branch: str, num_steps: int | None) -> str:
        rows = self._rows_for(branch)
        n = num_steps if num_steps is not None else self.num_steps
        if n != self.num_steps:
            if not self.interpolate_steps:
                raise PlanError(f"this plan was made for {self.num_steps} steps but the pipeline runs {n}; run with "
                                f"num_inference_steps={self.num_steps}, or save the plan with interpolate_steps=True "
                                f"(the nearest planned step) or interpolate_steps=\"{KEYFRAMES}\" (its computed "
                                f"steps at their place in normalised time).")
            rows = _interpolated(tuple(rows), n, self.interpolate_steps == KEYFRAMES)
        if step >= len(rows):
            raise PlanError(f"step {step} is past the plan's {len(rows)} steps; the pipeline ran more steps than "
                            f"planned (num_inference_steps={len(rows)} expected).")
        return rows[step]

    def _rows_for(self, branch: str) -> list[str]:
        if branch in self.actions:
            return self.actions[branch]
        if len(self.actions) == 1:  # a single-branch plan serves every branch
            return next(iter(self.actions.values()))
        raise PlanError(f"this plan has branches {sorted(self.actions)} but the call is branch {branch!r}; "
                        f"record the plan with the same guidance / CFG mode it is replayed with.")

    def compute_ratio(self) -> float:
        cells = [c for rows in self.actions.values() for row in rows for c in row]
        return sum(c == Action.COMPUTE.value for c in cells) / max(len(cells), 1)

    # ------------------------------------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"format": PLAN_FORMAT, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike) -> Path:
        return atomic_write_text(path, self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source} is not a dcache plan (missing \"format\": \"{PLAN_FORMAT}\"); {REEXPORT}.")
        version = data.get("version")
        if "version" not in data:
            raise PlanError(f"{source} has no \"version\" field (this dcache reads plan version {PLAN_VERSION}); "
                            f"add \"version\": {PLAN_VERSION} if it was written for it, else {REEXPORT}.")
        if type(version) is not int or version != PLAN_VERSION:  # noqa: E721 - true == 1 must not pass
            raise PlanError(f"{source} has plan version {version!r:.40}; this dcache reads version {PLAN_VERSION}. "
                            f"Upgrade dcache or re-export the plan.")
        fields = {k: v for k, v in data.items() if k != "format"}
        known = set(cls.__dataclass_fields__)
        unknown = set(fields) - known
        if unknown:
            raise PlanError(f"{source} has unknown fields {sorted(unknown, key=str)}; it was written by another "
                            f"version or edited by hand: remove them or {REEXPORT}.")
        required = [name for name, f in cls.__dataclass_fields__.items()
                    if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in fields]
        if missing:
            raise PlanError(f"{source} is incomplete: it has no {missing}; it is truncated or edited by hand: "
                            f"{REEXPORT}.")
        return cls(**fields)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise PlanError(f"plan file {str(path)!r} {what}; pass the path of a file written by Plan.save.")
        data = read_json(path, MAX_PLAN_BYTES, "plan file", "re-export it", PlanError)
        return cls.from_dict(data, source=f"plan file {str(path)!r}")


def nearest_interp(rows: list[Any], n: int) -> list[Any]:
    """MagCache's nearest interpolation: idx = round(arange(n) * (len-1)/(n-1)); n == 1 keeps the last entry."""
    if n == 1:
        return [rows[-1]]
    scale = (len(rows) - 1) / (n - 1)
    return [rows[int(round(i * scale))] for i in range(n)]


KEYFRAMES = "keyframes"  # Plan.interpolate_steps: computed steps placed by normalised time


def keyframe_interp(rows: list[str], n: int) -> list[str]:
    """A plan's rows at another step count n, its computed steps as keyframes in normalised time: per unit, the
    computed steps s of the N planned ones become round(s (n - 1) / (N - 1)) (each computed once; two that land on one
    step compute it once), and every other step takes the action of the nearest planned step that does not compute
    (REUSE or FORECAST). Nearest-step replay (`nearest_interp`) instead repeats a computed row on neighbouring steps
    when n > N, so a Taylor forecast takes its differences one step apart and extrapolates them over the whole gap;
    here the gaps between computes scale with the step count, as the plan was searched.

    >>> keyframe_interp(["C", "F", "F", "C", "F", "F", "C"], 13)
    ['C', 'F', 'F', 'F', 'F', 'F', 'C', 'F', 'F', 'F', 'F', 'F', 'C']
    """
    total = len(rows)
    if n == total:
        return list(rows)
    scale = (n - 1) / (total - 1) if total > 1 else 0.0
    back = (total - 1) / (n - 1) if n > 1 else 0.0
    columns = []
    for u in range(len(rows[0])):
        col = [row[u] for row in rows]
        computed = {int(round(s * scale)) for s, a in enumerate(col) if a == Action.COMPUTE.value}
        idle = [s for s, a in enumerate(col) if a != Action.COMPUTE.value]
        out = []
        for j in range(n):
            if j in computed or not idle:
                out.append(Action.COMPUTE.value)
                continue
            at = j * back
            out.append(col[min(idle, key=lambda s: (abs(s - at), s))])
        columns.append(out)
    return ["".join(cells) for cells in zip(*columns)]


@functools.lru_cache(maxsize=256)
def _interpolated(rows: tuple[str, ...], n: int, keyframes: bool) -> tuple[str, ...]:
    """A plan's rows at n steps, computed once per (rows, n, mode): Plan.row asks at every transformer call."""
    return tuple(keyframe_interp(list(rows), n) if keyframes else nearest_interp(list(rows), n))


class PlanSchedule(Schedule):
    """Static replay of a Plan: no signals, no host syncs."""

    signals = frozenset()

    def __init__(self, plan: Plan):
        self.plan = plan
        self.granularity = Granularity(plan.granularity)
        self.probe_blocks = plan.probe_blocks
        self.tail_blocks = plan.tail_blocks
        self.forecast_order = plan.forecast_order
        from ..runtime.forecast import forecaster_from_plan

        self.forecaster = forecaster_from_plan(plan)  # None: FORECAST cells extrapolate with Taylor
        from ..runtime.step_actions import step_action_from_plan

        self.step_action = step_action_from_plan(plan)  # None: the scheduler's updates are kept as they are
        self.acts_on_steps = self.step_action is not None
        self.cfg_difference = bool(plan.extras.get("cfg_difference", False))  # dcache.runtime.cfg_difference
        self.name = f"plan:{plan.provenance.get('method', 'static')}"
        self._reused_units: dict[str, set[int]] = {
            b: {i for row in rows for i, c in enumerate(row) if c != Action.COMPUTE.value}
            for b, rows in plan.actions.items()}

    def reset(self, generation: GenerationInfo) -> None:
        if generation.num_steps is not None and generation.num_steps != self.plan.num_steps \
                and not self.plan.interpolate_steps:
            self.plan.row(0, next(iter(self.plan.actions)), generation.num_steps)  # raises the teaching error
        if self.forecaster is not None:
            self.forecaster.reset(generation)
        if self.step_action is not None:
            self.step_action.reset(generation)

    def decide(self, ctx: CallContext) -> str:
        return self.plan.row(ctx.step, ctx.branch, ctx.num_steps)

    def after_step(self, step):
        return self.step_action(step) if self.step_action is not None else None

    def may_reuse(self, branch: str, unit: int) -> bool:
        reused = self._reused_units.get(branch)
        if reused is None:
            return True
        return unit in reused

    def plan_extras(self) -> dict:
        """Method data (e.g. per-step coefficients) carried over when a replayed run is exported again."""
        return self.plan.extras

    def config_dict(self) -> dict:
        return {"name": self.name, "plan_provenance": self.plan.provenance}
