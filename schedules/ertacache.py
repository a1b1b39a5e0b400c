"""ERTACache (arXiv 2508.21091, dcache's formulation): a calibrated static step schedule with closed-form
residual rectification and timestep adjustment, exported as a Plan.

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
   lets the DP reuse more steps at the same delta. If that needs more computed steps than the budget `max_compute_ratio * N`, the budget
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
   carries phi as its step action (`extras["step_action"]`, dcache.step_actions): after every scheduler step the
   engine sets x_{i+1} <- x_i + phi_i (x_{i+1} - x_i), which for a first-order solver
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

from dcache import Action, Granularity, MethodConfig, Plan, Schedule, knob, register_method
from dcache.plan import PlanError, PlanSchedule, nearest_interp
from dcache.schedule import GenerationInfo
from dcache.step_actions import SchedulerStep, StepAction, register_step_action

@register_method
@dataclass(frozen=True)
class ERTACacheConfig(MethodConfig):
    """ERTACache: a calibrated static step schedule with residual rectification and timestep adjustment.

    Paper: Qiu et al., "ERTACache: Error Rectification and Timesteps Adjustment for Efficient Diffusion",
    https://arxiv.org/abs/2508.21091 (dcache's formulation).

    Use it when a calibration run on representative prompts is possible: the schedule is fixed offline and replays
    with no run-time signal (`calibrate_ertacache`; the bundled model ships a plan).

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "ertacache") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "ertacache"
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

    def check(self) -> None:
        from .tuning.profiling import check_finite

        check_finite(self)

    def build(self, model: nn.Module) -> Schedule:
        from .calibrated_plans import calibrated_plan

        return ERTACacheSchedule(calibrated_plan("ertacache", model, plan=self.plan, calibration=self.calibration))


class ERTACacheSchedule(PlanSchedule):
    """Replays an ERTACache plan (REUSE / rectified FORECAST rows); keeps its coefficients in exported plans."""

    def __init__(self, plan: Plan):
        super().__init__(plan)
        self.name = "ertacache"

    def plan_extras(self) -> dict:
        return dict(self.plan.extras)


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
# Calibration (profiling lives in tuning/profiling.py; this only wires it to the math above)
# ----------------------------------------------------------------------------------------------------------------

def calibrate_ertacache(target: Any, run_fn: Callable[[], Any] | Sequence[Callable[[], Any]],
                        config: ERTACacheConfig | None = None, *, num_steps: int | None = None,
                        **overrides: Any) -> Plan:
    """Profile the uncached run(s), choose the schedule and fit k_i (and phi_i with a second pass); return the Plan.

    target: a pipeline (or a bare transformer with `num_steps`). run_fn: one callable per calibration input, each
    deterministic (fixed generator seeds), since the phi pass replays the same inputs.
    """
    from .tuning import profiling as prof

    config = config if config is not None else ERTACacheConfig()
    if overrides:
        config = type(config).with_overrides(**{**config.__dict__, **overrides})
    runs = prof.as_runs(run_fn)
    window = config.max_consecutive
    collector = prof.PairwiseCollector(window=window, triples=config.rectify)
    is_pipeline = getattr(target, "scheduler", None) is not None and hasattr(target, "transformer")
    fit_phi = config.timestep_adjustment and is_pipeline
    ref_updates: dict[tuple[int, int], torch.Tensor] = {}

    with prof.ProfileSession(target, num_steps=num_steps) as session:
        if config.metric == "residual":
            prof.stack_residual_tap(session, collector.add)
        else:
            session.on_output(collector.add)
        if fit_phi:
            session.on_scheduler_step(lambda w, v, x, x1: ref_updates.__setitem__(
                (w.generation, w.step), (x1.float() - x.float()).detach().clone()))
        generations = session.run(runs)
        header = session.plan_header()

    branches = collector.branches()
    if not branches:
        raise RuntimeError("calibration saw no transformer call; run_fn must run the pipeline (or transformer).")
    n = max(collector.steps.values())
    cap = int(math.floor(config.max_compute_ratio * n + 1e-9))
    actions: dict[str, list[str]] = {}
    k_fit: dict[str, list[float | None]] = {}
    k_applied: dict[str, list[float]] = {}
    errors: dict[str, list[float]] = {}
    delta_met, caps = True, []
    for branch in branches:
        err = lambda j, i, b=branch: collector.rel_l1(b, j, i)  # noqa: E731
        lin = (lambda jp, j, i, b=branch: _rectified_error(collector, b, jp, j, i)) if config.rectify else None
        computed, met, used_cap = select_compute_steps(n, err, threshold=config.threshold, max_compute=cap,
                                                       max_run=window, warmup=config.warmup_steps, rectified=lin)
        delta_met &= met
        caps.append(used_cap)
        forecast: set[int] = set()
        k_row: list[float | None] = [None] * n
        applied = [0.0] * n
        err_row = [0.0] * n
        for pos, j in enumerate(computed):
            end = computed[pos + 1] if pos + 1 < len(computed) else n
            jp = computed[pos - 1] if pos > 0 else None
            for i in range(j + 1, end):
                plain = collector.rel_l1(branch, j, i)
                err_row[i] = plain
                if jp is None:
                    continue
                kden = collector.kden[branch].get((jp, j, i), 0.0)
                if kden > 0:
                    k_row[i] = collector.kdot[branch][(jp, j, i)] / kden
                lin = _rectified_error(collector, branch, jp, j, i)
                if config.rectify and lin < plain:
                    forecast.add(i)
                    applied[i] = (i - j) / (j - jp)
                    err_row[i] = lin
        actions[branch] = rows_from_schedule(n, computed, forecast)
        k_fit[branch], k_applied[branch], errors[branch] = k_row, applied, err_row

    uses_forecast = any(Action.FORECAST.value in "".join(rows) for rows in actions.values())
    finite = lambda v: v if v is None or math.isfinite(v) else None  # noqa: E731  (JSON has no inf)
    errors = {b: [finite(v) for v in row] for b, row in errors.items()}
    extras = {"ertacache": {"threshold": config.threshold, "delta_met": delta_met, "error_cap": finite(max(caps)),
                            "metric": config.metric, "k": k_fit, "k_applied": k_applied, "error": errors,
                            "phi": [1.0] * n, "phi_fitted": False}}
    provenance = {"method": "ertacache", "config": config.to_dict(),
                  "calibration": {"generations": generations, "runs": len(runs)}, "quality": {}}

    from .tuning.profiling import make_plan

    plan = make_plan(header, granularity=Granularity.STACK, units=["stack"], num_steps=n, actions=actions,
                     forecast_order=1 if uses_forecast else 0, extras=extras, provenance=provenance)
    if fit_phi:
        reused = [i for i in range(n) if any(rows[i] != Action.COMPUTE.value for rows in actions.values())]
        if reused:
            phi = _fit_phi(target, runs, plan, ref_updates, reused, n)
            plan.extras["ertacache"]["phi"] = phi
            plan.extras["ertacache"]["phi_fitted"] = True
            plan.extras["step_action"] = TimestepScale(phi).to_extras()
    return plan


def _rectified_error(collector, branch: str, jp: int, j: int, i: int) -> float:
    """Profiled relL1 of the engine's rectified forecast F_j + (i - j)/(j - j') (F_j - F_j') at step i."""
    ref = collector.ref[branch].get((j, i), 0.0)
    return collector.lin_err[branch].get((jp, j, i), math.inf) / ref if ref > 0 else math.inf


def _fit_phi(target: Any, runs, plan: Plan, ref_updates: dict, reused: list[int], n: int) -> list[float]:
    from .tuning import profiling as prof

    num = [0.0] * n
    den = [0.0] * n

    def on_step(where, v, x, x1):
        ref = ref_updates.get((where.generation, where.step))
        if ref is None or where.step not in reused_set:
            return
        upd = x1.float() - x.float()
        num[where.step] += float((ref * upd).sum())
        den[where.step] += float((upd * upd).sum())

    reused_set = set(reused)
    with prof.ProfileSession(target, schedule=plan) as session:
        session.on_scheduler_step(on_step)
        session.run(runs)
    return [num[i] / den[i] if i in reused_set and den[i] > 0 else 1.0 for i in range(n)]


# ----------------------------------------------------------------------------------------------------------------
# Timestep adjustment at run time: the plan's step action (dcache.step_actions)
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


__all__ = ["ERTACacheConfig", "ERTACacheSchedule", "calibrate_ertacache", "TimestepScale",
           "TimestepAdjustmentSkipped", "select_compute_steps"]
