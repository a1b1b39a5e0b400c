"""BAC calibration: profile the units' feature similarities on uncached runs, then plan (schedules/bac.py).

    from dcache.schedules.tuning.bac_calibration import calibrate_bac
    plan = calibrate_bac(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)))
    handle = dcache.apply(pipe, plan)

The profiling pass (profiling.py) pools s_u(i, k), the cosine similarity of unit u's features at steps i < k; the
per-unit DP and the bubbling union that turn it into the Plan are the pure math of schedules/bac.py.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from dcache import Action, Granularity, Plan

from ..bac import BACConfig, bubbling_union, caching_error, update_steps
from . import profiling as prof


def calibrate_bac(target: Any, run_fn: Callable[[], Any] | Sequence[Callable[[], Any]],
                  config: BACConfig | None = None, *, num_steps: int | None = None, **overrides: Any) -> Plan:
    """Profile unit similarities, run the per-unit DP and the bubbling union, return the Plan."""
    config = config if config is not None else BACConfig()
    if overrides:
        config = type(config).with_overrides(**{**config.__dict__, **overrides})
    runs = prof.as_runs(run_fn)
    module_mode = config.granularity == "module"
    collector = prof.PairwiseCollector(window=config.max_interval)
    seen: dict[str, int] = {}

    def add(unit: int, where, feature) -> None:
        seen.setdefault(where.branch, 0)
        collector.add(where, feature, key=f"{where.branch}|{unit}")

    with prof.ProfileSession(target, num_steps=num_steps) as session:
        granularity = Granularity.MODULE if module_mode else Granularity.BLOCK
        units = session.unit_names(granularity)
        names = [m for _, m in session.module_pairs()] if module_mode else ["block"] * len(units)
        if module_mode:
            if not units:
                raise ValueError(f"{type(session.transformer).__name__} exposes no inner modules; use "
                                 f"granularity='block'.")
            session.on_module(lambda unit, where, out: add(unit, where, out))
        else:
            prof.block_residual_tap(session, lambda index, where, r: add(index, where, r))
        generations = session.run(runs)
        header, adapter = session.plan_header(), session.engine.adapter
    if not seen:
        raise RuntimeError("calibration saw no transformer call; run_fn must run the pipeline (or transformer).")
    n = max(collector.steps.values())
    updates = int(round(config.compute_ratio * n))

    def targets(u: int) -> list[int]:
        later = [v for v in range(u + 1, len(units)) if not module_mode or names[v] in prof.FFN_MODULES]
        return later if config.bubble_depth < 0 else later[:config.bubble_depth]

    actions: dict[str, list[str]] = {}
    info: dict[str, Any] = {}
    for branch in seen:
        sims = [lambda i, k, key=f"{branch}|{u}": collector.cosine(key, i, k) for u in range(len(units))]
        base = [update_steps(n, sims[u], updates, config.max_interval) for u in range(len(units))]
        errors = [caching_error(n, base[u], sims[u]) for u in range(len(units))]
        cut = prof.quantile(errors, config.bubble_quantile) if config.bubble_quantile < 1 else math.inf
        final = bubbling_union([set(s) for s in base], errors, targets, cut)
        actions[branch] = ["".join(Action.COMPUTE.value if t in final[u] else Action.REUSE.value
                                   for u in range(len(units))) for t in range(n)]
        info[branch] = {"caching_error": errors, "bubbled_units": [u for u, e in enumerate(errors) if e > cut],
                        "base_compute_ratio": sum(len(s) for s in base) / (n * len(units)),
                        "compute_ratio": sum(len(s) for s in final) / (n * len(units))}
    extras = {"bac": info}
    provenance = {"method": "bac", "config": config.to_dict(),
                  "calibration": {"generations": generations, "runs": len(runs)}, "quality": {}}
    return prof.make_plan(header, granularity=granularity, units=units, num_steps=n, actions=actions,
                          extras=extras, provenance=provenance, adapter=adapter)


__all__ = ["calibrate_bac"]
