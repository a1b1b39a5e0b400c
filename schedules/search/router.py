"""Learned routers: L2C (NeurIPS 2024) and HarmoniCa (ICML 2025), trained with the backbone frozen, thresholded
into MODULE plans.

Router: logits theta [N, U] (step x module unit: each block's attention / MLP / context MLP), score
w = sigmoid(theta). Training runs the calibration generation with torch forward hooks on the inner modules that
blend  out = w * fresh + (1 - w) * cached  (soft, differentiable in theta); the transformer's parameters are frozen
(requires_grad False), only theta trains (AdamW, clamped to [-5, 5]; step 0 is fixed at +5 = always compute).
At every transformer call the student (routers on) and the teacher (no reuse, same input) run; the loss of the call
is backpropagated right away (one call's graph in memory at a time) and theta steps once per generation.

- L2C (one-step objective): loss = MSE(eps_student, eps_teacher) + beta * sum(w); the trajectory follows the
  teacher, and the cache holds the previous step's fresh outputs (L2C refreshes the cache with full computes).
- HarmoniCa: Step-wise Denoising Training: the trajectory follows the *student's* prediction, and the cache keeps
  the fresh output only where the hard score > ste_threshold (what inference would cache). Image-Error Proxy-guided
  objective: loss = lambda(t) * MSE + beta * sum(w), with lambda(t) = error of the final images when the current
  hard router is applied at step t only (normalised to mean 1), refreshed every `lambda_every` iterations.

The hooks below are the only place in the search package that touches modules (like schedules/_profiling.py);
training state (theta, optimiser, iteration, lambda) is saved after every iteration and `resume=True` continues.
After training, thresholds are picked per target compute ratio (the largest computed set whose ratio <= target)
and each thresholded router is exported as a MODULE Plan; step 0 computes everything.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from dcache.actions import Granularity
from dcache.adapters import adapter_for, submodule
from dcache.plan import Plan

from .core import (Calibration, FrontPoint, Template, first_output, make_template, measure, replace_first_output,
                   run_plan, write_front)

CHECKPOINT = "router.pt"


@dataclass(frozen=True)
class RouterConfig:
    objective: str = "harmonica"  # "harmonica" or "l2c"
    iterations: int = 60
    lr: float = 0.05
    beta: float = 1e-3  # weight of the mean router score (compute) term, relative to the normalised MSE
    ste_threshold: float = 0.5  # HarmoniCa: cache refresh when the hard score passes this
    lambda_every: int = 20  # HarmoniCa: refresh the image-error proxy every C iterations (0 = never)
    init: float = 2.0  # initial logits (sigmoid(2) = 0.88: start near "compute everything")
    seed: int = 0
    target_ratios: tuple[float, ...] = (0.5, 0.33)

    def __post_init__(self) -> None:
        if self.objective not in ("harmonica", "l2c"):
            raise ValueError(f"objective={self.objective!r} must be 'harmonica' or 'l2c'.")
        if self.iterations < 0:
            raise ValueError(f"iterations={self.iterations} must be >= 0.")
        if not all(0 < r <= 1 for r in self.target_ratios):
            raise ValueError(f"target_ratios {self.target_ratios} must be compute ratios in (0, 1].")


class _Router:
    """Forward hooks that blend module outputs with the router scores; the call counter gives (step, branch)."""

    def __init__(self, pipe: Any, template: Template, theta: torch.Tensor, config: RouterConfig):
        self.transformer = pipe.transformer
        self.template, self.theta, self.config = template, theta, config
        self.calls_per_step = len(template.branches)
        self.call = 0
        self.mode = "student"  # "student" | "teacher" | "off"
        self.cache: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.hooks = []
        adapter = adapter_for(self.transformer)
        blocks = [b for _, b in adapter.blocks(self.transformer)]
        for unit, name in enumerate(template.module_units):
            b, mod = name[1:].split(".", 1)
            module = submodule(blocks[int(b)], mod)
            self.hooks.append(module.register_forward_hook(lambda m, a, o, u=unit: self._blend(u, o)))

    @property
    def where(self) -> tuple[int, str]:
        return self.call // self.calls_per_step, self.template.branches[self.call % self.calls_per_step]

    def weight(self, step: int) -> torch.Tensor:
        return torch.sigmoid(self.theta[step])

    def _blend(self, unit: int, output: Any) -> Any:
        if self.mode != "student":
            return None
        step, branch = self.where
        leaves, spec = tree_flatten(output)
        key = (branch, unit)
        cached = self.cache.get(key)
        fresh = [t for t in leaves if isinstance(t, torch.Tensor)]
        if step == 0 or cached is None:
            blended = fresh
        else:
            w = self.weight(step)[unit]
            blended = [w * f + (1 - w) * c for f, c in zip(fresh, cached)]
        refresh = (self.config.objective == "l2c" or step == 0
                   or float(self.weight(step)[unit].detach()) > self.config.ste_threshold)
        if refresh or cached is None:
            self.cache[key] = [f.detach() for f in fresh]
        it = iter(blended)
        return tree_unflatten([next(it) if isinstance(t, torch.Tensor) else t for t in leaves], spec)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _train_generation(calib: Calibration, router: _Router, lam: torch.Tensor, config: RouterConfig) -> float:
    """One calibration generation with per-call losses backpropagated into theta.grad; returns the mean loss."""
    transformer = router.transformer
    losses = []

    def pre(module, args, kwargs):
        if router.mode == "student":
            torch.set_grad_enabled(True)

    def post(module, args, kwargs, output):
        if router.mode != "student":
            return None
        step, _ = router.where
        student = first_output(output)
        router.mode = "teacher"
        with torch.no_grad():
            teacher_out = transformer(*args, **kwargs)
        router.mode = "student"
        teacher = first_output(teacher_out)
        if step > 0 and student.requires_grad:
            mse = ((student - teacher) ** 2).mean() / (teacher.pow(2).mean() + 1e-12)
            loss = lam[step] * mse + config.beta * router.weight(step).mean()
            loss.backward()
            losses.append(float(loss.detach()))
        torch.set_grad_enabled(False)
        router.call += 1
        return replace_first_output(output, teacher if config.objective == "l2c" else student.detach())

    h1 = transformer.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = transformer.register_forward_hook(post, with_kwargs=True)
    grad_before = torch.is_grad_enabled()
    try:
        router.call, router.cache = 0, {}
        calib.generate()
    finally:
        h1.remove()
        h2.remove()
        torch.set_grad_enabled(grad_before)  # the caller's autograd mode, whatever the hooks left
    return float(np.mean(losses)) if losses else 0.0


def router_rows(theta: torch.Tensor, threshold: float) -> list[str]:
    scores = torch.sigmoid(theta)
    rows = ["".join("C" if s > threshold else "R" for s in row) for row in scores.tolist()]
    rows[0] = "C" * theta.shape[1]
    return rows


def image_error_proxy(calib: Calibration, template: Template, theta: torch.Tensor, threshold: float) -> torch.Tensor:
    """lambda[t] = MSE(final images with the hard router at step t only, uncached images), normalised to mean 1."""
    rows = router_rows(theta, threshold)
    ref = calib.reference()
    lam = torch.zeros(template.num_steps)
    full = "C" * len(template.module_units)
    for t in range(1, template.num_steps):
        if rows[t] == full:
            rows_t = None
        else:
            rows_t = [full] * template.num_steps
            rows_t[t] = rows[t] if "R" in rows[t] else "R" * len(full)
        plan = template.plan(Granularity.MODULE, rows_t or [full] * template.num_steps, method="iepo")
        lam[t] = float(((run_plan(calib, plan) - ref) ** 2).mean()) if rows_t else 0.0
    if lam[1:].sum() <= 0:
        return torch.ones(template.num_steps)
    lam[1:] = lam[1:] / lam[1:].mean().clamp_min(1e-20)
    return lam.clamp_min(0.05)


def train_router(calib: Calibration, out_dir: str | os.PathLike, config: RouterConfig = RouterConfig(), *,
                 template: Template | None = None, resume: bool = False, progress: bool = True,
                 stop_after: int | None = None) -> torch.Tensor:
    """Train theta [N, U]; checkpoint after every iteration; returns theta. stop_after: stop early (tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = template or make_template(calib)
    n, u = template.num_steps, len(template.module_units)
    ckpt = out / CHECKPOINT
    theta = torch.full((n, u), config.init)
    theta[0] = 5.0
    theta.requires_grad_(True)
    opt = torch.optim.AdamW([theta], lr=config.lr, weight_decay=0.0)
    lam = torch.ones(n)
    start = 0
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if tuple(state["theta"].shape) != (n, u):
            raise ValueError(f"the router checkpoint in {out} has shape {tuple(state['theta'].shape)}, the model gives "
                             f"{(n, u)}; use a new output folder.")
        with torch.no_grad():
            theta.copy_(state["theta"])
        opt.load_state_dict(state["optimizer"])
        lam, start = state["lambda"], state["iteration"]
    frozen = [p for p in calib.pipe.transformer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    router = _Router(calib.pipe, template, theta, config)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.iterations, initial=start, desc=f"{config.objective} router", leave=False)
    try:
        calib.reference()
        for it in range(start, config.iterations):
            if stop_after is not None and it >= stop_after:
                break
            if config.objective == "harmonica" and config.lambda_every and it % config.lambda_every == 0:
                router.mode = "off"
                router.remove()
                lam = image_error_proxy(calib, template, theta.detach(), config.ste_threshold)
                router = _Router(calib.pipe, template, theta, config)
            opt.zero_grad()
            loss = _train_generation(calib, router, lam, config)
            if theta.grad is not None:
                theta.grad[0] = 0.0
            opt.step()
            with torch.no_grad():
                theta.clamp_(-5.0, 5.0)
                theta[0] = 5.0
            _save(ckpt, {"theta": theta.detach().clone(), "optimizer": opt.state_dict(), "lambda": lam,
                         "iteration": it + 1, "config": asdict(config)})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4g}", mean_score=f"{float(torch.sigmoid(theta[1:]).mean()):.3f}")
    finally:
        router.remove()
        for p in frozen:
            p.requires_grad_(True)
        if bar is not None:
            bar.close()
    return theta.detach()


def _save(path: Path, state: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def threshold_for(theta: torch.Tensor, template: Template, target: float) -> float:
    """The threshold whose plan computes the most while keeping compute ratio <= target (step 0 always computes)."""
    scores = sorted(set(torch.sigmoid(theta[1:]).flatten().tolist()), reverse=True)
    best = 1.0  # threshold 1.0 = reuse everything after step 0
    lo, hi = 0, len(scores)  # binary search over "compute the k highest scores"
    while lo < hi:
        mid = (lo + hi + 1) // 2
        thr = scores[mid - 1] - 1e-12 if mid > 0 else 1.0
        plan = template.plan(Granularity.MODULE, router_rows(theta, thr), method="router")
        if template.compute_ratio(plan) <= target + 1e-12:
            lo, best = mid, thr
        else:
            hi = mid - 1
    return best


def router_search(calib: Calibration, out_dir: str | os.PathLike, config: RouterConfig = RouterConfig(), *,
                  template: Template | None = None, resume: bool = False, progress: bool = True) -> dict:
    """Train (or resume) the router, threshold it at each target compute ratio, measure, write the front."""
    template = template or make_template(calib)
    theta = train_router(calib, out_dir, config, template=template, resume=resume, progress=progress)
    points = []
    for target in config.target_ratios:
        thr = threshold_for(theta, template, target)
        plan = template.plan(Granularity.MODULE, router_rows(theta, thr), method=config.objective,
                             config={**asdict(config), "threshold": thr, "target_ratio": target})
        points.append(FrontPoint(f"{config.objective}-r{target:g}", plan, measure(calib, template, plan)))
    return write_front(out_dir, config.objective, points, config=asdict(config))


def router_plan(theta: torch.Tensor, template: Template, threshold: float, method: str = "router") -> Plan:
    return template.plan(Granularity.MODULE, router_rows(theta, threshold), method=method,
                         config={"threshold": threshold})
