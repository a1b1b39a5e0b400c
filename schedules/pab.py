"""Pyramid Attention Broadcast (arXiv 2408.12588): reuse attention outputs with per-kind ranges in a timestep window.

Inside the timestep window (lo, hi) an attention module of kind k computes only at steps s with s % range_k == 0 and
broadcasts (reuses) its last output in between; outside the window everything computes. Ranges follow the
pyramid spatial < temporal < cross (VideoSys Open-Sora: 2 / 4 / 6). Feed-forward modules are reused only when
`mlp_range` > 0 (off by default, as in PAB). diffusers' `PyramidAttentionBroadcastConfig` uses the same rule with a
window of (100, 800) in scheduler timesteps.

Kinds of the MODULE units ("b3.attn", "b3.attn2", "b0.ff", ...): a module with diffusers' `is_cross_attention`
attribute is cross- or self-attention by that flag (e.g. SD3.5's `attn2` is self-attention, Wan's `attn2` is
cross); otherwise by name: attn2 / cross_attn / cross_attention are cross, attn / attn1 / self_attn / attention /
self_attention are self ("spatial"), names with "temp" are temporal, the rest (ff, ff_context, proj_mlp, ffn,
img_mlp, ...) are MLPs. The kinds are read once when the schedule is built; nothing is hooked by the schedule.

Timesteps: the scheduler's timestep of each step (0..1000 convention, noisy = high). Without a scheduler
(transformer-only use) the step's position stands in for it: t = 1000 * (1 - step / num_steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, knob
from dcache import register_method, register_preset
from dcache.model.families import adapter_for

CROSS_NAMES = ("attn2", "cross_attn", "cross_attention")
SELF_NAMES = ("attn", "attn1", "self_attn", "attention", "self_attention")
KINDS = ("spatial", "temporal", "cross", "mlp")


def module_kind(name: str, module: nn.Module | None = None) -> str:
    """'spatial' | 'temporal' | 'cross' | 'mlp' for an inner module (dotted names: the last part counts)."""
    leaf = name.rsplit(".", 1)[-1]
    flag = getattr(module, "is_cross_attention", None) if module is not None else None
    looks_attention = leaf in CROSS_NAMES or leaf in SELF_NAMES or "attn" in leaf or "attention" in leaf
    if "temp" in leaf and looks_attention:
        return "temporal"
    if isinstance(flag, bool) and looks_attention:
        return "cross" if flag else "spatial"
    if leaf in CROSS_NAMES or "cross" in leaf:
        return "cross"
    if looks_attention:
        return "spatial"
    return "mlp"


def unit_kinds(model: nn.Module) -> dict[str, str]:
    """Unit name "b{i}.{module}" -> kind, in the engine's block order (the adapter's execution order)."""
    adapter = adapter_for(model)
    kinds = {}
    for index, (_, block) in enumerate(adapter.blocks(model)):
        for name in adapter.module_names(block):
            module = block
            for part in name.split("."):
                module = getattr(module, part, None)
            kinds[f"b{index}.{name}"] = module_kind(name, module)
    return kinds


@register_method
@dataclass(frozen=True)
class PABConfig(MethodConfig):
    """Pyramid Attention Broadcast: reuse attention outputs with per-kind ranges inside a timestep window.

    Paper: Zhao et al., "Real-Time Video Generation with Pyramid Attention Broadcast", https://arxiv.org/abs/2408.12588.

    Use it on video models with spatial, temporal and cross attention; it reuses attention only (feed-forward when
    `mlp_range` > 0), so its compute saving is bounded by the attention share of the FLOPs.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "pab") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "pab"
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("spatial_range", (2, 3, 4, 5, 6))
    spatial_range: int = knob(2, low=1, high=1000, doc="self-attention computes every this many steps in the window "
                                                       "(1 = always)")
    temporal_range: int = knob(4, low=1, high=1000, doc="temporal attention: every this many steps in the window")
    cross_range: int = knob(6, low=1, high=1000, doc="cross-attention: every this many steps in the window")
    mlp_range: int = knob(1, low=1, high=1000, doc="feed-forward modules: every this many steps in the window (1 = "
                                                   "always computed, PAB's default)")
    window_low: float = knob(100.0, low=0.0, high=1000.0, doc="broadcast only for timesteps above this (0..1000)")
    window_high: float = knob(800.0, low=0.0, high=1000.0, doc="broadcast only for timesteps below this (0..1000)")

    def check(self) -> None:
        if self.window_low >= self.window_high:
            raise self.invalid("window_low", self.window_low, f"below window_high={self.window_high}",
                               "the timestep window (low, high) in which attention is broadcast")

    def build(self, model: nn.Module) -> Schedule:
        return PABSchedule(self, unit_kinds(model))


class PABSchedule(MethodSchedule):
    granularity = Granularity.MODULE
    signals = frozenset()

    def __init__(self, config: PABConfig, kinds: dict[str, str]):
        super().__init__(config)
        self.kinds = kinds
        self._ranges: list[int] = []

    def _range(self, kind: str) -> int:
        c = self.config
        return {"spatial": c.spatial_range, "temporal": c.temporal_range, "cross": c.cross_range,
                "mlp": c.mlp_range}[kind]

    def reset(self, generation: GenerationInfo) -> None:
        self._ranges = [self._range(self.kinds.get(u, module_kind(u))) for u in generation.units]

    def timestep(self, ctx: CallContext) -> float:
        if ctx.timestep is not None:
            return float(ctx.timestep)
        n = ctx.num_steps or (ctx.step + 1)
        return 1000.0 * (1.0 - ctx.step / n)

    def decide(self, ctx: CallContext) -> str | Action:
        t = self.timestep(ctx)
        if ctx.step == 0 or not (self.config.window_low < t < self.config.window_high):
            return Action.COMPUTE
        return "".join(Action.COMPUTE.value if ctx.step % r == 0 else Action.REUSE.value for r in self._ranges)

    def may_reuse(self, branch: str, unit: int) -> bool:
        return unit < len(self._ranges) and self._ranges[unit] > 1

register_preset("pab-fast", "pab", "broadcast every attention 3 / 5 / 8 steps and MLPs every 2, window (100, 900)",
                spatial_range=3, temporal_range=5, cross_range=8, mlp_range=2, window_high=900.0)
