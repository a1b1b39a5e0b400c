"""CG-Taylor (confidence-gated Taylor, arXiv 2508.02240): forecast the stack when the probe block's forecast is good.

The first block (the probe) always runs. The engine keeps a Taylor table of the probe residual r1 = block0(h0) - h0
(refreshed at computed calls) and measures, before each decision,
    err = relL1(r1, Taylor forecast of r1 at this step)            (Signal.FORECAST_ERROR)
If err < threshold the rest of the stack is FORECAST: its residual is the Taylor extrapolation (order O) of the
residuals of blocks 1..L-1 recorded at computed steps, added to the probe output. Otherwise blocks 1..L-1 run and
both tables are refreshed. The first `warmup_steps` (the reference gates from step 5 on: "cnt > 4") and the last
`cutoff_steps` steps always compute; so do calls before the probe table holds two computed steps.

Run cap (`max_forecast_steps`, default 3; the reference has none): at most that many forecast steps in a row, then a
computed step. The gate alone does not bound the forecast horizon: its threshold is on the *probe's* error, and
where the gate is wide open (a loose threshold, or a model whose probe forecasts well) the reference forecasts every
step to the end from a derivative taken between two adjacent warm-up steps. On the bundled tiny model that
collapsed to 16.6 dB PSNR (threshold 2, compute ratio 0.31); with the cap, the same setting is a TaylorSeer-like
cadence (1 compute + 3 forecasts: 44 dB at 0.47) and the quality falls gradually as the threshold is loosened.
-1 restores the reference's unbounded runs.

dcache forecasts the residual of blocks 1..L-1 and adds it to the current probe output (the reference forecasts the
last block's output itself); one Taylor table of the residual per branch plus one of the probe residual:
2 * (order + 1) tensors per branch.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, Signal
from dcache import knob, register_method, register_preset


@register_method
@dataclass(frozen=True)
class CGTaylorConfig(MethodConfig):
    """CG-Taylor: forecast the stack with Taylor when the probe block's own forecast error is small.

    Paper: Confidence-gated Taylor forecasting, https://arxiv.org/abs/2508.02240.

    Use it as an adaptive TaylorSeer: the gate reads a signal inside the call (the probe block), so it runs in block
    scope only.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "cg_taylor", threshold=0.2) as handle:
        ...     image = pipe("3").images[0]
    """

    method = "cg_taylor"
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("threshold", (0.01, 0.02, 0.03, 0.05, 0.08, 0.13, 0.2, 0.36))
    threshold: float = knob(0.03, low=0.0, high=100.0,
                            doc="gate: forecast the stack while the probe block's Taylor forecast error (relL1) is "
                                "below this (FLUX 0.03; Wan 0.36)")
    order: int = knob(1, low=1, high=8, doc="O: Taylor order of the stack and probe forecasts")
    warmup_steps: int = knob(5, low=2, high=100_000, doc="first steps always computed (the reference gates from step "
                                                         "5 on)")
    cutoff_steps: int = knob(1, low=0, high=100_000, doc="last steps always computed")
    probe_blocks: int = knob(1, low=1, high=1000, doc="front blocks always computed; their residual is forecast to "
                                                      "gate")
    max_forecast_steps: int = knob(3, low=-1, high=100_000, doc="most forecast steps in a row before a computed "
                                                                 "step (-1 = no limit, as the reference; 0 = never "
                                                                 "forecast)")

    def build(self, model: nn.Module) -> Schedule:
        return CGTaylorSchedule(self)


class CGTaylorSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset({Signal.FORECAST_ERROR})

    def __init__(self, config: CGTaylorConfig):
        super().__init__(config)
        self._run: dict[str, int] = {}

    def reset(self, generation: GenerationInfo) -> None:
        self._run = {}

    def decide(self, ctx: CallContext) -> Action:
        c = self.config
        n = ctx.num_steps
        err = ctx.signals.get(Signal.FORECAST_ERROR)
        run = self._run.get(ctx.branch, 0)
        forced = ctx.step < c.warmup_steps or (n is not None and ctx.step >= n - c.cutoff_steps)
        if not forced and err is not None and err < c.threshold and (c.max_forecast_steps < 0
                                                                     or run < c.max_forecast_steps):
            self._run[ctx.branch] = run + 1
            return Action.FORECAST
        self._run[ctx.branch] = 0
        return Action.COMPUTE


register_preset("cg-taylor-wan", "cg_taylor", "Wan2.1 reference gate 0.36", threshold=0.36)
