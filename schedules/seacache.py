"""SeaCache (spectral-evolution-aware cache, arXiv 2602.18993; diffusers' `SeaCacheConfig`): gate the whole stack by
the accumulated change of a denoised view of the input, and forecast its residual linearly while skipping.

Per branch, each call measures (Signal.SPECTRAL_REL_L1, dcache.spectral)
    d_t = relL1(I_t, I_{t-1}),   I_t = the noisy latents filtered by the Wiener gain of noise level sigma_t
the relative change of the SEA indicator since the previous call (the indicator is refreshed at every call, computed
or not). The stack computes at the first `retention_steps` and last `cache_end_steps` steps, on the first call of a
branch, after `max_consecutive` skipped calls in a row, and when the accumulated distance reaches the threshold:
    acc + d_t >= threshold  ->  compute, acc = 0            else  ->  skip, acc += d_t
A skipped call adds to its input the stack residual R = h_out - h_in extrapolated from the last computed calls:
order 1 (SeaCache's default) is the line through the last two, R_s + (R_s - R_s') (t - s) / (s - s'); order 0 reuses
R_s; order 2 (dcache only; SeaCache allows 0 and 1) adds the second difference of the last three. One residual
history of (order + 1) tensors per branch.

What differs from diffusers' hook: the engine applies the residual to the hidden stream and extrapolates the text
stream's residual too (diffusers reuses the text stream's last output); the noise level is the scheduler timestep /
1000 (diffusers reads the pipeline's `cache_context(sigma=...)`), which is the same number for flow-matching
schedulers. Latents the adapter cannot lay out on a grid (packed tokens without an adapter `latents` function) are
compared unfiltered.

On the bundled tiny model the SEA distance is largest in the first steps (0.95 at step 1, 0.06 from step 11 on), so
the gate spends its computes early, while this model's forecasts go wrong mostly at the end: the cap
`max_consecutive` does most of the work there (max_consecutive=2 with a loose threshold is a fixed 1-compute /
2-forecast cadence).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, Schedule, Signal, knob
from dcache import register_method, register_preset


@register_method
@dataclass(frozen=True)
class SeaCacheConfig(MethodConfig):
    """SeaCache: gate the stack by the change of a spectrally denoised view of the input; forecast while skipping.

    Paper: "SeaCache", spectral-evolution-aware caching, https://arxiv.org/abs/2602.18993.

    Use it where the latents have a known spatial layout (dcache.spectral). Its gate-less cadence with a quadratic
    forecast in call scope (`seacache-cadence`, order=2, scope="call") has the best held-out PSNR of the dynamic
    schedules at compute ratios ~0.5 and ~0.25 on the bundled model (BENCHMARKS.md).

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "seacache") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "seacache"
    threshold: float = knob(0.25, low=0.0, high=1000.0, doc="accumulated relL1 change of the SEA indicator at which "
                                                            "the stack is computed again (larger = more reuse)")
    order: int = knob(1, low=0, high=2, doc="residual extrapolation: 0 = reuse the last residual, 1 = line through "
                                            "the last two computed calls (SeaCache), 2 = parabola through three")
    retention_steps: int = knob(1, low=0, high=100_000, doc="first steps always computed")
    cache_end_steps: int = knob(1, low=0, high=100_000, doc="last steps always computed")
    max_consecutive: int = knob(2, low=0, high=100_000, doc="most skipped calls in a row (0 = no limit)")
    power: float = knob(3.0, low=0.1, high=10.0, doc="p of the clean-signal power prior |f|^-p of the SEA filter "
                                                     "(SeaCache: 3)")
    gate: bool = knob(True, doc="False: no SEA indicator is computed and the caps alone decide (retention_steps, "
                                "cache_end_steps, max_consecutive): a fixed cadence without the indicator's per-call "
                                "cost (FFTs of the latents), e.g. 1 compute + 2 forecasts with max_consecutive=2")

    def check(self) -> None:
        if not self.gate and self.max_consecutive == 0:
            raise self.invalid("max_consecutive", 0, ">= 1 when gate=False (without the gate the cap is the only "
                                                     "thing that computes again; 2 gives 1 compute + 2 forecasts)")

    def build(self, model: nn.Module) -> Schedule:
        return SeaCacheSchedule(self)


class SeaCacheSchedule(Schedule):
    granularity = Granularity.STACK
    signals = frozenset({Signal.SPECTRAL_REL_L1})

    def __init__(self, config: SeaCacheConfig):
        self.config = config
        self.forecast_order = config.order
        self.spectral_power = config.power  # read by the engine's SPECTRAL_REL_L1 filter
        self.name = "seacache"
        if not config.gate:
            self.signals = frozenset()  # the engine then measures nothing
        self._state: dict[str, list[float]] = {}  # branch -> [accumulated distance, skipped calls in a row]

    def reset(self, generation: GenerationInfo) -> None:
        self._state = {}

    def decide(self, ctx: CallContext) -> Action:
        c = self.config
        n = ctx.num_steps
        acc = self._state.setdefault(ctx.branch, [0.0, 0])
        # None on a branch's first call; without the gate the engine's feasibility check computes that call
        d = ctx.signals.get(Signal.SPECTRAL_REL_L1) if c.gate else 0.0
        forced = (d is None or ctx.step < c.retention_steps or (n is not None and ctx.step >= n - c.cache_end_steps)
                  or (c.max_consecutive > 0 and acc[1] >= c.max_consecutive))
        if not forced and acc[0] + d < c.threshold:
            acc[0] += d
            acc[1] += 1
            return Action.FORECAST if c.order > 0 else Action.REUSE
        acc[0], acc[1] = 0.0, 0
        return Action.COMPUTE

    def config_dict(self) -> dict:
        return self.config.to_dict()


register_preset("seacache-cadence", "seacache", "no gate: the cap decides (1 compute, 2 linear forecasts, the first "
                                              "and last steps computed)", gate=False, max_consecutive=2)
