"""BAC, Block-wise Adaptive Caching (arXiv 2506.13456; ICLR 2026): per-unit update steps chosen by DP to
maximise the similarity of the reused features, then the Bubbling Union (BLOCK granularity by default).

    from dcache.schedules.tuning.bac_calibration import calibrate_bac
    plan = calibrate_bac(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)))
    handle = dcache.apply(pipe, plan)

1. Profiling (one uncached pass). Per branch and unit u (a block's residual out - in, hidden and encoder streams;
   or, with granularity="module", an attention / feed-forward output), the cosine similarity between the unit's
   features at steps i < k, pooled over the calibration inputs: s_u(i, k), for k - i <= max_interval.
2. Adaptive Caching Scheduler. For each unit, the M + 1 update steps 0 = c_0 < c_1 < ... < c_M maximise
       sum_m phi(c_m, c_{m+1} - 1),   phi(i, j) = sum_{k=i+1..j} s_u(i, k)
   (the similarity between the feature cached at c_m and every step that reuses it), with c_{m+1} - c_m <=
   max_interval; solved exactly by DP. M + 1 = round(compute_ratio * N) updates per unit (the same for all).
3. Bubbling Union. A unit's caching error is the mean of 1 - s_u(c(k), k) over its reused steps k. The units whose
   error is above the `bubble_quantile` quantile of all units' errors are "upstream blocks with large caching
   error": their update steps are unioned into the schedules of the feed-forward units downstream of them (module
   granularity: the FFN modules later in the execution order; block granularity: the later blocks, whose FFN
   consumes the error), at most `bubble_depth` of them (-1 = all), so that the downstream FFNs recompute on a fresh
   input whenever the upstream unit does. This raises the compute above compute_ratio; the plan reports both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

from dcache import MethodConfig, Schedule, knob, register_method

from .calibrated_plans import CalibratedPlanSchedule, calibrated_plan


@register_method
@dataclass(frozen=True)
class BACConfig(MethodConfig):
    """BAC: per-unit update steps chosen by dynamic programming on profiled feature similarity.

    Paper: Block-wise Adaptive Caching, https://arxiv.org/abs/2506.13456 (ICLR 2026).

    Use it for a block-level static plan at a chosen compute ratio (`calibrate_bac`; the bundled model ships a
    plan).

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "bac") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "bac"
    title = "BAC"
    # `dcache calibrate --method bac`: the plan that build() replays
    calibrator = ("plan", "dcache.schedules.tuning.bac_calibration:calibrate_bac")
    compute_ratio: float = knob(0.5, low=0.01, high=1.0, doc="update steps per unit / steps, before the bubbling "
                                                              "union")
    max_interval: int = knob(4, low=1, high=1000, doc="most steps between two updates of a unit")
    bubble_quantile: float = knob(0.75, low=0.0, high=1.0, doc="units whose caching error is above this quantile "
                                                                "bubble their update steps downstream (1 = no "
                                                                "union)")
    bubble_depth: int = knob(1, low=-1, high=100_000, doc="how many downstream FFN units / blocks receive the "
                                                           "union (-1 = all)")
    granularity: str = knob("block", choices=("block", "module"), doc="units: blocks, or attention / FFN modules")
    plan: str | None = knob(None, types=(str,), doc="path of a calibrated BAC plan file")
    calibration: str | None = knob(None, types=(str,), doc="the file `dcache calibrate --method bac` wrote:"
                                   " a plan, or a calibration file holding this method's plan for the model")

    def check(self) -> None:
        if self.bubble_depth == 0:
            raise self.invalid("bubble_depth", 0, "-1 (all) or >= 1; use bubble_quantile=1 to turn the union off",
                               "how many downstream units receive the union")

    def build(self, model: nn.Module) -> Schedule:
        return BACSchedule(calibrated_plan("bac", model, plan=self.plan, calibration=self.calibration))


class BACSchedule(CalibratedPlanSchedule):
    method = "bac"


# ----------------------------------------------------------------------------------------------------------------
# The scheduler DP and the bubbling union (pure math)
# ----------------------------------------------------------------------------------------------------------------

def update_steps(num_steps: int, similarity: Callable[[int, int], float], updates: int,
                 max_interval: int) -> list[int]:
    """The `updates` steps (0 first) maximising the summed similarity of reused steps to their update step."""
    n = num_steps
    updates = max(1, min(updates, n))
    # The fewest updates that cover n steps with gaps <= max_interval.
    updates = max(updates, math.ceil(n / max_interval))
    phi: dict[tuple[int, int], float] = {}
    for i in range(n):
        acc = 0.0
        phi[(i, i + 1)] = 0.0
        for m in range(i + 2, min(n, i + max_interval) + 1):
            acc += similarity(i, m - 1)
            phi[(i, m)] = acc
    neg = -math.inf
    dp = [[(neg, -1)] * (n + 1) for _ in range(updates + 1)]
    dp[0][0] = (0.0, -1)
    for k in range(1, updates + 1):
        prev, cur = dp[k - 1], dp[k]
        for (i, m), value in phi.items():
            if prev[i][0] > neg and prev[i][0] + value > cur[m][0]:
                cur[m] = (prev[i][0] + value, i)
    steps, m, k = [], n, updates
    while k > 0:
        i = dp[k][m][1]
        steps.append(i)
        m, k = i, k - 1
    return sorted(steps)


def caching_error(num_steps: int, steps: Sequence[int], similarity: Callable[[int, int], float]) -> float:
    """Mean of 1 - s(c(k), k) over the reused steps k (c(k) = the last update step <= k)."""
    upd = set(steps)
    errors, last = [], 0
    for k in range(num_steps):
        if k in upd:
            last = k
        else:
            errors.append(1.0 - similarity(last, k))
    return sum(errors) / len(errors) if errors else 0.0


def bubbling_union(schedules: list[set[int]], errors: Sequence[float], targets: Callable[[int], list[int]],
                   threshold: float) -> list[set[int]]:
    """Union the update steps of units with error > threshold into their downstream targets (upstream first)."""
    out = [set(s) for s in schedules]
    for u, e in enumerate(errors):
        if e > threshold:
            for v in targets(u):
                out[v] |= schedules[u]
    return out

__all__ = ["BACConfig", "BACSchedule", "update_steps", "caching_error", "bubbling_union"]
