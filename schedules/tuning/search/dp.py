"""CacheQuant-style dynamic programming over step groups (CVPR 2025, the cache part "DPS").

From uncached calibration runs, take the feature that a step-level cache holds: the stack residual
F_i = h_out - h_in of step i (per branch, image tokens). Split the N steps into K contiguous groups; a group
[j, m) computes step j and reuses F_j at steps j+1..m-1, costing

    cost(j, m) = sum_{i=j}^{m-1} ||F_i - F_j||_1          (summed over branches and calibration runs)

Group lengths are limited to [lo, hi] (CacheQuant: [ceil(n/2), 2n] with n = N/K).
dp[m][k] = min_j dp[j][k-1] + cost(j, m); backtracking gives the refresh (computed) steps. K = the budget of
computed steps. Exported as a STACK plan. The profiling pass reads residuals with torch hooks through the shared
profiling session (an all-compute dcache run, bit-identical to the uncached pipeline).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dcache.actions import Granularity
from dcache.plans.plan import Plan

from ..profiling import ProfileSession, stack_residual_tap
from .core import Calibration, FrontPoint, Template, make_template, measure, write_front, write_json


@dataclass(frozen=True)
class DPConfig:
    budgets: tuple[int, ...] = ()  # computed steps K per plan; empty: ratios 0.5 and 0.33 of the steps
    min_group: int | None = None  # None: ceil(n/2) with n = N/K
    max_group: int | None = None  # None: 2n (at least min_group + 1)

    def __post_init__(self) -> None:
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"budgets {self.budgets} must be >= 1 computed steps each.")
        if self.min_group is not None and self.min_group < 1:
            raise ValueError(f"min_group={self.min_group} must be >= 1.")


def residual_features(calib: Calibration) -> dict[str, list[torch.Tensor]]:
    """branch -> [F_0 .. F_{N-1}], each the calibration set's stack residuals of that step, stacked (float32, CPU)."""
    feats: dict[str, dict[int, list[torch.Tensor]]] = {}

    def sink(where, r):
        feats.setdefault(where.branch, {}).setdefault(where.step, []).append(r.detach().float().cpu())

    with ProfileSession(calib.pipe) as session:
        stack_residual_tap(session, sink)
        session.run(calib.generate)
    return {b: [torch.cat(steps[s]) for s in sorted(steps)] for b, steps in feats.items()}


def group_costs(features: dict[str, list[torch.Tensor]], max_group: int) -> np.ndarray:
    """cost[j, m] for groups [j, m) with m - j <= max_group (inf elsewhere)."""
    n = len(next(iter(features.values())))
    cost = np.full((n + 1, n + 1), np.inf)
    for j in range(n):
        acc = 0.0
        cost[j, j + 1] = 0.0
        for m in range(j + 2, min(n, j + max_group) + 1):
            i = m - 1
            acc += sum(float((f[i] - f[j]).abs().sum()) for f in features.values())
            cost[j, m] = acc
    return cost


def dp_schedule(cost: np.ndarray, budget: int, min_group: int, max_group: int) -> tuple[list[int], float]:
    """Refresh steps of the cheapest split of N steps into `budget` groups with lengths in [min_group, max_group]."""
    n = cost.shape[0] - 1
    if not 1 <= budget <= n:
        raise ValueError(f"budget={budget} must be in 1..{n}.")
    dp = np.full((n + 1, budget + 1), np.inf)
    arg = np.full((n + 1, budget + 1), -1, dtype=int)
    dp[0, 0] = 0.0
    for k in range(1, budget + 1):
        for m in range(1, n + 1):
            for j in range(max(0, m - max_group), m - min_group + 1):
                v = dp[j, k - 1] + cost[j, m]
                if v < dp[m, k]:
                    dp[m, k], arg[m, k] = v, j
    if not math.isfinite(dp[n, budget]):
        raise ValueError(f"no split of {n} steps into {budget} groups of {min_group}..{max_group} steps; "
                         f"change min_group/max_group or the budget.")
    starts, m = [], n
    for k in range(budget, 0, -1):
        j = int(arg[m, k])
        starts.append(j)
        m = j
    return sorted(starts), float(dp[n, budget])


def group_limits(num_steps: int, budget: int, config: DPConfig) -> tuple[int, int]:
    n = num_steps / budget
    lo = config.min_group if config.min_group is not None else max(1, math.ceil(n / 2))
    hi = config.max_group if config.max_group is not None else max(lo + 1, math.ceil(2 * n))
    return lo, hi


def dp_search(calib: Calibration, out_dir: str | os.PathLike, config: DPConfig = DPConfig(), *,
              template: Template | None = None, progress: bool = True) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = template or make_template(calib)
    n = template.num_steps
    budgets = config.budgets or tuple(sorted({max(2, round(n * r)) for r in (0.5, 0.33)}, reverse=True))
    feats = residual_features(calib)
    limits = {b: group_limits(n, b, config) for b in budgets}
    cost = group_costs(feats, max(hi for _, hi in limits.values()))
    write_json(out / "group_costs.json", {"num_steps": n, "cost": np.where(np.isfinite(cost), cost, -1.0)})
    points = []
    for b in budgets:
        lo, hi = limits[b]
        starts, total = dp_schedule(cost, b, lo, hi)
        plan = dp_plan(template, starts, budget=b, limits=(lo, hi), total=total)
        points.append(FrontPoint(f"dp-K{b}", plan, measure(calib, template, plan)))
    return write_front(out, "dp", points, config={**asdict(config), "budgets": list(budgets)})


def dp_plan(template: Template, starts: Sequence[int], *, budget: int, limits: tuple[int, int], total: float) -> Plan:
    keep = set(starts)
    rows = ["C" if s in keep else "R" for s in range(template.num_steps)]
    return template.plan(Granularity.STACK, rows, method="dp", config={"budget": budget, "group_limits": list(limits)},
                         extras={"compute_steps": sorted(keep), "dp_cost": total})
