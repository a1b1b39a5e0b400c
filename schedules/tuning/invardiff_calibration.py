"""InvarDiff calibration: invariance statistics from uncached runs, then the re-sampling correction pass.

    from dcache.schedules.tuning.invardiff_calibration import calibrate_invardiff
    plan = calibrate_invardiff(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)))
    handle = dcache.apply(pipe, plan)

The first pass measures d[t, u] and d_step[t] (profiling.py); the thresholding into action rows is the pure math of
schedules/invardiff.py (`invariance_rows`); the second pass replays the rows and turns drifting reuses into computes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from dcache import Action, Granularity, Plan
from dcache.model.adapters import composed_indices, reuse_composed_inputs

from ..invardiff import InvarDiffConfig, invariance_rows
from . import profiling as prof


def calibrate_invardiff(target: Any, run_fn: Callable[[], Any] | Sequence[Callable[[], Any]],
                        config: InvarDiffConfig | None = None, *, num_steps: int | None = None,
                        **overrides: Any) -> Plan:
    """Profile the uncached run(s), threshold the invariance statistics, correct, and return the MODULE Plan."""
    config = config if config is not None else InvarDiffConfig()
    if overrides:
        config = type(config).with_overrides(**{**config.__dict__, **overrides})
    runs = prof.as_runs(run_fn)
    stat = lambda new, old: prof.token_change_quantile(new, old, config.token_quantile)  # noqa: E731
    modules_c = prof.AdjacentCollector(stat)
    stack_c = prof.AdjacentCollector(stat)
    with prof.ProfileSession(target, num_steps=num_steps) as session:
        pairs = session.module_pairs()
        if not pairs:
            raise ValueError(f"{type(session.transformer).__name__} exposes no inner modules (attention / "
                             f"feed-forward) for module-level reuse; InvarDiff needs them (adapter `modules`).")
        units = session.unit_names(Granularity.MODULE)
        session.on_module(lambda unit, where, out: modules_c.add(where, unit, out))
        prof.stack_residual_tap(session, lambda where, r: stack_c.add(where, "stack", r))
        generations = session.run(runs)
        header, adapter = session.plan_header(), session.engine.adapter
    if not modules_c.steps:
        raise RuntimeError("calibration saw no transformer call; run_fn must run the pipeline (or transformer).")
    n = max(modules_c.steps.values())
    names = [m for _, m in pairs]
    actions: dict[str, list[str]] = {}
    gates: dict[str, list[bool]] = {}
    composed = composed_indices(adapter, units)  # the correction pass replays the rows as the engine runs them
    for branch in modules_c.steps:
        rows, gate = invariance_rows(
            n, names, lambda t, u, b=branch: modules_c.value(b, u, t),
            lambda t, b=branch: stack_c.value(b, "stack", t), config, prof.quantile)
        actions[branch], gates[branch] = [reuse_composed_inputs(r, composed) for r in rows], gate
    flipped = 0
    if config.correction:
        flipped = _correct(target, runs, actions, config.correction_tol, num_steps)
    extras = {"invardiff": {"step_gate": gates, "corrected_cells": flipped,
                            "correction_tol": config.correction_tol if config.correction else None}}
    provenance = {"method": "invardiff", "config": config.to_dict(),
                  "calibration": {"generations": generations, "runs": len(runs)}, "quality": {}}
    return prof.make_plan(header, granularity=Granularity.MODULE, units=units, num_steps=n,
                          actions={b: list(r) for b, r in actions.items()}, extras=extras, provenance=provenance,
                          adapter=adapter)


def _correct(target: Any, runs, actions: dict[str, list[str]], tol: float, num_steps: int | None) -> int:
    """Replay the plan with every module computed alongside; reuses that drift > tol become computes (in place)."""
    cache: dict[tuple[int, str, int], Any] = {}
    flipped = 0

    def on_module(unit, where, output, k):
        nonlocal flipped
        rows = actions.get(where.branch)
        if rows is None or where.step >= len(rows):
            return None
        key = (where.generation, where.branch, unit, k)  # k: the call's order in the block (Adapter.shared)
        cached = cache.get(key)
        if rows[where.step][unit] == Action.COMPUTE.value or cached is None:
            cache[key] = prof.detach(output, None)
            return None
        drift = prof.diff_abs_sum(cached, output) / max(prof.abs_sum(output), 1e-12)
        if drift > tol:
            row = rows[where.step]
            rows[where.step] = row[:unit] + Action.COMPUTE.value + row[unit + 1:]
            flipped += 1
            cache[key] = prof.detach(output, None)
            return None
        return cached

    with prof.ProfileSession(target, num_steps=num_steps) as session:
        session.on_module(on_module, every_call=True)
        session.run(runs)
    return flipped


__all__ = ["calibrate_invardiff"]
