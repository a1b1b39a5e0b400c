"""ERTACache calibration: profile uncached runs, choose the step schedule, fit the rectification and the timestep
adjustment; the plan it returns replays with `dcache.apply(pipe, plan)` (schedules/ertacache.py: the formulation,
the schedule DP and the run-time step action).

    from dcache.schedules.tuning.ertacache_calibration import calibrate_ertacache
    plan = calibrate_ertacache(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)),
                               threshold=0.1)
    handle = dcache.apply(pipe, plan)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from dcache import Action, Granularity, Plan

from ..ertacache import ERTACacheConfig, TimestepScale, rows_from_schedule, select_compute_steps
from . import profiling as prof


def calibrate_ertacache(target: Any, run_fn: Callable[[], Any] | Sequence[Callable[[], Any]],
                        config: ERTACacheConfig | None = None, *, num_steps: int | None = None,
                        **overrides: Any) -> Plan:
    """Profile the uncached run(s), choose the schedule and fit k_i (and phi_i with a second pass); return the Plan.

    target: a pipeline (or a bare transformer with `num_steps`). run_fn: one callable per calibration input, each
    deterministic (fixed generator seeds), since the phi pass replays the same inputs.
    """
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

    plan = prof.make_plan(header, granularity=Granularity.STACK, units=["stack"], num_steps=n, actions=actions,
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


__all__ = ["calibrate_ertacache"]
