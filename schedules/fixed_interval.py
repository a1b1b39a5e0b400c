"""Fixed-interval baseline: compute the whole stack every N steps, reuse (or forecast) its residual in between.

Step s computes iff s < W or (s - W + 1) % N == 0, or s is among the last `cutoff_steps` steps; other steps return
h_in + R (R = the stack residual of the last computed step of the branch), or with forecast_order > 0 the Taylor
forecast of R (or the forecast of `forecaster`: dcache.schedules.forecasters). The simplest step-skipping
baseline that dynamic schedules must beat at equal compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcache import Granularity, MethodConfig, Schedule, knob, register_method

from .cadence import CadenceSchedule
from .forecasters import config_forecaster, forecaster_knob


@register_method
@dataclass(frozen=True)
class FixedIntervalConfig(MethodConfig):
    """Fixed interval: compute the whole stack every N steps and reuse (or forecast) its residual in between.

    Paper: No paper: the baseline every dynamic schedule must beat at equal compute.

    Use it to check what a dynamic schedule gains over a plain cadence at the same compute ratio.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "fixed_interval", interval=2) as handle:
        ...     image = pipe("3").images[0]
    """

    method = "fixed_interval"
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("interval", (2, 3, 4, 5, 6))
    # the settings that seed a plan search (dcache search --method ecad) with this method's plans
    search_seeds = {"fixed_interval": ({"interval": 2}, {"interval": 3})}
    interval: int = knob(2, low=1, high=1000, doc="N: compute every N-th step (1 = never reuse)")
    warmup_steps: int = knob(1, low=1, high=100_000, doc="first steps always computed")
    cutoff_steps: int = knob(1, low=0, high=100_000, doc="last steps always computed")
    forecast_order: int = knob(0, low=0, high=8, doc="0 = reuse the residual; > 0 = Taylor forecast of this order")
    probe_blocks: int = knob(0, low=0, high=1000, doc="front blocks always computed")
    tail_blocks: int = knob(0, low=0, high=1000, doc="back blocks always computed")
    forecaster: str | dict = forecaster_knob()

    def check(self) -> None:
        config_forecaster(self)

    def build(self, model: nn.Module) -> Schedule:
        return FixedIntervalSchedule(self)


class FixedIntervalSchedule(CadenceSchedule):
    granularity = Granularity.STACK

    def __init__(self, config: FixedIntervalConfig):
        super().__init__(config)
        self.forecaster = config_forecaster(config)  # None: the Taylor table of `forecast_order`
