"""ERTACache (arXiv 2508.21091, dcache's formulation): a calibrated static step schedule with closed-form
residual rectification and timestep adjustment, exported as a Plan.

    from dcache.schedules.tuning.ertacache_calibration import calibrate_ertacache
    plan = calibrate_ertacache(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)),
                               threshold=0.1)
    handle = dcache.apply(pipe, plan)   # static replay: reuse / rectified forecast, phi_i on the reused steps

1. Offline residual profiling -> static schedule. One uncached pass over the calibration inputs records, per branch
   and step i, the feature F_i (`metric="residual"`: the stack residual R_i = h_out - h_in that the engine caches;
   `metric="output"`: the model output v_i as in the paper), and pools over inputs
       e(j, i) = sum|F_i - F_j| / sum|F_i|          (relL1 of reusing computed step j at step i).
   A DP over segments (j computed, j+1..m-1 reuse j; states = the last two computed steps) picks the fewest
   computed steps such that every reused step has error <= threshold (delta), runs of reuse <= max_consecutive, and
   the first warmup_steps compute; ties go to the least total error. A reused step's error is e(j, i), or with
   `rectify` the smaller of e(j, i) and the profiled error of the rectified forecast (part 2), so rectification
   lets the DP reuse more steps at the same delta. If that needs more computed steps than the budget \
`max_compute_ratio * N`, the budget
   wins and delta is relaxed to the smallest feasible max error (minimax), then least total error; the plan's
   extras say `delta_met: false`.
2. Closed-form residual rectification. For a reused step i with source j and the computed step j' before j:
       k_i = <F_i - F_j, F_j - F_j'> / |F_j - F_j'|^2          (least squares over the calibration inputs)
   is stored per branch and step. The plan applies it quantized to two values: FORECAST with forecast_order=1
   evaluates R_j + c_i (R_j - R_j') with c_i = (i - j) / (j - j') (linear extrapolation of the cached residual
   history), REUSE is c_i = 0; the plan uses FORECAST at step i where the profiled error of that rectification is
   lower than plain reuse. The fitted k_i and the applied coefficient (`k_applied`) are both kept in the plan's
   extras.
3. Trajectory-aware timestep adjustment. A second calibration pass replays the plan and records the scheduler
   update of every step, Delta x~_i = x_{i+1} - x_i (= Delta t_i * v~_i for a first-order solver); with the uncached
   update Delta x_i from the first pass,
       phi_i = <Delta x_i, Delta x~_i> / |Delta x~_i|^2     on steps where a branch reuses (1 elsewhere),
   i.e. the spec's least squares for x_i + phi_i Delta t_i v~ ~ x^ref_{i+1}, with v~ the output the cached run
   really produces (the engine re-runs norm_out/proj_out on h_in(i) + cached residual, so v~ != v_j). The plan
   carries phi as its step action (`extras["step_action"]`, dcache.runtime.step_actions): after every scheduler step
   the engine sets x_{i+1} <- x_i + phi_i (x_{i+1} - x_i), which for a first-order solver
   (FlowMatchEulerDiscreteScheduler) is the update with Delta t_i' = phi_i Delta t_i. With a higher-order
   scheduler the adjustment is skipped with a warning (TimestepAdjustmentSkipped).

Profiling memory: the features of the last 2 * max_consecutive + 2 steps per branch; the second pass keeps one
latent-sized update per step.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dcache import Action, MethodConfig, Plan, Schedule, knob, register_method
from dcache.plans.plan import PlanError, nearest_interp
from dcache.schedule import GenerationInfo
from dcache.runtime.step_actions import SchedulerStep, StepAction, register_step_action

from .calibrated_plans import CalibratedPlanSchedule, calibrated_plan

@register_method
@dataclass(frozen=True)
class ERTACacheConfig(MethodConfig):
    """ERTACache: a calibrated static step schedule with residual rectification and timestep adjustment.

    Paper: Qiu et al., "ERTACache: Error Rectification and Timesteps Adjustment for Efficient Diffusion",
    https://arxiv.org/abs/2508.21091 (dcache's formulation).

    Use it when a calibration run on representative prompts is possible: the schedule is fixed offline and replays
    with no run-time signal (`dcache calibrate --method ertacache`, or
    `dcache.schedules.tuning.ertacache_calibration.calibrate_ertacache`; the bundled model ships a plan).

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "ertacache") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "ertacache"
    title = "ERTACache"
    # `dcache calibrate --method ertacache`: the plan that build() replays
    calibrator = ("plan", "dcache.schedules.tuning.ertacache_calibration:calibrate_ertacache")
    threshold: float = knob(0.1, low=0.0, high=100.0, doc="delta: largest profiled relL1 error e(j, i) allowed at a "
                                                           "reused step")
    max_compute_ratio: float = knob(1.0, low=0.01, high=1.0, doc="compute budget: most computed steps per branch as "
                                                                  "a fraction of the steps (delta is relaxed to meet "
                                                                  "it)")
    max_consecutive: int = knob(3, low=1, high=1000, doc="most consecutive reused steps")
    warmup_steps: int = knob(1, low=1, high=10_000, doc="first steps always computed")
    metric: str = knob("residual", choices=("residual", "output"), doc="feature whose reuse error is profiled: the "
                                                                      "stack residual (what is cached) or the model "
                                                                      "output")
    rectify: bool = knob(True, doc="use rectified forecasts (FORECAST) on reused steps where they lower the "
                                   "profiled error")
    timestep_adjustment: bool = knob(True, doc="fit phi_i with a second calibration pass (pipelines only)")
    plan: str | None = knob(None, types=(str,), doc="path of a calibrated ERTACache plan file")
    calibration: str | None = knob(None, types=(str,), doc="the file `dcache calibrate --method ertacache` wrote:"
                                   " a plan, or a calibration file holding this method's plan for the model")

    def build(self, model: nn.Module) -> Schedule:
        return ERTACacheSchedule(calibrated_plan("ertacache", model, plan=self.plan, calibration=self.calibration))


class ERTACacheSchedule(CalibratedPlanSchedule):
    """Replays an ERTACache plan (REUSE / rectified FORECAST rows); keeps its coefficients in exported plans."""

    method = "ertacache"


# ----------------------------------------------------------------------------------------------------------------
# The schedule DP (pure math)
# ----------------------------------------------------------------------------------------------------------------

def _solve(n: int, err: Callable[[int | None, int, int], float], cap: float, max_run: int, warmup: int):
    """Layered DP over states (previous compute, last compute): the least total error of the reused steps before
    `last`, per number of computed steps k; segment errors <= cap. Returns (terminal, parents):
    terminal[k] = (total error of a full schedule with k computes, its final state)."""
    inf = math.inf
    layer: dict[tuple[int | None, int], float] = {(None, 0): 0.0}
    parents: list[dict] = [{}, {(None, 0): None}]
    terminal: list[tuple[float, Any]] = [(inf, None)] * (n + 1)
    for k in range(1, n + 1):
        nxt: dict[tuple[int | None, int], float] = {}
        parent_k: dict = {}
        for (prev, last), cost in layer.items():
            total = 0.0
            for m in range(last + 1, min(n, last + max_run + 1) + 1):
                if m > last + 1:  # extend the segment by the reused step m - 1
                    i = m - 1
                    e = err(prev, last, i) if i >= warmup else inf
                    if not e <= cap:
                        break
                    total += e
                if m == n:
                    if cost + total < terminal[k][0]:
                        terminal[k] = (cost + total, (prev, last))
                elif cost + total < nxt.get((last, m), inf):
                    nxt[(last, m)] = cost + total
                    parent_k[(last, m)] = (prev, last)
        parents.append(parent_k)
        layer = nxt
        if not layer:
            break
    return terminal, parents


def _backtrack(terminal, parents, k: int) -> list[int]:
    state, computed = terminal[k][1], []
    while state is not None:
        computed.append(state[1])
        state = parents[k].get(state)
        k -= 1
    return sorted(computed)


def select_compute_steps(num_steps: int, error: Callable[[int, int], float], *, threshold: float,
                         max_compute: int, max_run: int, warmup: int,
                         rectified: Callable[[int, int, int], float] | None = None) -> tuple[list[int], bool, float]:
    """Computed steps of the static schedule; (steps, delta_met, max error cap used). See the module docstring.

    error(j, i): profiled error of reusing computed step j at step i. rectified(j', j, i): the error of the
    rectified forecast from the computes j' < j (optional); a reused step costs the smaller of the two.
    """
    n = num_steps
    max_compute = max(max_compute, min(warmup, n), 1)

    def err(prev: int | None, last: int, i: int) -> float:
        plain = error(last, i)
        if rectified is None or prev is None:
            return plain
        return min(plain, rectified(prev, last, i))

    def fewest(terminal) -> int | None:
        return next((k for k in range(1, n + 1) if terminal[k][0] < math.inf), None)

    terminal, parents = _solve(n, err, threshold, max_run, warmup)
    k_min = fewest(terminal)
    if k_min is not None and k_min <= max_compute:
        return _backtrack(terminal, parents, k_min), True, threshold
    # Budget first: the smallest cap M whose fewest computed steps fit the budget (binary search over the errors).
    values = {error(j, i) for j in range(n) for i in range(j + 1, min(n, j + max_run + 1))}
    if rectified is not None:
        values |= {rectified(jp, j, i) for j in range(1, n) for jp in range(max(0, j - max_run - 1), j)
                   for i in range(j + 1, min(n, j + max_run + 1))}
    candidates = sorted({v for v in values if math.isfinite(v) and v > threshold})
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        term_m, par_m = _solve(n, err, candidates[mid], max_run, warmup)
        k = fewest(term_m)
        if k is not None and k <= max_compute:
            best, hi = (candidates[mid], term_m, par_m), mid - 1
        else:
            lo = mid + 1
    if best is None:  # even unlimited error cannot meet the budget (max_run too short): fewest steps possible
        term_inf, par_inf = _solve(n, err, math.inf, max_run, warmup)
        return _backtrack(term_inf, par_inf, fewest(term_inf)), False, math.inf
    cap, term_m, par_m = best
    k = min((k for k in range(1, max_compute + 1) if term_m[k][0] < math.inf), key=lambda k: (term_m[k][0], k))
    return _backtrack(term_m, par_m, k), False, cap


def rows_from_schedule(num_steps: int, computed: Sequence[int], forecast: set[int]) -> list[str]:
    comp = set(computed)
    return [Action.COMPUTE.value if i in comp else Action.FORECAST.value if i in forecast else Action.REUSE.value
            for i in range(num_steps)]


# ----------------------------------------------------------------------------------------------------------------
# Timestep adjustment at run time: the plan's step action (dcache.runtime.step_actions)
# ----------------------------------------------------------------------------------------------------------------

class TimestepAdjustmentSkipped(UserWarning):
    """A plan's timestep adjustment was not applied (the scheduler is not first-order)."""


class TimestepScale(StepAction):
    """x_{i+1} <- x_i + phi_i (x_{i+1} - x_i) after scheduler step i: the update of a first-order solver with its
    interval scaled, Delta t_i' = phi_i Delta t_i. phi has one entry per calibrated step; a generation with another
    step count reads it at the nearest calibrated step (as the plan's rows are read)."""

    name = "timestep_scale"

    def __init__(self, scale: Sequence[float]):
        self.scale = [float(v) for v in scale]
        self._num_steps: int | None = None
        self._warned = False

    def reset(self, generation: GenerationInfo) -> None:
        self._num_steps = generation.num_steps
        self._warned = False

    def __call__(self, step: SchedulerStep) -> torch.Tensor | None:
        order = getattr(step.scheduler, "order", 1)
        if order != 1:
            if not self._warned:
                self._warned = True
                warnings.warn(f"the plan's timestep adjustment scales a first-order update; "
                              f"{type(step.scheduler).__name__} has order {order}, so the steps run unadjusted. Use a "
                              f"first-order (Euler) scheduler for the calibrated result.", TimestepAdjustmentSkipped,
                              stacklevel=2)
            return None
        n = step.num_steps if step.num_steps is not None else len(self.scale)
        scale = self.scale if n == len(self.scale) else nearest_interp(self.scale, n)
        phi = scale[step.step] if 0 <= step.step < len(scale) else 1.0
        if phi == 1.0:
            return None
        return step.sample + phi * (step.updated - step.sample)

    def to_extras(self) -> dict:
        return {"name": self.name, "scale": list(self.scale)}


def _load_timestep_scale(spec: dict, plan: Plan) -> TimestepScale:
    scale = spec.get("scale")
    if not isinstance(scale, list) or len(scale) != plan.num_steps or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in scale):
        raise PlanError(f"plan field 'extras.step_action.scale' must list {plan.num_steps} finite positive numbers "
                        f"(phi per step), got {str(scale)[:80]}; recalibrate with `dcache calibrate --method "
                        f"ertacache`, or remove 'extras.step_action' to replay without the timestep adjustment.")
    return TimestepScale(scale)


register_step_action(TimestepScale.name, _load_timestep_scale)


__all__ = ["ERTACacheConfig", "ERTACacheSchedule", "TimestepScale",
           "TimestepAdjustmentSkipped", "select_compute_steps"]
