"""FORA (fast-forward caching, arXiv 2407.01425): static module-level reuse every N steps.

Step s computes everything iff s < W or (s - W + 1) % N == 0 (with the default W = 1: steps 0, N, 2N, ...); on the
N - 1 steps in between each block's attention and feed-forward outputs are reused from the last full step. The
blocks' norms, AdaLN gates and residual adds still run with the current timestep, so the reuse is "output before the
gate", as in the reference ([TS] cal_type "original/FORA": only step 0 forced, then full every N).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcache import MethodConfig, Schedule, knob, register_method, register_preset

from .cadence import CadenceSchedule


@register_method
@dataclass(frozen=True)
class FORAConfig(MethodConfig):
    """FORA: static module-level reuse of attention and feed-forward outputs every N steps.

    Paper: Selvaraju et al., "FORA: Fast-Forward Caching in Diffusion Transformer Acceleration",
    https://arxiv.org/abs/2407.01425.

    Use it as the simplest module-level baseline; no signal and no calibration.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "fora", interval=3) as handle:
        ...     image = pipe("3").images[0]
    """

    method = "fora"
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("interval", (2, 3, 4, 5, 6, 7))
    # the settings that seed a plan search (dcache search --method ecad) with this method's plans
    search_seeds = {"fora": ({"interval": 2}, {"interval": 3})}
    interval: int = knob(3, low=1, high=1000, doc="N: one full step, then N-1 steps reusing the module outputs "
                                                  "(FLUX.1-dev: N=3 -> 2.82x FLOPs, N=7 -> 5.55x)")
    warmup_steps: int = knob(1, low=1, high=100_000, doc="first steps always computed")
    cutoff_steps: int = knob(0, low=0, high=100_000, doc="last steps always computed (0 = the cadence decides)")
    granularity: str = knob("module", choices=("module", "block"),
                            doc="what is reused: attention / MLP module outputs (FORA) or whole block residuals")

    def build(self, model: nn.Module) -> Schedule:
        return FORASchedule(self)


class FORASchedule(CadenceSchedule):
    """Its granularity comes from the knob; no forecast order: the steps between full steps reuse."""


register_preset("fora-7", "fora", "aggressive FORA: N=7 (5.55x FLOPs on FLUX.1-dev, visible quality loss)", interval=7)
