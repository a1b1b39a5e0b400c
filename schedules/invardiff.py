"""InvarDiff (arXiv 2512.05134): a calibrated per-step x per-block x per-module reuse plan
(MODULE granularity) from quantile-based invariance statistics, with a step gate and a re-sampling correction.

    from dcache.schedules.tuning.invardiff_calibration import calibrate_invardiff
    plan = calibrate_invardiff(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)))
    handle = dcache.apply(pipe, plan)

dcache's formulation (the reference calibration script is not public; thresholds here are *quantile levels*):
1. Invariance statistics (one uncached pass over the calibration inputs). For every branch, step t >= 1 and module
   unit u = (block l, module s) (attention / feed-forward outputs), the per-token relative change between adjacent
   steps  r[tok] = ||y_t[tok] - y_{t-1}[tok]|| / ||y_{t-1}[tok]||  is reduced to its `token_quantile` quantile over
   the tokens (robust worst-case change), averaged over the calibration inputs: d[t, u]. The same statistic of the
   stack residual R_t = h_out - h_in gives the step statistic d_step[t].
2. Thresholding. Steps t < nonskip_ratio * N are never reused. Among the other steps, the step gate c[t] = 1 (reuse
   every module of step t) where d_step[t] <= the `step_quantile` quantile of d_step; otherwise module u of type s
   is reused where d[t, u] <= the `module_quantiles[s]` (default `module_quantile`) quantile of d[., units of type
   s]. A quantile level of 0 turns that kind of reuse off; runs of reuse are cut at `max_consecutive`.
3. Re-sampling correction (second calibration pass, `correction=True`). The plan is replayed on the calibration
   inputs with every module still computed alongside: where the reused output drifts from the true output of the
   cached trajectory by relL1 > `correction_tol`, the cell becomes COMPUTE (and refreshes the cache). On a single
   calibration input the replayed plan then keeps every reused module within `correction_tol` of what it would
   have computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

from dcache import Action, MethodConfig, Schedule, knob, register_method

from .calibrated_plans import CalibratedPlanSchedule, calibrated_plan


@register_method
@dataclass(frozen=True)
class InvarDiffConfig(MethodConfig):
    """InvarDiff: a calibrated per-step x per-block x per-module reuse plan from invariance statistics.

    Paper: "InvarDiff", https://arxiv.org/abs/2512.05134 (dcache's formulation: thresholds are quantile levels).

    Use it for a fine-grained static plan from one calibration pass (`calibrate_invardiff`; the bundled model
    ships a plan).

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "invardiff") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "invardiff"
    title = "InvarDiff"
    # `dcache calibrate --method invardiff`: the plan that build() replays
    calibrator = ("plan", "dcache.schedules.tuning.invardiff_calibration:calibrate_invardiff")
    nonskip_ratio: float = knob(0.1, low=0.0, high=1.0, doc="fraction of the first steps never reused")
    step_quantile: float = knob(0.6, low=0.0, high=1.0, doc="step gate: quantile level of the step change below "
                                                             "which a whole step is reused (0 = no step reuse)")
    module_quantile: float = knob(0.8, low=0.0, high=1.0, doc="quantile level of a module type's change below which "
                                                               "the module is reused (0 = none)")
    module_quantiles: dict = knob({}, doc="per module name overrides of module_quantile, e.g. {'ff': 0.6, "
                                          "'attn': 0.3}")
    token_quantile: float = knob(0.9, low=0.0, high=1.0, doc="quantile over tokens of the per-token relative change "
                                                              "(the invariance statistic)")
    max_consecutive: int = knob(3, low=1, high=1000, doc="most consecutive reuses of a module")
    correction: bool = knob(True, doc="second calibration pass: turn reuses whose real drift exceeds "
                                      "correction_tol into computes")
    correction_tol: float = knob(0.5, low=0.0, high=100.0, doc="largest relL1 drift of a reused module output "
                                                                 "(correction pass)")
    plan: str | None = knob(None, types=(str,), doc="path of a calibrated InvarDiff plan file")
    calibration: str | None = knob(None, types=(str,), doc="the file `dcache calibrate --method invardiff` wrote:"
                                   " a plan, or a calibration file holding this method's plan for the model")

    def check(self) -> None:
        for name, q in self.module_quantiles.items():
            if not isinstance(name, str) or isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 1:
                raise self.invalid("module_quantiles", self.module_quantiles,
                                   "a dict of module name -> quantile level in [0, 1]",
                                   "per module name overrides of module_quantile")

    def level(self, module: str) -> float:
        return float(self.module_quantiles.get(module, self.module_quantile))

    def build(self, model: nn.Module) -> Schedule:
        return InvarDiffSchedule(calibrated_plan("invardiff", model, plan=self.plan, calibration=self.calibration))


class InvarDiffSchedule(CalibratedPlanSchedule):
    method = "invardiff"


# ----------------------------------------------------------------------------------------------------------------
# Thresholding (pure math)
# ----------------------------------------------------------------------------------------------------------------

def invariance_rows(num_steps: int, modules: Sequence[str], d_unit: Callable[[int, int], float],
                    d_step: Callable[[int], float], config: InvarDiffConfig,
                    quantile: Callable[[Sequence[float], float], float]) -> tuple[list[str], list[bool]]:
    """Action rows (one char per module unit) of one branch, and the step gate per step."""
    n, units = num_steps, len(modules)
    first = max(1, math.ceil(config.nonskip_ratio * n - 1e-9))
    eligible = list(range(first, n))
    gate = [False] * n
    if config.step_quantile > 0 and eligible:
        cut = quantile([d_step(t) for t in eligible], config.step_quantile)
        for t in eligible:
            gate[t] = math.isfinite(d_step(t)) and d_step(t) <= cut
    cuts = {}
    for s in set(modules):
        level = config.level(s)
        values = [d_unit(t, u) for t in eligible for u in range(units) if modules[u] == s]
        cuts[s] = quantile(values, level) if level > 0 else -math.inf
    grid = [[Action.COMPUTE.value] * units for _ in range(n)]
    for t in eligible:
        for u in range(units):
            d = d_unit(t, u)
            if gate[t] or (math.isfinite(d) and d <= cuts[modules[u]]):
                grid[t][u] = Action.REUSE.value
    for u in range(units):  # cut runs of reuse
        run = 0
        for t in range(n):
            if grid[t][u] == Action.REUSE.value:
                run += 1
                if run > config.max_consecutive:
                    grid[t][u], run = Action.COMPUTE.value, 0
            else:
                run = 0
    return ["".join(r) for r in grid], gate

__all__ = ["InvarDiffConfig", "InvarDiffSchedule", "invariance_rows"]
