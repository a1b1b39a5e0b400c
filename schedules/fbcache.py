"""FBCache / DBCache (ParaAttention's First Block Cache): probe blocks decide, the middle of the stack is reused.

The first `probe_blocks` (Fn) blocks always run; their residual r_F is compared with the one stored at the last
computed call of the branch: relL1 = mean|r_F - r_ref| / mean|r_ref|. Below `threshold` the middle blocks are
replaced by the cached middle residual; `tail_blocks` (Bn) always run on the result. FBCache is Fn=1, Bn=0.

Small models: when Fn + Bn would leave no block to cache (e.g. the DBCache F8B0 preset on a 5-block model), both
are scaled down to fit half of the stack (at least Fn = 1): F8B0 -> F2B0 and F8B8 -> F1B1 on 5 blocks. Settings
that leave at least one block to cache are used as given.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, Signal
from dcache import knob, register_method
from dcache.model.families import adapter_for


def fit_probe_tail(probe_blocks: int, tail_blocks: int, num_blocks: int) -> tuple[int, int]:
    """(Fn, Bn) as given if they leave a block to cache, else scaled to fit num_blocks // 2 (Fn >= 1)."""
    if probe_blocks + tail_blocks <= num_blocks - 1 or num_blocks < 2:
        return probe_blocks, tail_blocks
    budget = max(1, num_blocks // 2)
    fn = min(max(1, round(probe_blocks * budget / (probe_blocks + tail_blocks))), budget)
    bn = min(tail_blocks, budget - fn)
    return fn, bn


@register_method
@dataclass(frozen=True)
class FBCacheConfig(MethodConfig):
    """FBCache / DBCache: the first (probe) blocks always run and decide whether the middle of the stack is reused.

    Paper: ParaAttention's First Block Cache (https://github.com/chengzeyi/ParaAttention) and cache-dit's DBCache
    (https://github.com/vipshop/cache-dit); no paper.

    Use it when no calibration is available: the signal is measured at run time. The `dbcache*` presets add tail
    blocks and warm-up; the signal is read inside the call, so it cannot run with `scope="call"`.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "fbcache", threshold=0.12) as handle:
        ...     image = pipe("3").images[0]
    """

    method = "fbcache"
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("threshold", (0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.4))
    # the settings that seed a plan search (dcache search --method ecad) with this method's plans
    search_seeds = {"fbcache": ({"threshold": 0.1}, {"threshold": 0.2})}
    threshold: float = knob(0.08, low=0.0, high=10.0, doc="relative L1 change of the probe residual below which "
                                                           "the middle blocks are reused")
    probe_blocks: int = knob(1, low=1, high=1000, doc="Fn: front blocks always computed; their residual is the "
                                                       "signal")
    tail_blocks: int = knob(0, low=0, high=1000, doc="Bn: back blocks always computed on the reused state")
    warmup_steps: int = knob(1, low=0, high=10_000, doc="first steps always computed")
    max_continuous_cached: int = knob(-1, low=-1, high=10_000, doc="force a compute after this many reused steps "
                                                                    "in a row (-1 = no limit)")
    max_cached_steps: int = knob(-1, low=-1, high=10_000, doc="most reused steps per generation (-1 = no limit)")

    def build(self, model: nn.Module) -> Schedule:
        num_blocks = len(adapter_for(model).blocks(model))
        return FBCacheSchedule(self, *fit_probe_tail(self.probe_blocks, self.tail_blocks, num_blocks))


class FBCacheSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset({Signal.PROBE_REL_L1})

    def __init__(self, config: FBCacheConfig, probe_blocks: int | None = None, tail_blocks: int | None = None):
        super().__init__(config)
        if probe_blocks is not None:  # fitted to the model (fit_probe_tail)
            self.probe_blocks = probe_blocks
        if tail_blocks is not None:
            self.tail_blocks = tail_blocks
        self._run: dict[str, list[int]] = {}

    def reset(self, generation: GenerationInfo) -> None:
        self._run = {}

    def decide(self, ctx: CallContext) -> Action:
        c = self.config
        run = self._run.setdefault(ctx.branch, [0, 0])  # consecutive reused, total reused
        diff = ctx.signals.get(Signal.PROBE_REL_L1)
        reuse = (ctx.step >= c.warmup_steps and diff is not None and diff < c.threshold
                 and (c.max_continuous_cached < 0 or run[0] < c.max_continuous_cached)
                 and (c.max_cached_steps < 0 or run[1] < c.max_cached_steps))
        if reuse:
            run[0] += 1
            run[1] += 1
            return Action.REUSE
        run[0] = 0
        return Action.COMPUTE

    def config_dict(self) -> dict:
        return {**super().config_dict(), "effective": {"probe_blocks": self.probe_blocks,
                                                       "tail_blocks": self.tail_blocks}}
