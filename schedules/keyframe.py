"""Keyframe: compute the stack at a few keyframes placed in normalised time, forecast every other call.

A keyframe is a position f in [0, 1] of the generation; in a generation of N steps it computes the step
    s(f) = round(f * (N - 1))                       (keyframes that land on one step compute it once)
and every other call is a FORECAST: the engine's Taylor extrapolation (order O) of the unit's history over the
computed steps, in step units (TaylorSeer's table: d_0 = F(s_last), d_{k+1} = (d_k(s) - d_k(s')) / (s - s'), then
F(s) ~ sum_k d_k (s - s_last)^k / k!). Until O + 1 keyframes were computed the forecast uses the order they allow
(1 keyframe: reuse, 2: a line), so the order grows with the generation.

Because the keyframes are fractions, not step indices, one setting transfers to any step count, and split CFG
branches can have their own: the unconditional branch may compute fewer keyframes than the conditional one
(`uncond_keyframes`). That is what reaches compute ratios between the even ones: with CFG every step makes two
calls, so 0.125 at 28 steps is 7 of 56 calls = 4 cond + 3 uncond keyframes.

Why placement matters: the forecast error of a Taylor extrapolation grows with the distance to the last computed
step, so the best keyframes are not the uniform cadence of a fixed interval. On the bundled model (28 steps, CFG
1.5) a search on one tuning batch moved the 4-keyframe cadence {0, 9, 18, 27} to {0, 8, 15, 23} (34.1 -> 37.4 dB
PSNR vs uncached): leaving the last step uncomputed shortens every earlier interval. `benchmarks/frontier.py`
searches them (coordinate descent on the tuning batch, one keyframe moved at a time); the presets below are its
results.

With real guidance (CFG 3) the two branches' forecast errors reach the sample as g e_c - (g - 1) e_u, so an
unconditional branch one keyframe short of the conditional one costs several dB; `cfg_difference=True` (call scope)
serves the unconditional calls between its keyframes as the conditional output minus a forecast of the CFG
difference over the steps both computed (dcache.runtime.cfg_difference), which keeps the errors cancelling. Its uncond
keyframes should be a subset of the cond ones (the difference is only known where both computed). With an L2P
forecaster fitted on split-CFG runs, the difference is forecast by L2P's own table for it (`difference_weights`),
which can pay with even keyframes too: `dcache search --method keyframe --forecaster l2p` tries it per budget.

Memory: (order + 1) tensors per cached unit and branch (stack granularity: one residual per stream, or one Delta
in call scope).

`forecaster` replaces the Taylor series between keyframes by another extrapolation of the computed keyframes
('foca', 'hyca', 'spectrum', 'dmd', 'l2p': dcache.schedules.forecasters); Spectrum and FoCa use every kept keyframe
at its true step, which uneven keyframes need (the Taylor table only knows the last gap's length). L2P is fitted for
one placement and step count on calibration runs (fit_l2p, ridge="auto"; `dcache search --method keyframe
--forecaster l2p` searches the placement with L2P fitted for each candidate): on the bundled video model it is the
best forecaster on searched and uniform keyframes alike at 0.25 and 0.15 (BENCHMARKS.md, "Forecasters beyond
Taylor" and the tiny-motion frontier).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, knob
from dcache import register_method, register_preset

from .forecasters import config_forecaster, forecaster_knob

UNCOND = "uncond"  # the branch name diffusers' cache_context gives split CFG's unconditional call


def keyframe_steps(keyframes: tuple[float, ...], num_steps: int) -> frozenset[int]:
    """The steps a generation of `num_steps` computes: round(f * (num_steps - 1)) for every keyframe f, and step 0.

    >>> sorted(keyframe_steps((0.0, 0.296, 0.556, 0.852), 28))
    [0, 8, 15, 23]
    >>> sorted(keyframe_steps((0.0, 0.296, 0.556, 0.852), 10))
    [0, 3, 5, 8]
    """
    return frozenset({0, *(int(round(f * (num_steps - 1))) for f in keyframes)})


@register_method
@dataclass(frozen=True)
class KeyframeConfig(MethodConfig):
    """Keyframe: compute at a few positions of the generation (fractions, so any step count), forecast the rest.

    Paper: none (dcache's own schedule); the forecast is TaylorSeer's extrapolation (https://arxiv.org/abs/2503.06923)
    and the keyframes are a plan searched offline in normalised time.

    Use it below compute ratio 0.25, where a fixed cadence wastes computes: with `scope="call"` and the searched
    presets (`keyframe-5x`, `keyframe-8x`) it is dcache's best setting at ratios 0.196 and 0.125 on the bundled
    model at CFG 1.5 (BENCHMARKS.md, "Beyond 4x"). Being fractions, keyframes replay at other step counts (a step
    plan does not). At a higher guidance scale the uneven presets lose most (keyframe-5x: 44.4 -> 35.0 dB at CFG 3);
    add `cfg_difference=True` (39.3 dB there), search the keyframes at that scale (`dcache search --method
    keyframe --guidance 3`), or give both branches the same keyframes for one call more: at CFG 3 the searched
    4 + 4 keyframes (ratio 0.143) hold 34.3 dB (35.0 with L2P) where 4 + 3 (0.125) gives 28.2 (32.1 with the
    difference, 32.4 with L2P's), since equal keyframes keep the two branches' forecast errors cancelling.

    The presets are model-specific: they were searched on the bundled tiny-digits model (28 steps, CFG 1.5) and do
    not transfer as they are (BENCHMARKS.md, "Tuned on one model, measured on another"). keyframe-5x loses to
    uniform keyframes on tiny-shapes (SD3, 29.8 vs 30.8 dB) and tiny-motion (Wan, 20 steps, CFG 5: 13.6 vs 20.7 dB);
    keyframe-8x holds on tiny-shapes (25.9 vs 23.2 dB) but not on tiny-motion (6.5 vs 17.5 dB). On another model
    start from the default, uniform keyframes, search the keyframes on it (`dcache search --method keyframe`), or
    let `adaptive_keyframe` place them. `cfg_difference=True` checks itself: the difference is served only while it
    measures better than the branches' own caches at the steps both computed (else, and where the pipeline batches
    its CFG branches in one call, it says so and serves the own caches), so it needs uncond keyframes that are a
    subset of the cond ones (keyframe-5x's are; keyframe-8x's are not). That check scores the calls it serves; a
    finished sample can still come out worse (tiny-motion, guidance 2: -0.5 dB). With `calibration_run=` as well,
    one generation decides against its uncached twin: it runs with and without the difference and keeps the
    closer (a warning says when it left it off; `handle.target.sweep` holds both).

    Example (the bundled tiny model, 28 steps, split CFG: 6 + 5 of 56 calls computed, ratio 0.196):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "keyframe-5x", scope="call") as handle:
        ...     image = pipe("3").images[0]
        >>> round(handle.stats().compute_ratio, 3)
        0.196
    """

    method = "keyframe"
    keyframes: tuple = knob((0.0, 0.2, 0.4, 0.6, 0.8, 1.0), types=(tuple, list),
                            doc="positions in [0, 1] of the computed steps, step = round(f * (num_steps - 1)); step "
                                "0 always computes")
    uncond_keyframes: tuple | None = knob(None, types=(tuple, list),
                                          doc="keyframes of the split-CFG 'uncond' branch (None = `keyframes`)")
    order: int = knob(2, low=0, high=3, doc="Taylor order of the forecast between keyframes (0 = reuse the last "
                                            "keyframe; 2 = TaylorSeer's table over the last three)")
    cfg_difference: bool = knob(False, doc="split CFG in call scope: serve the 'uncond' branch between its "
                                           "keyframes as the 'cond' output minus a forecast of the CFG difference "
                                           "(over the steps both computed), which keeps the two branches' errors "
                                           "cancelling; use it with uncond keyframes that are a subset of the cond "
                                           "ones")
    forecaster: str | dict = forecaster_knob()

    def check(self) -> None:
        config_forecaster(self)
        for name in ("keyframes", "uncond_keyframes"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f <= 1.0
                                    for f in value):
                raise self.invalid(name, value, "a non-empty list of numbers in [0, 1] (fractions of the "
                                                "generation, e.g. [0, 0.3, 0.55, 0.85])")

    def build(self, model: nn.Module) -> Schedule:
        return KeyframeSchedule(self)


class KeyframeSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset()

    def __init__(self, config: KeyframeConfig):
        super().__init__(config)  # forecast_order and cfg_difference (dcache.runtime.cfg_difference) from the knobs
        self.forecaster = config_forecaster(config)  # None: the Taylor table of `order`
        self._steps: dict[bool, frozenset[int]] = {}  # is the uncond branch -> computed steps of this generation

    def reset(self, generation: GenerationInfo) -> None:
        n = generation.num_steps
        if n is None:
            raise ValueError("keyframe places its computed steps by fractions of the generation, so it needs the "
                             "step count: pass dcache.apply(transformer, 'keyframe', num_steps=N) when the "
                             "transformer is used without a pipeline's scheduler.")
        c = self.config
        super().reset(generation)
        self._steps = {False: keyframe_steps(c.keyframes, n),
                       True: keyframe_steps(c.uncond_keyframes if c.uncond_keyframes is not None else c.keyframes, n)}

    def decide(self, ctx: CallContext) -> Action:
        if ctx.step in self._steps[ctx.branch == UNCOND]:
            return Action.COMPUTE
        return self.served


# Searched by `python benchmarks/frontier.py --search --only cfg1.5` on the tuning batch (labels 0-9, seed 0, 28 steps,
# split CFG 1.5); benchmarks/results/frontier.md measures them on held-out seeds.
register_preset("keyframe-5x", "keyframe", "6 cond + 5 uncond keyframes: ratio 0.196 with split CFG (28 steps: "
                                           "cond 0, 6, 11, 17, 22, 27; uncond the same without 27); tuned on "
                                           "tiny-digits, loses to uniform keyframes on other models",
                keyframes=(0.0, 0.2222, 0.4074, 0.6296, 0.8148, 1.0),
                uncond_keyframes=(0.0, 0.2222, 0.4074, 0.6296, 0.8148))
register_preset("keyframe-8x", "keyframe", "4 cond + 3 uncond keyframes: ratio 0.125 with split CFG (28 steps: "
                                           "cond 0, 8, 16, 24; uncond 0, 10, 21); tuned on tiny-digits, "
                                           "model-specific",
                keyframes=(0.0, 0.2963, 0.5926, 0.8889), uncond_keyframes=(0.0, 0.3704, 0.7778))
