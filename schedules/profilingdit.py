"""ProfilingDiT ("Model Reveals What to Cache", arXiv 2504.03140): classify blocks as foreground- or
background-focused from profiled statistics, then cache background blocks more aggressively (BLOCK granularity).

    from dcache.schedules.tuning.profilingdit_calibration import calibrate_profilingdit
    plan = calibrate_profilingdit(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)))
    handle = dcache.apply(pipe, plan)

dcache's formulation (feature statistics instead of attention maps, so it works for every adapter-known DiT):
1. Foreground. One uncached pass records the hidden stream after the last block, h_out [B, L, D], per step and
   branch. A token's saliency is how much the conditioning moves it, ||h_out^cond - h_out^uncond|| per token,
   averaged over the steps (the feature analogue of the text-to-image attention that ProfilingDiT uses to find the
   object). Without a second branch (no CFG), it is the per-token norm of the stack residual. The
   `foreground_ratio` most salient tokens of each sample are the foreground F.
2. Block focus. For block b, r_b,t[tok] = ||out - in|| per image token is the block's update at step t;
       focus_b = mean_t [ mean_{tok in F} r_b,t / mean_{tok} r_b,t ]
   (> 1: the block works mostly on the foreground). The `background_ratio` fraction of blocks with the lowest focus
   are background blocks; `background_blocks` overrides the classification with an explicit list (e.g. the
   reference's HunyuanVideo list).
3. Selective caching. Inside the step window [step_start, step_end) (fractions of the steps), a background block is
   computed every `background_interval` steps and reuses its cached residual in between; a foreground block every
   `foreground_interval` steps (1 = always computed). Contiguous runs of reused blocks add their residuals cached at
   the same step, which equals the reference's single span delta (the residuals telescope within a block list).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from torch import nn

from dcache import Action, MethodConfig, Schedule, knob, register_method

from .calibrated_plans import CalibratedPlanSchedule, calibrated_plan


@register_method
@dataclass(frozen=True)
class ProfilingDiTConfig(MethodConfig):
    """ProfilingDiT: cache background-focused blocks more aggressively than foreground-focused ones.

    Paper: "Model Reveals What to Cache: Profiling-Based Feature Reuse for Video Diffusion Models",
    https://arxiv.org/abs/2504.03140 (dcache's formulation from feature statistics).

    Use it for a block-level static plan from one profiling pass (`calibrate_profilingdit`; the bundled model
    ships a plan).

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "profilingdit") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "profilingdit"
    title = "ProfilingDiT"
    # `dcache calibrate --method profilingdit`: the plan that build() replays
    calibrator = ("plan", "dcache.schedules.tuning.profilingdit_calibration:calibrate_profilingdit")
    foreground_ratio: float = knob(0.3, low=0.01, high=0.99, doc="fraction of the image tokens that are foreground")
    background_ratio: float = knob(0.5, low=0.0, high=1.0, doc="fraction of the blocks classified background (the "
                                                                "least foreground-focused)")
    background_blocks: list | None = knob(None, types=(list, tuple), doc="explicit background block indices "
                                                                          "(overrides the profiling)")
    background_interval: int = knob(4, low=1, high=1000, doc="a background block computes every this many steps "
                                                              "in the window")
    foreground_interval: int = knob(2, low=1, high=1000, doc="a foreground block computes every this many steps "
                                                              "in the window (1 = always)")
    step_start: float = knob(0.15, low=0.0, high=1.0, doc="caching starts at this fraction of the steps")
    step_end: float = knob(1.0, low=0.0, high=1.0, doc="caching stops at this fraction of the steps")
    plan: str | None = knob(None, types=(str,), doc="path of a calibrated ProfilingDiT plan file")
    calibration: str | None = knob(None, types=(str,), doc="the file `dcache calibrate --method profilingdit` wrote:"
                                   " a plan, or a calibration file holding this method's plan for the model")

    def check(self) -> None:
        if self.step_end < self.step_start:
            raise self.invalid("step_end", self.step_end, f">= step_start={self.step_start}",
                               "caching stops at this fraction of the steps")
        if self.background_blocks is not None and not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.background_blocks):
            raise self.invalid("background_blocks", self.background_blocks, "a list of block indices >= 0",
                               "explicit background block indices")

    def build(self, model: nn.Module) -> Schedule:
        return ProfilingDiTSchedule(calibrated_plan("profilingdit", model, plan=self.plan,
                                                    calibration=self.calibration))


class ProfilingDiTSchedule(CalibratedPlanSchedule):
    method = "profilingdit"


# ----------------------------------------------------------------------------------------------------------------
# Classification and step lists (pure math)
# ----------------------------------------------------------------------------------------------------------------

def classify_blocks(focus: Sequence[float], background_ratio: float) -> list[int]:
    """Indices of the round(background_ratio * n) blocks with the lowest foreground focus."""
    count = int(round(background_ratio * len(focus)))
    order = sorted(range(len(focus)), key=lambda b: (focus[b], b))
    return sorted(order[:count])


def selective_rows(num_steps: int, num_blocks: int, background: set[int], config: ProfilingDiTConfig) -> list[str]:
    start = max(1, int(math.ceil(config.step_start * num_steps - 1e-9)))
    end = int(math.floor(config.step_end * num_steps + 1e-9))
    rows = []
    for t in range(num_steps):
        row = []
        for b in range(num_blocks):
            interval = config.background_interval if b in background else config.foreground_interval
            reuse = start <= t < end and interval > 1 and (t - start) % interval != 0
            row.append(Action.REUSE.value if reuse else Action.COMPUTE.value)
        rows.append("".join(row))
    return rows


def foreground_focus(updates: dict, masks: dict, num_blocks: int) -> list[float]:
    """focus_b (see the module docstring) from per-(gen, branch, step) block updates and per-generation masks."""
    sums = [0.0] * num_blocks
    counts = [0] * num_blocks
    for (gen, branch, step), blocks in updates.items():
        mask = masks.get(gen)
        if mask is None:
            continue
        for b, r in blocks.items():
            r = r[:, -mask.shape[-1]:] if r.shape[-1] >= mask.shape[-1] else None
            if r is None or r.shape != mask.shape:
                continue
            overall = float(r.mean())
            if overall <= 0:
                continue
            sums[b] += float(r[mask].mean()) / overall
            counts[b] += 1
    return [sums[b] / counts[b] if counts[b] else 1.0 for b in range(num_blocks)]

__all__ = ["ProfilingDiTConfig", "ProfilingDiTSchedule", "classify_blocks",
           "selective_rows", "foreground_focus"]
