"""Adaptive keyframes: the next computed step chosen at run time from the forecast error just measured.

The `keyframe` method computes at fixed positions that a search fitted to one model and one set of prompts; on a
model it was not searched on, uniform keyframes often do better (BENCHMARKS.md, "Tuned on one model, measured on
another"). This schedule places its computed steps while it runs, the way an ODE solver controls its step size:

  * at every computed step c the branch's output residual R_c (stack scope: stack output - input; call scope:
    Delta = v - x) is compared with what the forecast from the earlier computed steps would have served there,
        e = relL1(R_c, R^_c) = sum|R_c - R^_c| / sum|R_c|                      (signal "keyframe_error")
    (measured after the call, delivered with the branch's next decision: no extra host sync);
  * the forecast error grows with the gap h like h^q (q = p + 1 for a Taylor series of order p in theory; q is
    fitted on the (gap, error) pairs this generation measured, see `growth`), so the next gap is
        tolerance mode:     h' = h * min(2, safety * (tolerance / e)^(1 / q))
        compute_ratio mode: h' = base * min(1, (e_ref / e)^(1 / q)),   base = steps left / computes left,
                            e_ref = geometric mean of the errors measured in this generation
                            (a gap shortened where the error is high widens the gaps after it),
    rounded and clamped to [1, max_gap]; the next compute is at c + h'.

With `compute_ratio` (default 0.25) the budget is a hard cap: round(compute_ratio * N) computed calls per branch
(warm-up included); the errors only move them to where the forecast struggles. With `tolerance` the count follows
the model and the prompt. With split CFG the first branch of the generation places the computed steps and the
others compute at the same steps, so the branches' forecast errors stay correlated and cancel in the guided
velocity (a batched-CFG call decided per sample runs each half on its own: use decisions="batch" there). The
decision reads only the step and past measurements, so it works in block and call scope with every forecaster
(`forecaster=`), and a ControlNet can follow it (controlnet="follow": the ControlNet, which runs first, is given the
decision the transformer will take with the errors it will read, and computes at the same steps).

Memory: the cache's (order + 1) tensors per branch, plus the same again for the error measurement's own forecast
history (latent-sized in call scope, the stack residual's size in block scope; counted as signal memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, knob
from dcache import register_method
from dcache.runtime.signal_providers import ProviderView, SignalProvider, register_signal
from dcache.runtime.cache_state import UnitHistory

from .forecasters import config_forecaster, forecaster_knob


def _measure_error(view: ProviderView) -> torch.Tensor | None:
    """After a computed call: [sum|R - R^|, sum|R|] (relL1 of the residual against the forecast from the earlier
    computed steps of this branch), then R joins the history. None until the history holds two computed steps."""
    residual = (view.output - view.hidden).detach()
    history = view.memory.get("history")
    value = None
    if history is not None and history.filled >= 2 and history.matches([residual]):
        predicted = history.forecast(view.step)[0]
        value = torch.stack([(residual - predicted).abs().sum(), residual.abs().sum()]).float()
    if history is None or not history.matches([residual]):
        history = view.memory["history"] = UnitHistory(max(1, min(view.schedule.config.order, 3)))
    history.update([residual], view.step)
    return value


KEYFRAME_ERROR = register_signal(SignalProvider(
    "keyframe_error", _measure_error, phase="computed",
    doc="relL1 of a computed call's residual against the Taylor forecast from the branch's earlier computed steps "
        "(adaptive_keyframe)"))


@register_method
@dataclass(frozen=True)
class AdaptiveKeyframeConfig(MethodConfig):
    """Adaptive keyframes: compute where the measured forecast error says the forecast would drift, forecast the rest.

    Paper: none (dcache's own schedule); the forecast is TaylorSeer's (https://arxiv.org/abs/2503.06923) or any
    dcache forecaster, and the gap control is the standard step-size rule of adaptive ODE solvers
    (h' = h (tol / err)^(1 / (p + 1))).

    Use it on a model or prompts no keyframe search was run on: ask for a compute ratio (a hard budget; the errors
    decide where the computed steps go) or an error tolerance (the budget follows the model). It reads one signal
    measured after computed calls, so it runs in call scope and a ControlNet can follow it (controlnet="follow").

    Example (the bundled tiny model, 28 steps, split CFG: 7 computed calls per branch):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "adaptive_keyframe", compute_ratio=0.25, scope="call") as handle:
        ...     image = pipe("3").images[0]
        >>> round(handle.stats().compute_ratio, 2)
        0.25
    """

    method = "adaptive_keyframe"
    compute_ratio: float | None = knob(0.25, low=0.0, high=1.0, types=(float, int, type(None)),
                                       doc="computed calls per branch / steps: a hard budget (warm-up included); "
                                           "None with `tolerance` set")
    tolerance: float | None = knob(None, low=0.0, types=(float, int),
                                   doc="instead of a ratio: the relL1 forecast error to hold at each computed step "
                                       "(e.g. 0.05); the number of computed steps follows the model")
    order: int = knob(2, low=1, high=3, doc="Taylor order of the forecast between computed steps")
    warmup_steps: int = knob(1, low=1, doc="first steps always computed (step 0 at least: nothing is cached before)")
    max_gap: int | None = knob(None, low=1, types=(int, type(None)),
                               doc="most steps from one computed step to the next (None: no limit but the budget)")
    safety: float = knob(0.9, low=0.1, high=1.0, doc="tolerance mode: factor on the predicted gap")
    forecaster: str | dict = forecaster_knob()

    def check(self) -> None:
        config_forecaster(self)
        if self.compute_ratio is None and self.tolerance is None:
            raise self.invalid("compute_ratio", None, "a number in (0, 1], or None with a `tolerance` given")
        if self.compute_ratio is not None and self.tolerance is not None:
            raise self.invalid("tolerance", self.tolerance, "None while compute_ratio is set (pass "
                               "compute_ratio=None to hold a tolerance instead)")
        if self.compute_ratio is not None and self.compute_ratio <= 0:
            raise self.invalid("compute_ratio", self.compute_ratio, "> 0")
        if self.tolerance is not None and self.tolerance <= 0:
            raise self.invalid("tolerance", self.tolerance, "> 0")

    def build(self, model: nn.Module) -> Schedule:
        return AdaptiveKeyframeSchedule(self)


def growth(gaps: list[float], errors: list[float], order: int) -> float:
    """The exponent q of e ~ h^q, fitted by least squares on log e against log h over this generation's computed
    steps, clamped to [0.5, order + 1]; 1 until two different gaps were measured. In theory q = order + 1 (the
    Taylor remainder), but the errors measured on real models grow far slower (on the bundled digit model relL1 0.03
    over one step and 0.08 over five: q ~ 0.6), and the theoretical exponent would barely move the gaps."""
    if len(set(gaps)) < 2:
        return 1.0
    xs, ys = [math.log(h) for h in gaps], [math.log(e) for e in errors]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return min(max(slope, 0.5), order + 1.0)


MAX_GROWTH = 2.0  # tolerance mode: the next gap is at most this times the last one


@dataclass
class _Branch:
    """One branch's placement state within a generation."""

    next_compute: int = 0
    last_compute: int | None = None
    gap: float = 1.0  # the gap that led to the last computed step
    computed: int = 0
    waiting: bool = False  # a computed step whose error has not arrived yet
    errors: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # the gap each error was measured over


class AdaptiveKeyframeSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset({KEYFRAME_ERROR})

    def __init__(self, config: AdaptiveKeyframeConfig):
        super().__init__(config)
        self.forecaster = config_forecaster(config)
        self._branches: dict[str, _Branch] = {}
        self._num_steps = 0
        self._leader: str | None = None
        self._taken: dict[int, Action] = {}

    def reset(self, generation: GenerationInfo) -> None:
        if generation.num_steps is None:
            raise ValueError("adaptive_keyframe spreads its computed steps over the generation, so it needs the step "
                             "count: pass dcache.apply(transformer, 'adaptive_keyframe', num_steps=N) when the "
                             "transformer is used without a pipeline's scheduler.")
        super().reset(generation)
        self._num_steps = generation.num_steps
        self._branches = {}
        self._leader: str | None = None  # the generation's first branch: the others follow its placement
        self._taken: dict[int, Action] = {}  # step -> the leader's action

    def budget(self) -> int | None:
        """Computed calls per branch in ratio mode (at least the warm-up), None in tolerance mode."""
        c = self.config
        if c.compute_ratio is None:
            return None
        return max(min(c.warmup_steps, self._num_steps), round(c.compute_ratio * self._num_steps))

    def decide(self, ctx: CallContext) -> Action:
        if self._leader is None:
            self._leader = ctx.branch
        if ctx.branch != self._leader and ctx.step in self._taken:
            # split CFG: the other branches compute where the first one did, so that the branches' forecast errors
            # stay correlated and cancel in v_u + g (v_c - v_u) (placed apart, they reach the sample amplified)
            return self._taken[ctx.step]
        action = self._decide_own(ctx)
        if ctx.branch == self._leader:
            self._taken[ctx.step] = action
        return action

    def _decide_own(self, ctx: CallContext) -> Action:
        state = self._branches.setdefault(ctx.branch, _Branch())
        error = ctx.signals.get(KEYFRAME_ERROR)
        if state.waiting:  # the error of the last computed step arrives with this call (None: too little history)
            state.waiting = False
            self._place_next(state, error)
        budget = self.budget()
        due = ctx.step < self.config.warmup_steps or ctx.step >= state.next_compute
        if due and (budget is None or state.computed < budget):
            if state.last_compute is not None:
                state.gap = float(ctx.step - state.last_compute)
            state.last_compute, state.computed, state.waiting = ctx.step, state.computed + 1, True
            state.next_compute = ctx.step + self._base_gap(state)  # until its error arrives
            return Action.COMPUTE
        return Action.FORECAST

    def _base_gap(self, state: _Branch) -> int:
        """The gap that spreads the computed calls left evenly over the steps left (ratio mode), or 2."""
        budget = self.budget()
        if budget is None:
            return 2
        left = budget - state.computed
        if left <= 0:
            return self._num_steps  # budget spent: forecast to the end
        steps_left = self._num_steps - 1 - (state.last_compute or 0)
        return max(1, min(self._max_gap(), round(steps_left / left)))

    def _place_next(self, state: _Branch, error: float | None) -> None:
        """Move the next computed step by the error measured at the last one (see the module docstring)."""
        c = self.config
        if error is None or not math.isfinite(error) or state.last_compute is None:
            return
        error = max(error, 1e-6)
        state.errors.append(error)
        state.gaps.append(state.gap)
        exponent = 1.0 / growth(state.gaps, state.errors, c.order)
        if c.tolerance is not None:
            # at most twice the last gap per computed step, as ODE step-size controllers limit growth: an error
            # measured over a short gap says little about one four times longer
            gap = state.gap * min(MAX_GROWTH, c.safety * (c.tolerance / error) ** exponent)
        else:
            if self.budget() - state.computed <= 0:
                return
            reference = math.exp(sum(math.log(e) for e in state.errors) / len(state.errors))
            # never wider than the even spread of what is left: a gap shortened here widens the later ones
            # (base grows), so the budget is spent exactly, the last compute at the last step
            gap = self._base_gap(state) * min(1.0, (reference / error) ** exponent)
        state.next_compute = state.last_compute + max(1, min(self._max_gap(), round(gap)))
        if c.compute_ratio is not None:  # a budget left is spent by the last step
            state.next_compute = min(state.next_compute, self._num_steps - 1)

    def _max_gap(self) -> int:
        return self.config.max_gap if self.config.max_gap is not None else self._num_steps

    def plan_extras(self) -> dict:
        return {}  # exported plans do not carry its forecaster (a replay forecasts with Taylor)
