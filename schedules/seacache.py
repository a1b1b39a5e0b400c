"""SeaCache (spectral-evolution-aware cache, arXiv 2602.18993; diffusers' `SeaCacheConfig`): gate the whole stack by
the accumulated change of a denoised view of the input, and forecast its residual linearly while skipping.

Per branch, each call measures (SPECTRAL_REL_L1, a signal provider registered below)
    d_t = relL1(I_t, I_{t-1}),   I_t = the noisy latents filtered by the Wiener gain of noise level sigma_t
the relative change of the SEA indicator since the previous call (the indicator is refreshed at every call, computed
or not; the mean over samples of the per-sample relative L1, as diffusers' SeaCache does). The filter, over the
latents' spatial (and temporal) frequencies f, is the Wiener gain of a clean signal whose power falls as |f|^-p,
observed in white noise of level sigma:

    g(f) = s P(f) / (s^2 P(f) + sigma^2),    P(f) = 1 / |f|^p,    s = 1 - sigma      (per axis, multiplied)

normalised to unit mean over the frequency grid so that indicators of different steps are comparable (SeaCache
Eq. 7). At high noise it keeps the low frequencies that carry the emerging image; at low noise it is nearly flat.
The latents come as [B, C, T, H, W] (dcache.runtime.latents).

The stack computes at the first `retention_steps` and last `cache_end_steps` steps, on the first call of a branch,
after `max_consecutive` skipped calls in a row, and when the accumulated distance reaches the threshold:
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

`forecaster` replaces the extrapolation of `order` by another one of the same history ('foca', 'hyca', 'spectrum',
'dmd': dcache.schedules.forecasters).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, ProviderView
from dcache import Schedule, knob, SignalProvider, register_method, register_preset, register_signal
from dcache.runtime.latents import call_latents

from .forecasters import config_forecaster, forecaster_knob

_EPS = 1e-16


@functools.lru_cache(maxsize=512)
def sea_gain(shape: tuple[int, ...], sigma: float, power: float, device: torch.device) -> torch.Tensor:
    """Unit-mean Wiener gain g(f) over the frequency grid of `shape` (the filtered axes), float32; read-only.

    Cached: a sampler visits the same few dozen noise levels in every generation (and both CFG branches of a step
    share one), and building the gain costs more Python than the FFT on small latents."""
    sigma = min(max(float(sigma), 1e-6), 1.0 - 1e-6)
    signal, noise = 1.0 - sigma, sigma
    gain = None
    for axis, size in enumerate(shape):
        freq = torch.fft.fftfreq(size, device=device, dtype=torch.float32)
        clean = 1.0 / (freq.abs().pow(power) + _EPS)  # zero frequency: 1e16 -> gain 1 / signal
        g = signal * clean / (signal * signal * clean + noise * noise + _EPS)
        view = [1] * len(shape)
        view[axis] = size
        gain = g.reshape(view) if gain is None else gain * g.reshape(view)
    mean = gain.mean()
    return torch.where(torch.isfinite(mean) & (mean > 0), gain / mean, gain)  # on the device: no host sync


def sea_filter(latents: torch.Tensor, sigma: float, power: float = 3.0) -> torch.Tensor:
    """latents [B, C, T, H, W] -> the SEA-filtered latents, same shape, float32 (FFT over T, H, W)."""
    x = latents.detach().float()
    dims = (-3, -2, -1)
    gain = sea_gain(tuple(x.shape[-3:]), sigma, power, x.device)
    return torch.fft.ifftn(torch.fft.fftn(x, dim=dims) * gain, dim=dims).real


def per_sample_rel_l1(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """mean over the batch of mean|x_i - ref_i| / mean|ref_i|: a [1] tensor on the device (no host sync)."""
    b = x.shape[0]
    num = (x - ref).abs().reshape(b, -1).mean(dim=1)
    den = ref.abs().reshape(b, -1).mean(dim=1) + _EPS
    return (num / den).mean().reshape(1)


def sea_indicator_change(view: ProviderView) -> torch.Tensor | None:
    """SPECTRAL_REL_L1 of one call: its noisy latents filtered at this step's noise level, vs the branch's previous
    call. Noise level sigma = scheduler timestep / 1000 (flow matching), else the step's position; the filter's power
    law is the schedule's `spectral_power` (SeaCache: 3). Latents without a known layout are compared unfiltered."""
    arguments, args = view.arguments, view.args
    hidden = arguments.get("hidden_states", args[0] if args else None)
    latents = call_latents(hidden, view.adapter.latents, arguments)
    if latents is None and not isinstance(hidden, torch.Tensor):
        return None  # no tensor to compare (e.g. a list of per-sample latents): no signal, the schedule computes
    timesteps, n, step = view.timesteps, view.num_steps, view.step
    sigma = (timesteps[step] / 1000.0 if timesteps and step < len(timesteps)
             else 1.0 - step / n if n else 0.5)
    indicator = (sea_filter(latents, sigma, getattr(view.schedule, "spectral_power", 3.0))
                 if latents is not None else hidden.detach().float())
    prev = view.memory.get("indicator")
    view.memory["indicator"] = indicator
    return per_sample_rel_l1(indicator, prev) if prev is not None and prev.shape == indicator.shape else None


SPECTRAL_REL_L1 = register_signal(SignalProvider(
    "spectral_rel_l1", sea_indicator_change,
    doc="relL1(I_t, I_prev_call), I = the call's noisy latents filtered by the noise level's Wiener gain (SeaCache's "
        "SEA indicator); mean of the per-sample values"))


@register_method
@dataclass(frozen=True)
class SeaCacheConfig(MethodConfig):
    """SeaCache: gate the stack by the change of a spectrally denoised view of the input; forecast while skipping.

    Paper: "SeaCache", spectral-evolution-aware caching, https://arxiv.org/abs/2602.18993.

    Use it where the latents have a known spatial layout (dcache.runtime.latents). Its gate-less cadence with a
    quadratic forecast in call scope (`seacache-cadence`, order=2, scope="call") has the best held-out PSNR of the
    dynamic schedules at compute ratios ~0.5 and ~0.25 on the bundled model (BENCHMARKS.md).

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "seacache") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "seacache"
    # the settings that seed a plan search (dcache search --method ecad) with this method's plans
    search_seeds = {"seacache-o2": tuple(dict(order=2, max_consecutive=2, threshold=t) for t in (0.14, 0.5, 4.0))}
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

    forecaster: str | dict = forecaster_knob()

    def check(self) -> None:
        config_forecaster(self)
        if not self.gate and self.max_consecutive == 0:
            raise self.invalid("max_consecutive", 0, ">= 1 when gate=False (without the gate the cap is the only "
                                                     "thing that computes again; 2 gives 1 compute + 2 forecasts)")

    def build(self, model: nn.Module) -> Schedule:
        return SeaCacheSchedule(self)


class SeaCacheSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset({SPECTRAL_REL_L1})

    def __init__(self, config: SeaCacheConfig):
        super().__init__(config)
        self.spectral_power = config.power  # read by the SPECTRAL_REL_L1 provider's filter
        self.forecaster = config_forecaster(config)  # None: the Taylor table of `order`
        if not config.gate:
            self.signals = frozenset()  # the engine then measures nothing
        self._state: dict[str, list[float]] = {}  # branch -> [accumulated distance, skipped calls in a row]

    def reset(self, generation: GenerationInfo) -> None:
        self._state = {}
        super().reset(generation)

    def decide(self, ctx: CallContext) -> Action:
        c = self.config
        n = ctx.num_steps
        acc = self._state.setdefault(ctx.branch, [0.0, 0])
        # None on a branch's first call; without the gate the engine's feasibility check computes that call
        d = ctx.signals.get(SPECTRAL_REL_L1) if c.gate else 0.0
        forced = (d is None or ctx.step < c.retention_steps or (n is not None and ctx.step >= n - c.cache_end_steps)
                  or (c.max_consecutive > 0 and acc[1] >= c.max_consecutive))
        if not forced and acc[0] + d < c.threshold:
            acc[0] += d
            acc[1] += 1
            return self.served
        acc[0], acc[1] = 0.0, 0
        return Action.COMPUTE


register_preset("seacache-cadence", "seacache", "no gate: the cap decides (1 compute, 2 linear forecasts, the first "
                                              "and last steps computed)", gate=False, max_consecutive=2)

# dcache's default method (dcache.apply(pipe), `dcache generate`): chosen on all three bundled models by
# benchmarks/default_choice.py, where it is within 1 dB of the best tuned setting that computes no more on each.
register_preset("cadence-2x", "seacache", "the default: every other step computed (the first and last too), a "
                "parabola through the last three computed calls on the others, whole calls reused; its decisions "
                "do not depend on the model or a calibration (compute ratio ~0.54, speed= sweeps max_consecutive)",
                scope="call", main_knob=("max_consecutive", (1, 2, 3, 4, 5, 6, 8)), gate=False, max_consecutive=1,
                order=2)
