"""EasyCache (arXiv 2507.02860): runtime-adaptive step reuse from the transformation rate k, no calibration.

EasyCache treats the DiT as a map x -> v and observes that after warm-up the transformation rate
k = mean|v_t - v_last| / mean|x_t - x_last| between consecutive full computations is nearly constant, so the output
change after a skipped step is predicted from the input change alone:
    eps_t = k * mean|x_t - x_prev| / mean|v_last|          (predicted relative output change of this call)
    acc  += eps_t;  reuse while acc < tau, else compute and reset acc = 0
A reused call returns x_t + Delta with Delta = v_last - x_last, the transformation vector of the last computation.

dcache's adaptation: x and v are the hidden states entering the first block and leaving the last block (the stack
input / output, where dcache's engine caches), not the raw latent input / model output of the reference code; so
Delta is exactly the cached stack residual, and EasyCache works on any DiT whose stack keeps the token shape. The
signals (dcache.actions.Signal): INPUT_DELTA = mean|x_t - x_prev call| (pre), and from the last computed call of the
branch OUTPUT_DELTA = mean|v - v_prev compute|, INPUT_DELTA_COMPUTED = mean|x - x_prev compute|, OUTPUT_MEAN =
mean|v|. k needs two computed calls after which both deltas exist; until then the call computes.

The first `ret_steps` (default: `ret_ratio` = 20% of the steps, as the reference's 10 of 50) and the last
`cutoff_steps` steps always compute. With split CFG the reference decides on the cond call and the uncond call
follows (`follow_first_branch=True`); each branch still keeps its own k, accumulator and residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, Signal
from dcache import knob, register_method, register_preset

_EPS = 1e-12


@register_method
@dataclass(frozen=True)
class EasyCacheConfig(MethodConfig):
    """EasyCache: runtime-adaptive step reuse predicted from the transformation rate, no calibration.

    Paper: Zhou et al., "Less is Enough: Training-Free Video Diffusion Acceleration via Runtime-Adaptive Caching",
    https://arxiv.org/abs/2507.02860.

    Use it on any DiT without calibration data; it decides before the call, so `scope="call"` works.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "easycache", threshold=0.1) as handle:
        ...     image = pipe("3").images[0]
    """

    method = "easycache"
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("threshold", (0.01, 0.02, 0.035, 0.05, 0.08, 0.12, 0.2, 0.3))
    # the settings that seed a plan search (dcache search --method ecad) with this method's plans
    search_seeds = {"easycache": ({"threshold": 0.05}, {"threshold": 0.1})}
    threshold: float = knob(0.05, low=0.0, high=100.0, doc="tau: accumulated predicted relative output change below "
                                                           "which the call reuses (Wan2.1 0.05, HunyuanVideo 0.025)")
    ret_ratio: float = knob(0.2, low=0.0, high=1.0, doc="fraction of the first steps always computed (warm-up)")
    ret_steps: int = knob(-1, low=-1, high=100_000, doc="first steps always computed; -1 = ret_ratio * steps")
    cutoff_steps: int = knob(1, low=0, high=100_000, doc="last steps always computed")
    follow_first_branch: bool = knob(True, doc="with several CFG branches per step, the later branches take the "
                                               "decision of the step's first branch (as the reference's uncond "
                                               "call follows cond)")
    max_skip_steps: int = knob(-1, low=-1, high=100_000, doc="most reused steps in a row (-1 = no limit)")

    def build(self, model: nn.Module) -> Schedule:
        return EasyCacheSchedule(self)


class EasyCacheSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset({Signal.INPUT_DELTA, Signal.OUTPUT_DELTA, Signal.INPUT_DELTA_COMPUTED, Signal.OUTPUT_MEAN})

    def __init__(self, config: EasyCacheConfig):
        super().__init__(config)
        self._acc: dict[str, list[float]] = {}  # branch -> [acc, reused in a row]
        self._leader: dict[int, tuple[str, Action]] = {}  # step -> (first branch, its decision)

    def reset(self, generation: GenerationInfo) -> None:
        self._acc = {}
        self._leader = {}

    def warmup(self, num_steps: int | None) -> int:
        if self.config.ret_steps >= 0:
            return self.config.ret_steps
        return int(math.ceil(self.config.ret_ratio * num_steps - 1e-9)) if num_steps else 1

    @staticmethod
    def rate(signals: dict) -> float | None:
        """k = mean|v - v_last| / mean|x - x_last| between the last two computed calls (None until both exist)."""
        dv, dx = signals.get(Signal.OUTPUT_DELTA), signals.get(Signal.INPUT_DELTA_COMPUTED)
        if dv is None or dx is None or dx <= _EPS:
            return None
        return dv / dx

    def decide(self, ctx: CallContext) -> Action:
        leader = self._leader.get(ctx.step)
        if self.config.follow_first_branch and leader is not None and leader[0] != ctx.branch:
            action = leader[1]
            acc = self._acc.setdefault(ctx.branch, [0.0, 0])
            if action is Action.COMPUTE:
                acc[:] = [0.0, 0]
            return action  # the engine still computes if this branch has nothing cached yet
        action = self._decide_own(ctx)
        self._leader[ctx.step] = (ctx.branch, action)
        return action

    def _decide_own(self, ctx: CallContext) -> Action:
        c = self.config
        acc = self._acc.setdefault(ctx.branch, [0.0, 0])
        n = ctx.num_steps
        k = self.rate(ctx.signals)
        dx = ctx.signals.get(Signal.INPUT_DELTA)
        v_mean = ctx.signals.get(Signal.OUTPUT_MEAN)
        forced = ctx.step < max(self.warmup(n), 1) or (n is not None and ctx.step >= n - c.cutoff_steps)
        if forced or k is None or dx is None or not v_mean:
            acc[:] = [0.0, 0]
            return Action.COMPUTE
        acc[0] += k * dx / max(v_mean, _EPS)
        if acc[0] < c.threshold and (c.max_skip_steps < 0 or acc[1] < c.max_skip_steps):
            acc[1] += 1
            return Action.REUSE
        acc[:] = [0.0, 0]
        return Action.COMPUTE


register_preset("easycache-hunyuan", "easycache", "HunyuanVideo setting of the reference: tau 0.025, 5 of 50 warm-up "
                                                  "steps", threshold=0.025, ret_ratio=0.1)
register_preset("easycache-fast", "easycache", "more reuse: tau 0.1", threshold=0.1)
