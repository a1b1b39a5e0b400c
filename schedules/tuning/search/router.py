"""Learned routers: L2C (NeurIPS 2024) and HarmoniCa (ICML 2025), trained with the backbone frozen, thresholded
into MODULE plans.

Router: logits theta [N, U] (step x module unit: each block's attention / MLP / context MLP), score
w = sigmoid(theta). Training runs the calibration generation with torch forward hooks on the inner modules that
blend  out = cached + w * (fresh - cached)  (soft, differentiable in theta; L2C arXiv 2406.01733); the transformer's
parameters are frozen (requires_grad False), only theta trains (AdamW, clamped to [-5, 5]; step 0 is fixed at +5 =
always compute). At every transformer call the student (routers on) and the teacher (no reuse, same input) run; the
loss of the call is backpropagated right away (one call's graph in memory at a time), theta steps once per generation.

- L2C (one-step objective): loss = MSE(eps_student, eps_teacher) + beta * mean(w); the trajectory follows the teacher.
- HarmoniCa: Step-wise Denoising Training: the trajectory follows the *student's* prediction. Image-Error
  Proxy-guided objective: loss = lambda(t) * MSE + beta * mean(w), lambda(t) = error of the final images when the
  current hard router is applied at step t only (normalised to mean 1), refreshed every `lambda_every` iterations.

The MSE is normalised by the teacher's mean square (scale-free across models); beta is relative to it.

Where this departs from the papers, and why (measured on the bundled tiny model, 28 steps, benchmarks/search.py):

* The cache in training is the cache of inference. A unit's cached output is refreshed only where the *hard* router
  (score > `threshold`, the same threshold the plan is exported with; composed units as the engine executes them)
  computes it, so a reused unit blends with the output of the last step that computed it. The previous version
  refreshed the cache at every step (L2C) or whenever the score passed a fixed 0.5 (HarmoniCa), then exported plans
  at thresholds 0.89 / 0.97 picked for the compute targets: training saw caches one step old where the plans reused
  outputs up to 25 steps old (units such as b0.attn reused from step 0 to step 25). Its plans scored 26.6 / 25.8 dB
  at 0.5 and 23.5 / 23.3 dB at 0.33 held out, where ECAD's module plans reach 44 / 39 dB. L2C itself avoids the
  problem by alternating full-compute and routed steps (cache always one step old); that caps the compute ratio at
  >= 0.5, so here L2C routes every step like HarmoniCa and differs from it by the objective and the trajectory only.
* One router per target compute ratio, with beta adapted by dual ascent (log beta += beta_lr * (ratio - target) /
  target after every iteration, ratio = the hard plan's FLOP ratio at `threshold`), largest target first, each
  warm-started from the previous one. The papers set beta by hand and threshold one router; thresholding a router
  far from its training threshold is the mismatch above, so the budget is reached in training instead.
  `iterations` are split evenly over the targets. Export still takes the threshold that meets the target
  (`threshold_for`); after training it lies near `threshold`.
* lambda(t) of a step whose hard row computes everything is the error of reusing every unit at that step (the
  step's sensitivity) instead of 0: at the start every row computes, and lambda = 0 would switch the MSE term off
  for those steps until the router had already dropped them.
* `blend="ste"` (hard forward, the soft blend's gradient) makes a training generation exactly the exported plan's
  generation (tests/search/test_router.py checks this); it trains worse here (MSE has no gradient at a computed
  unit whose step computes everything, so the budget term drops whole steps), hence "soft" is the default.

The hooks below are the only place in the search package that touches modules (like schedules/tuning/profiling.py);
training state (theta, optimiser, iteration, lambda, beta, finished targets) is saved after every iteration and
`resume=True` continues.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcache.actions import Granularity
from dcache.compat.torch import tree_flatten, tree_unflatten
from dcache.model.adapters import reuse_composed_inputs, submodule
from dcache.model.families import adapter_for
from dcache.plans.plan import Plan
from dcache.files.checks import is_count, is_number, same
from dcache.files.atomic import remove_stale_temporaries
from dcache.files.state_file import load_state, refuse_legacy, save_state

from .checkpoint_checks import FIX, check_adam, check_tensor, damaged, field
from .core import (Calibration, FrontPoint, Template, first_output, make_template, measure, replace_first_output,
                   run_plan, write_front)

CHECKPOINT = "router.ckpt.safetensors"  # dcache.files.state_file: JSON + tensors, never a pickle
LEGACY_CHECKPOINT = "router.pt"  # what older versions pickled; refused, never opened
STATE_KIND = "router checkpoint"


@dataclass(frozen=True)
class RouterConfig:
    objective: str = "harmonica"  # "harmonica" or "l2c"
    iterations: int = 60  # training generations in all, split evenly over the target ratios
    lr: float = 0.2
    beta: float = 1e-3  # initial weight of the mean router score (compute) term; dual ascent adapts it per target
    beta_lr: float = 0.5  # dual ascent on log(beta): += beta_lr * (hard ratio - target) / target per iteration
    threshold: float = 0.5  # compute iff score > threshold: in training (cache refresh, hard forward) and export
    blend: str = "soft"  # "soft": w*fresh + (1-w)*cached (the papers); "ste": hard forward, sigmoid gradient
    lambda_every: int = 20  # HarmoniCa: refresh the image-error proxy every C iterations (0 = never)
    init: float = 0.5  # initial logits (sigmoid(0.5) = 0.62: just above the threshold, "compute everything")
    seed: int = 0
    target_ratios: tuple[float, ...] = (0.5, 0.33)
    dual: bool = True  # adapt beta to the target (False: fixed beta, one router thresholded per target)

    def __post_init__(self) -> None:
        if self.objective not in ("harmonica", "l2c"):
            raise ValueError(f"objective={self.objective!r} must be 'harmonica' or 'l2c'.")
        if self.iterations < 0:
            raise ValueError(f"iterations={self.iterations} must be >= 0.")
        if not all(0 < r <= 1 for r in self.target_ratios):
            raise ValueError(f"target_ratios {self.target_ratios} must be compute ratios in (0, 1].")
        if self.blend not in ("soft", "ste"):
            raise ValueError(f"blend={self.blend!r} must be 'soft' or 'ste'.")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold={self.threshold} must lie in (0, 1) (a sigmoid score).")


def hard_rows(theta: torch.Tensor, threshold: float, template: Template | None = None) -> list[str]:
    """MODULE rows of the hard router: 'C' where sigmoid(theta) > threshold; step 0 computes everything. With a
    template, the rows as the engine executes them (inputs of a reused composed unit are reused too)."""
    scores = torch.sigmoid(theta)
    rows = ["".join("C" if s > threshold else "R" for s in row) for row in scores.tolist()]
    rows[0] = "C" * theta.shape[1]
    if template is not None and template.composed:
        rows = [reuse_composed_inputs(r, template.composed) for r in rows]
    return rows


class _Router:
    """Forward hooks that blend module outputs with the router scores; the call counter gives (step, branch).

    The cache is the one inference keeps: a unit's cached output is refreshed only where the hard router computes it
    (`rows`, as the engine executes them), so a reused unit reads the output of the last step that computed it."""

    def __init__(self, pipe: Any, template: Template, theta: torch.Tensor, config: RouterConfig):
        self.transformer = pipe.transformer
        self.template, self.theta, self.config = template, theta, config
        self.calls_per_step = len(template.branches)
        self.call = 0
        self.mode = "off"  # "student" | "teacher" | "off" (outside training generations)
        self.cache: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.rows: list[str] = []
        self.hooks = []
        adapter = adapter_for(self.transformer)
        blocks = [b for _, b in adapter.blocks(self.transformer)]
        for unit, name in enumerate(template.module_units):
            b, mod = name[1:].split(".", 1)
            module = submodule(blocks[int(b)], mod)
            self.hooks.append(module.register_forward_hook(lambda m, a, o, u=unit: self._blend(u, o)))

    def start(self) -> None:
        """A new generation: empty cache, hard rows of the current theta."""
        self.call, self.cache, self.mode = 0, {}, "student"
        self.rows = hard_rows(self.theta.detach(), self.config.threshold, self.template)

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
        computes = cached is None or self.rows[step][unit] == "C"
        if step == 0 or cached is None:
            blended = fresh
        else:
            w = self.weight(step)[unit]
            if self.config.blend == "ste":  # forward exactly the hard plan's; gradient of the soft blend
                blended = [(f if computes else c) + (w - w.detach()) * (f - c) for f, c in zip(fresh, cached)]
            else:
                blended = [c + w * (f - c) for f, c in zip(fresh, cached)]
        if computes:
            self.cache[key] = [f.detach() for f in fresh]
        it = iter(blended)
        return tree_unflatten([next(it) if isinstance(t, torch.Tensor) else t for t in leaves], spec)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _train_generation(calib: Calibration, router: _Router, lam: torch.Tensor, beta: float,
                      config: RouterConfig) -> tuple[float, torch.Tensor]:
    """One calibration generation with per-call losses backpropagated into theta.grad; returns the mean loss and
    the generated images (the student's trajectory for HarmoniCa, the teacher's for L2C)."""
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
            loss = lam[step] * mse + beta * router.weight(step).mean()
            loss.backward()
            losses.append(float(loss.detach()))
        torch.set_grad_enabled(False)
        router.call += 1
        return replace_first_output(output, teacher if config.objective == "l2c" else student.detach())

    h1 = transformer.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = transformer.register_forward_hook(post, with_kwargs=True)
    grad_before = torch.is_grad_enabled()
    try:
        router.start()
        images = calib.generate().detach().float().cpu()
    finally:
        h1.remove()
        h2.remove()
        router.mode = "off"
        torch.set_grad_enabled(grad_before)  # the caller's autograd mode, whatever the hooks left
    return (float(np.mean(losses)) if losses else 0.0), images


def image_error_proxy(calib: Calibration, template: Template, theta: torch.Tensor, threshold: float) -> torch.Tensor:
    """lambda[t] = MSE(final images with the hard router at step t only, uncached images), normalised to mean 1.

    A step whose hard row computes everything has no error of its own; it gets the error of reusing every unit at
    that step instead (its sensitivity), so that lambda stays defined when the router starts at "compute all"."""
    rows = hard_rows(theta, threshold)
    ref = calib.reference()
    lam = torch.zeros(template.num_steps)
    full = "C" * len(template.module_units)
    for t in range(1, template.num_steps):
        rows_t = [full] * template.num_steps
        rows_t[t] = rows[t] if "R" in rows[t] else "R" * len(full)
        plan = template.plan(Granularity.MODULE, rows_t, method="iepo")
        lam[t] = float(((run_plan(calib, plan) - ref) ** 2).mean())
    if lam[1:].sum() <= 0:
        return torch.ones(template.num_steps)
    lam[1:] = lam[1:] / lam[1:].mean().clamp_min(1e-20)
    return lam.clamp_min(0.05)


def _targets(config: RouterConfig) -> list[float]:
    return sorted(set(config.target_ratios), reverse=True) if config.dual else [max(config.target_ratios)]


def _iterations(config: RouterConfig) -> list[int]:
    k = len(_targets(config))
    return [config.iterations // k + (1 if i < config.iterations % k else 0) for i in range(k)]


def train_routers(calib: Calibration, out_dir: str | os.PathLike, config: RouterConfig = RouterConfig(), *,
                  template: Template | None = None, resume: bool = False, progress: bool = True,
                  stop_after: int | None = None) -> dict[float, torch.Tensor]:
    """Train theta [N, U] per target ratio (largest first, each warm-started from the previous); checkpoint after
    every iteration; returns {target: theta}. stop_after: stop after that many iterations in all (tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = template or make_template(calib)
    n, u = template.num_steps, len(template.module_units)
    ckpt = out / CHECKPOINT
    targets, iters = _targets(config), _iterations(config)
    theta = torch.full((n, u), config.init)
    theta[0] = 5.0
    theta.requires_grad_(True)
    opt = torch.optim.AdamW([theta], lr=config.lr, weight_decay=0.0)
    lam = torch.ones(n)
    log_beta = math.log(config.beta)
    done: dict[float, torch.Tensor] = {}
    start = 0
    if resume:
        remove_stale_temporaries(out)  # a run killed (kill -9) while writing a file left its temporary file
    if resume and (ckpt.is_file() or (out / LEGACY_CHECKPOINT).exists()):
        refuse_legacy(out / LEGACY_CHECKPOINT, STATE_KIND, FIX)
        state = load_state(ckpt, STATE_KIND, FIX)
        saved = field(state, "theta", ckpt, STATE_KIND)
        if isinstance(saved, torch.Tensor) and tuple(saved.shape) != (n, u):
            raise ValueError(f"the router checkpoint in {out} has shape {tuple(saved.shape)}, the model "
                             f"gives {(n, u)}; use a new output folder.")
        if not same(field(state, "config", ckpt, STATE_KIND), asdict(config)):
            raise ValueError(f"the router checkpoint in {out} was trained with another config; use a new output "
                             f"folder (or resume=False).")
        _check_state(state, ckpt, theta, opt, targets)
        with torch.no_grad():
            theta.copy_(state["theta"])
        opt.load_state_dict(state["optimizer"])
        lam, start, log_beta, done = state["lambda"], state["iteration"], state["log_beta"], state["done"]
    frozen = [p for p in calib.pipe.transformer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    router = _Router(calib.pipe, template, theta, config)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.iterations, initial=start, desc=f"{config.objective} router", leave=False)
    bounds = np.cumsum([0] + iters)
    try:
        calib.reference()
        for it in range(start, config.iterations):
            if stop_after is not None and it >= stop_after:
                break
            k = int(np.searchsorted(bounds, it, side="right") - 1)
            target, local = targets[k], it - bounds[k]
            if config.objective == "harmonica" and config.lambda_every and local % config.lambda_every == 0:
                router.remove()
                lam = image_error_proxy(calib, template, theta.detach(), config.threshold)
                router = _Router(calib.pipe, template, theta, config)
            opt.zero_grad()
            loss, _ = _train_generation(calib, router, lam, math.exp(log_beta), config)
            if theta.grad is not None:
                theta.grad[0] = 0.0
            opt.step()
            with torch.no_grad():
                theta.clamp_(-5.0, 5.0)
                theta[0] = 5.0
            ratio = template.compute_ratio(template.plan(Granularity.MODULE, hard_rows(theta.detach(),
                                                                                       config.threshold), method="r"))
            if config.dual:
                log_beta += config.beta_lr * (ratio - target) / target
            if it + 1 == bounds[k + 1]:
                done[target] = theta.detach().clone()
            _save(ckpt, {"theta": theta.detach().clone(), "optimizer": opt.state_dict(), "lambda": lam,
                         "iteration": it + 1, "log_beta": log_beta, "done": done, "config": asdict(config)})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4g}", ratio=f"{ratio:.3f}", beta=f"{math.exp(log_beta):.3g}")
    finally:
        router.remove()
        for p in frozen:
            p.requires_grad_(True)
        if bar is not None:
            bar.close()
    for target in targets:  # untrained targets (iterations 0 or stopped early) get the current theta
        done.setdefault(target, theta.detach().clone())
    if not config.dual:
        done = {t: done[targets[0]] for t in config.target_ratios}
    return done


def train_router(calib: Calibration, out_dir: str | os.PathLike, config: RouterConfig = RouterConfig(),
                 **kwargs) -> torch.Tensor:
    """The router of the smallest target ratio (the last one trained)."""
    return train_routers(calib, out_dir, config, **kwargs)[min(config.target_ratios)]


def _save(path: Path, state: dict) -> None:
    save_state(path, state, STATE_KIND)


def _check_state(state: dict, ckpt: Path, theta: torch.Tensor, opt: torch.optim.Optimizer,
                 targets: list[float]) -> None:
    """Every field of a router checkpoint (see _save) against the running training; theta's shape and the config
    are checked by the caller (their own messages). A clamped theta lies in [-5, 5]."""
    n = theta.shape[0]
    check_tensor(state["theta"], theta.shape, "theta", ckpt, STATE_KIND, low=-5.0)
    if float(state["theta"].max()) > 5.0:
        raise damaged(ckpt, STATE_KIND, "theta holds logits beyond the clamp of 5")
    check_adam(field(state, "optimizer", ckpt, STATE_KIND), [theta], opt.state_dict(), "optimizer", ckpt, STATE_KIND)
    check_tensor(field(state, "lambda", ckpt, STATE_KIND), (n,), "lambda", ckpt, STATE_KIND, low=0.0)
    if not is_count(field(state, "iteration", ckpt, STATE_KIND), 0):
        raise damaged(ckpt, STATE_KIND, f"iteration {state['iteration']!r} is not an int >= 0")
    if not is_number(field(state, "log_beta", ckpt, STATE_KIND), -700.0, 700.0):  # exp() of it must stay finite
        raise damaged(ckpt, STATE_KIND, f"log_beta {state['log_beta']!r} is not a number in [-700, 700]")
    done = field(state, "done", ckpt, STATE_KIND)
    if not isinstance(done, dict) or not all(any(same(k, t) for t in targets) for k in done):
        raise damaged(ckpt, STATE_KIND, "done holds routers of other target ratios than this config's")
    for target, saved in done.items():
        check_tensor(saved, theta.shape, f"the router of target {target}", ckpt, STATE_KIND, low=-5.0)


def threshold_for(theta: torch.Tensor, template: Template, target: float) -> float:
    """The threshold whose plan computes the most while keeping compute ratio <= target (step 0 always computes)."""
    scores = sorted(set(torch.sigmoid(theta[1:]).flatten().tolist()), reverse=True)
    best = 1.0  # threshold 1.0 = reuse everything after step 0
    lo, hi = 0, len(scores)  # binary search over "compute the k highest scores"
    while lo < hi:
        mid = (lo + hi + 1) // 2
        thr = scores[mid - 1] - 1e-12 if mid > 0 else 1.0
        plan = template.plan(Granularity.MODULE, hard_rows(theta, thr), method="router")
        if template.compute_ratio(plan) <= target + 1e-12:
            lo, best = mid, thr
        else:
            hi = mid - 1
    return best


def router_search(calib: Calibration, out_dir: str | os.PathLike, config: RouterConfig = RouterConfig(), *,
                  template: Template | None = None, resume: bool = False, progress: bool = True) -> dict:
    """Train (or resume) the routers, threshold each at its target compute ratio, measure, write the front."""
    template = template or make_template(calib)
    thetas = train_routers(calib, out_dir, config, template=template, resume=resume, progress=progress)
    points = []
    for target in config.target_ratios:
        theta = thetas[target]
        thr = threshold_for(theta, template, target)
        plan = template.plan(Granularity.MODULE, hard_rows(theta, thr), method=config.objective,
                             config={**asdict(config), "threshold": thr, "target_ratio": target})
        points.append(FrontPoint(f"{config.objective}-r{target:g}", plan, measure(calib, template, plan)))
    return write_front(out_dir, config.objective, points, config=asdict(config))


def router_plan(theta: torch.Tensor, template: Template, threshold: float, method: str = "router") -> Plan:
    return template.plan(Granularity.MODULE, hard_rows(theta, threshold), method=method,
                         config={"threshold": threshold})
