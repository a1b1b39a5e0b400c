"""ProfilingDiT ("Model Reveals What to Cache", arXiv 2504.03140): classify blocks as foreground- or
background-focused from profiled statistics, then cache background blocks more aggressively (BLOCK granularity).

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
from typing import Any, Callable, Sequence

from torch import nn

from dcache import Action, Granularity, MethodConfig, Plan, Schedule, knob, register_method
from dcache.plan import PlanSchedule


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
        from .tuning.profiling import check_finite

        check_finite(self)
        if self.step_end < self.step_start:
            raise self.invalid("step_end", self.step_end, f">= step_start={self.step_start}",
                               "caching stops at this fraction of the steps")
        if self.background_blocks is not None and not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.background_blocks):
            raise self.invalid("background_blocks", self.background_blocks, "a list of block indices >= 0",
                               "explicit background block indices")

    def build(self, model: nn.Module) -> Schedule:
        from .calibrated_plans import calibrated_plan

        return ProfilingDiTSchedule(calibrated_plan("profilingdit", model, plan=self.plan,
                                                    calibration=self.calibration))


class ProfilingDiTSchedule(PlanSchedule):
    def __init__(self, plan: Plan):
        super().__init__(plan)
        self.name = "profilingdit"

    def plan_extras(self) -> dict:
        return dict(self.plan.extras)


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


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------

def calibrate_profilingdit(target: Any, run_fn: Callable[[], Any] | Sequence[Callable[[], Any]] | None = None,
                           config: ProfilingDiTConfig | None = None, *, num_steps: int | None = None,
                           **overrides: Any) -> Plan:
    """Profile (unless background_blocks is given and num_steps known), classify blocks, return the BLOCK Plan."""
    from .tuning import profiling as prof

    config = config if config is not None else ProfilingDiTConfig()
    if overrides:
        config = type(config).with_overrides(**{**config.__dict__, **overrides})
    if run_fn is None:
        raise TypeError("calibrate_profilingdit needs run_fn (a calibration run) to know the steps and branches.")
    runs = prof.as_runs(run_fn)
    updates: dict[tuple[int, str, int], dict[int, Any]] = {}  # (gen, branch, step) -> block -> per-token norms
    saliency = _Saliency()
    stack_in: dict[tuple[int, str], Any] = {}
    last = None

    def on_block(slot, where, h_in, e_in, h_out, e_out):
        key = (where.generation, where.branch, where.step)
        r = prof.residual(h_out, h_in)  # [B, L, D]
        updates.setdefault(key, {})[slot.index] = r.norm(dim=-1).detach()  # [B, L]
        if slot.index == 0:
            stack_in[(where.generation, where.branch)] = h_in.detach()
        if slot.index == last:
            saliency.add(where, h_out.detach().float(), stack_in.pop((where.generation, where.branch), None))

    with prof.ProfileSession(target, num_steps=num_steps) as session:
        last = len(session.blocks) - 1
        units = session.unit_names(Granularity.BLOCK)
        session.on_block(on_block)
        generations = session.run(runs)
        header = session.plan_header()
    if not updates:
        raise RuntimeError("calibration saw no transformer call; run_fn must run the pipeline (or transformer).")
    n = max(k[2] for k in updates) + 1
    branches = list(dict.fromkeys(k[1] for k in updates))
    focus = foreground_focus(updates, saliency.masks(config.foreground_ratio), len(units))
    if config.background_blocks is not None:
        bad = [b for b in config.background_blocks if b >= len(units)]
        if bad:
            raise ValueError(f"background_blocks {bad} are out of range: the model has {len(units)} blocks.")
        background = sorted(set(config.background_blocks))
    else:
        background = classify_blocks(focus, config.background_ratio)
    rows = selective_rows(n, len(units), set(background), config)
    extras = {"profilingdit": {"focus": focus, "background_blocks": background,
                               "foreground_blocks": [b for b in range(len(units)) if b not in set(background)]}}
    provenance = {"method": "profilingdit", "config": config.to_dict(),
                  "calibration": {"generations": generations, "runs": len(runs)}, "quality": {}}
    return prof.make_plan(header, granularity=Granularity.BLOCK, units=units, num_steps=n,
                          actions={b: list(rows) for b in branches}, extras=extras, provenance=provenance)


class _Saliency:
    """Per generation, the running mean per image token of ||h_out^cond - h_out^uncond|| (first two branches), or of
    ||h_out - h_in|| (the stack residual) when the generation has a single branch. Holds one h_out at a time."""

    def __init__(self):
        self.cfg: dict[int, list] = {}  # gen -> [sum [B, L], count]
        self.res: dict[int, list] = {}
        self.pending: dict[tuple[int, int], tuple[str, Any]] = {}

    def add(self, where, h_out, h_in) -> None:
        gen, step = where.generation, where.step
        if h_in is not None:
            r = (h_out - h_in[:, -h_out.shape[1]:].float()).norm(dim=-1)
            acc = self.res.setdefault(gen, [0.0, 0])
            acc[0], acc[1] = acc[0] + r, acc[1] + 1
        other = self.pending.pop((gen, step), None)
        if other is None:
            self.pending = {k: v for k, v in self.pending.items() if k[0] == gen and k[1] >= step - 1}
            self.pending[(gen, step)] = (where.branch, h_out)
        elif other[0] != where.branch and other[1].shape == h_out.shape:
            acc = self.cfg.setdefault(gen, [0.0, 0])
            acc[0], acc[1] = acc[0] + (h_out - other[1]).norm(dim=-1), acc[1] + 1

    def masks(self, foreground_ratio: float) -> dict:
        out = {}
        for gen in set(self.cfg) | set(self.res):
            acc = self.cfg.get(gen) or self.res[gen]
            sal = acc[0] / acc[1]  # [B, L_img]
            k = max(1, int(round(foreground_ratio * sal.shape[-1])))
            mask = sal.new_zeros(sal.shape, dtype=bool)
            mask.scatter_(-1, sal.topk(k, dim=-1).indices, True)
            out[gen] = mask
        return out


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


__all__ = ["ProfilingDiTConfig", "ProfilingDiTSchedule", "calibrate_profilingdit", "classify_blocks",
           "selective_rows", "foreground_focus"]
