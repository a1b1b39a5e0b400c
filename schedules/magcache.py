"""MagCache (arXiv 2506.09045): skip steps while the accumulated magnitude-ratio error stays under a budget.

Per branch s (cond / uncond keep separate accumulators and residuals):
    for step i >= retain (= int(retention_ratio * N + 0.5)):
        acc_ratio *= gamma_i;  acc_steps += 1;  acc_err += |1 - acc_ratio|
        reuse the cached stack residual if acc_err <= threshold and acc_steps <= max_skip_steps
        else reset (acc_ratio, acc_steps, acc_err) = (1, 0, 0) and compute
gamma_i = mean_tokens ||R_i|| / ||R_{i-1}|| is a per-model curve calibrated once (`dcache calibrate`); it is
nearest-interpolated to other step counts.

dcache additions, both off by default (the reference): `order` 1 or 2 forecasts the skipped steps' residual by
Taylor extrapolation from the last computed steps (SeaCache's linear residual, TaylorSeer's series) instead of
reusing the last one, with the same magnitude budget deciding where to compute; `cutoff_steps` always computes the
last steps. On the bundled tiny model (28 steps, E0.1 K4 R0) order 1 with the last step computed gives 55.5 dB PSNR
at compute ratio 0.50; plain reuse with the same budget gives 43.2 dB at 0.46.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from dcache import (Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, Signal,
                    knob, register_method)
from dcache.files.checks import is_number
from dcache.plans.plan import nearest_interp

from .calibration_file import MAX_TABLE_STEPS
from .tables import known_identities, lookup_table, model_identity


@register_method
@dataclass(frozen=True)
class MagCacheConfig(MethodConfig):
    """MagCache: skip whole steps while the accumulated magnitude-ratio error stays within a budget.

    Paper: Ma et al., "MagCache: Fast Video Generation with Magnitude-Aware Cache", https://arxiv.org/abs/2506.09045.

    Use it for step-level reuse on a model with a calibrated magnitude-ratio curve (`dcache calibrate --method
    magcache`; the bundled model ships one). `order=1` forecasts the skipped steps: on the bundled model 55.5 dB
    instead of 43.2 dB with plain reuse, at compute ratio ~0.5.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "magcache", threshold=0.1) as handle:
        ...     image = pipe("3").images[0]
    """

    method = "magcache"
    # `dcache calibrate --method magcache`: the magnitude-ratio table, merged into a calibration file
    calibrator = ("table", "dcache.schedules.tuning.calibrate:calibrate_magcache")
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("threshold", (0.02, 0.04, 0.06, 0.1, 0.15, 0.24, 0.4, 0.6))
    # the settings that seed a plan search (dcache search --method ecad) with this method's plans
    search_seeds = {"magcache-forecast": tuple(dict(max_skip_steps=4, retention_ratio=0.0, order=1, cutoff_steps=1,
                                                   threshold=t) for t in (0.05, 0.1, 0.2, 0.4))}
    threshold: float = knob(0.06, low=0.0, high=100.0, doc="error budget E: accumulated |1 - prod(gamma)| allowed "
                                                             "while reusing")
    max_skip_steps: int = knob(3, low=0, high=10_000, doc="K: most consecutive reused steps")
    retention_ratio: float = knob(0.2, low=0.0, high=1.0, doc="R: fraction of the first steps always computed")
    order: int = knob(0, low=0, high=2, doc="skipped steps: 0 = reuse the last computed residual (MagCache), 1 / 2 = "
                                            "its Taylor extrapolation from the last 2 / 3 computed steps")
    cutoff_steps: int = knob(0, low=0, high=10_000, doc="last steps always computed (0 = the budget decides, as "
                                                        "MagCache)")
    ratios: tuple | None = knob(None, types=(tuple, list), doc="calibrated gamma per step (cond / single branch); "
                                                                "None = the model's registered table")
    ratios_uncond: tuple | None = knob(None, types=(tuple, list), doc="gamma per step for the uncond branch")
    probe_blocks: int = knob(0, low=0, high=1000, doc="front blocks always computed")
    tail_blocks: int = knob(0, low=0, high=1000, doc="back blocks always computed")
    calibration: str | None = knob(None, types=(str,), doc="path of a calibration JSON (calibrate_magcache) to take "
                                                           "the ratios from; among several entries of the model, the "
                                                           "one with the generation's step count is used")

    def check(self) -> None:
        for name in ("ratios", "ratios_uncond"):
            table = getattr(self, name)
            if table is not None and (len(table) < 1 or any(not isinstance(g, (int, float)) or g <= 0
                                                            for g in table)):
                raise self.invalid(name, table, "a non-empty list of positive magnitude ratios")
            if table is not None:  # lists (from JSON) and tuples compare equal after a round trip
                object.__setattr__(self, name, tuple(float(g) for g in table))

    @staticmethod
    def check_calibration_table(table: Any) -> list[tuple[str, str]]:
        """{"cond": [gamma per step], "uncond": [...] or null}: gamma = ||R_t|| / ||R_t-1||, finite and > 0 (a zero
        or NaN ratio makes every accumulated error 1 or NaN: nothing is ever reused)."""
        what = f"a list of 1..{MAX_TABLE_STEPS} finite magnitude ratios > 0, one per step"
        if not isinstance(table, dict):
            return [("table", '{"cond": [ratios], "uncond": [ratios] or null}')]
        bad = [] if _ratios(table.get("cond")) else [("table.cond", what)]
        if table.get("uncond") not in (None, []) and not _ratios(table.get("uncond")):
            bad.append(("table.uncond", what + " (or null)"))
        return bad

    def build(self, model: nn.Module) -> Schedule:
        ratios, uncond = self.ratios, self.ratios_uncond
        if ratios is None and self.calibration is not None:
            from .calibration_file import load_calibration

            cal = load_calibration(self.calibration)
            identity = model_identity(model)
            entries = [e for e in cal.entries if e.method == "magcache" and e.model_identity == identity]
            if not entries:
                raise ValueError(f"MagCacheConfig.calibration={self.calibration!r} has no MagCache entry for "
                                 f"{identity}; calibrate this model with calibrate_magcache(...).")
            by_steps = {e.num_steps: (tuple(e.table["cond"]), tuple(e.table["uncond"]) if e.table.get("uncond")
                                      else None) for e in entries}
            longest = by_steps[max(by_steps, key=lambda n: n or 0)]
            return MagCacheSchedule(self, longest[0], longest[1], by_steps)
        if ratios is None:
            table = lookup_table("magcache", model)
            if table is None:
                warnings.warn(
                    f"dcache: MagCache has no calibrated magnitude ratios for {model_identity(model)} (registered: "
                    f"{known_identities('magcache') or 'none'}), so the first generation computes every step and "
                    f"measures them; later generations cache with the measured curve. To start caching from the "
                    f"first generation, calibrate once and keep the file: `dcache calibrate --model <model> --method "
                    f"magcache --out magcache.json`, then `--cache magcache --set calibration=magcache.json` "
                    f"(Python: dcache.apply(pipe, 'magcache', calibration='magcache.json')).",
                    MagCacheSelfCalibration, stacklevel=4)
                return MagCacheSchedule(self, None, None)
            ratios, uncond = table.get("cond"), table.get("uncond")
        return MagCacheSchedule(self, tuple(ratios), tuple(uncond) if uncond else None)


def _ratios(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and 1 <= len(v) <= MAX_TABLE_STEPS and all(is_number(g, 0.0) and g > 0
                                                                                   for g in v)


class MagCacheSelfCalibration(UserWarning):
    """MagCache found no calibration for the model and measures its magnitude ratios on the first generation."""


class MagCacheSchedule(MethodSchedule):
    granularity = Granularity.STACK

    def __init__(self, config: MagCacheConfig, ratios: tuple | None, ratios_uncond: tuple | None,
                 by_steps: dict | None = None):
        """ratios None: no calibration; the first complete generation computes every step and measures gamma per
        branch (the engine's RESIDUAL_NORM_RATIO signal, delivered with each branch's next call), then caches."""
        super().__init__(config)  # probe / tail blocks and forecast_order from the knobs
        self.ratios, self.ratios_uncond = ratios, ratios_uncond
        self.measured: dict[str, tuple[float, ...]] = {}  # branch -> gamma per step, once self-calibrated
        self._measuring: dict[str, dict[int, float]] = {}  # branch -> {step: gamma} of the running generation
        self._ran: dict[str, list[int]] = {}
        self.calibrating = ratios is None  # this generation measures (computes every step)
        self.signals = frozenset({Signal.RESIDUAL_NORM_RATIO}) if self.calibrating else frozenset()
        self._by_steps = by_steps or {}  # calibrated step count -> (ratios, ratios_uncond), from a calibration file
        self._default = (ratios, ratios_uncond)
        self._state: dict[str, list[float]] = {}
        self._curves: dict[str, list[float]] = {}
        self._num_steps: int | None = None

    def reset(self, generation: GenerationInfo) -> None:
        self.calibrating = self._default[0] is None
        self.signals = frozenset({Signal.RESIDUAL_NORM_RATIO}) if self.calibrating else frozenset()
        self._state = {}
        self._curves = {}
        self._measuring = {}
        self._ran: dict[str, list[int]] = {}  # branch -> [first, last] step it ran this generation
        self._num_steps = generation.num_steps
        # a table calibrated for exactly this step count, else the default (interpolated to the step count)
        self.ratios, self.ratios_uncond = self._by_steps.get(generation.num_steps, self._default)

    def end(self, complete: bool) -> None:
        if self.calibrating and complete:
            self._finish_measurement()

    def _finish_measurement(self) -> None:
        """Keep the generation's curves: gamma of every step a branch ran (an expert of a two-transformer pipeline
        runs a range of steps; the others are never read, 1.0). Its first step has no ratio (1.0) and the ratio of
        its last would only arrive with a next call, so that step repeats the one before (the curve is flat there)."""
        curves = {}
        for branch, seen in self._measuring.items():
            first, last = self._ran[branch]
            if last - first < 2 or any(i not in seen for i in range(first + 1, last)):
                return  # too short, or a gap: measure again on the next generation
            curve = [1.0] * max(self._num_steps or 0, last + 1)
            for i in range(first + 1, last):
                curve[i] = seen[i]
            curve[last] = curve[last - 1]
            curves[branch] = tuple(curve)
        if curves:
            self.measured = curves
            first_curve = next(iter(curves.values()))
            self._default = (curves.get("cond", first_curve), curves.get("uncond"))

    def measured_config(self) -> dict | None:
        """{"ratios": gamma per step (cond / single branch), "ratios_uncond": ...} once self-calibrated."""
        if not self.measured:
            return None
        ratios, uncond = self._default
        return {"ratios": list(ratios), "ratios_uncond": list(uncond) if uncond else None}

    def _curve(self, branch: str, num_steps: int) -> list[float]:
        curve = self._curves.get(branch)
        if curve is None:
            table = self.measured.get(branch) or (
                self.ratios_uncond if (branch == "uncond" and self.ratios_uncond) else self.ratios)
            curve = self._curves[branch] = list(table) if len(table) == num_steps else nearest_interp(list(table),
                                                                                                      num_steps)
        return curve

    def decide(self, ctx: CallContext) -> Action:
        if self.calibrating:
            gamma = ctx.signals.get(Signal.RESIDUAL_NORM_RATIO)  # ||R|| ratio of this branch's previous step
            seen = self._measuring.setdefault(ctx.branch, {})
            if gamma is not None and ctx.step >= 1:
                seen[ctx.step - 1] = float(gamma)
            ran = self._ran.setdefault(ctx.branch, [ctx.step, ctx.step])
            ran[1] = ctx.step
            return Action.COMPUTE
        n = ctx.num_steps or len(self.ratios)
        retain = int(self.config.retention_ratio * n + 0.5)
        acc = self._state.setdefault(ctx.branch, [1.0, 0.0, 0.0])  # acc_ratio, acc_steps, acc_err
        if ctx.step < max(retain, 1) or ctx.step >= n:
            return Action.COMPUTE
        if ctx.step >= n - self.config.cutoff_steps:
            acc[:] = [1.0, 0.0, 0.0]
            return Action.COMPUTE
        acc[0] *= self._curve(ctx.branch, n)[ctx.step]
        acc[1] += 1
        acc[2] += abs(1.0 - acc[0])
        if acc[2] <= self.config.threshold and acc[1] <= self.config.max_skip_steps:
            return self.served
        acc[:] = [1.0, 0.0, 0.0]
        return Action.COMPUTE
