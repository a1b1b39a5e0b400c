"""ProfilingDiT calibration: foreground saliency and per-block updates from uncached runs, then the block plan.

    from dcache.schedules.tuning.profilingdit_calibration import calibrate_profilingdit
    plan = calibrate_profilingdit(pipe, lambda: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(0)))
    handle = dcache.apply(pipe, plan)

The profiling pass records per-token block updates and the saliency of each token (`_Saliency`); the block focus,
classification and step rows are the pure math of schedules/profilingdit.py.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from dcache import Granularity, Plan

from ..profilingdit import ProfilingDiTConfig, classify_blocks, foreground_focus, selective_rows
from . import profiling as prof


def calibrate_profilingdit(target: Any, run_fn: Callable[[], Any] | Sequence[Callable[[], Any]] | None = None,
                           config: ProfilingDiTConfig | None = None, *, num_steps: int | None = None,
                           **overrides: Any) -> Plan:
    """Profile (unless background_blocks is given and num_steps known), classify blocks, return the BLOCK Plan."""
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


__all__ = ["calibrate_profilingdit"]
