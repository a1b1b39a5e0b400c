"""Calibration users can run: MagCache magnitude ratios, TeaCache polynomial coefficients, and target resolution.

    from dcache.schedules.calibrate import calibrate_magcache, calibrate_teacache
    from dcache.schedules.calibration_file import load_calibration
    run = lambda: pipe(labels=[0, 1, 2, 3], num_inference_steps=28)       # any callable running ONE generation
    ratios = calibrate_magcache(pipe, run, path="cal.json")           # {"cond": [1.0, g1, ...], "uncond": [...]}
    coeffs = calibrate_teacache(pipe, [run_a, run_b, run_c], path="cal.json")
    dcache.apply(pipe, "magcache", calibration="cal.json")            # or: load_calibration("cal.json").register()

Each calibration runs the pipeline uncached with an all-compute recording schedule and reads the per-call signals
the engine records (`handle.engine.record.calls[i].signals`):
  * MagCache: gamma_i = RESIDUAL_NORM_RATIO = mean over tokens ||R_i|| / ||R_{i-1}|| of the stack residual, per
    branch, prefixed with 1.0, rounded to 5 decimals, averaged over runs (MagCache, arXiv 2506.09045).
  * TeaCache: x_i = MODULATED_REL_L1 (first block's modulated input vs the previous call of the branch) and
    y_i = relL1 of the stack output vs the previous call = OUTPUT_DELTA_i / OUTPUT_MEAN_{i-1}; the coefficients are
    numpy.polyfit(x, y, 4) over every (x, y) of every run and branch (§2e).

The calibration file they write is described in schedules/calibration_file.py.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

import dcache
from dcache import Action, CallContext, Granularity, Schedule, Signal
from dcache.methods import register_target_resolver

from .calibration_file import CalibrationEntry, save_calibration
from .tables import model_identity, register_table

RunFn = Callable[[], Any]


# ------------------------------------------------------------------------------------------------------------------
# Recording uncached runs
# ------------------------------------------------------------------------------------------------------------------

class RecordingSchedule(Schedule):
    """Computes everything and asks the engine for `signals` (so they land in the generation record)."""

    granularity = Granularity.STACK

    def __init__(self, signals: Iterable[Signal]):
        self.signals = frozenset(signals)
        self.name = "calibration"

    def decide(self, ctx: CallContext) -> Action:
        return Action.COMPUTE


@dataclass
class Recording:
    """Per run, per branch (canonical names "cond" / "uncond" / ...), the signal dicts of the calls in step order."""

    runs: list[dict[str, list[dict[str, float]]]]
    model_identity: str
    model_class: str
    num_steps: int | None
    scheduler: str | None
    resolution: list[int] | None


def _canonical_branches(names: list[str]) -> dict[str, str]:
    """cond / uncond stay; one branch (call0, cond_uncond) becomes "cond"; call0 / call1 become cond / uncond."""
    if "cond" in names or "uncond" in names:
        return {n: n for n in names}
    mapping = {}
    for i, n in enumerate(names):
        mapping[n] = ("cond", "uncond")[i] if i < 2 else n
    return mapping


def _as_run_fns(run_fn: RunFn | Sequence[RunFn], runs: int) -> list[RunFn]:
    fns = list(run_fn) if isinstance(run_fn, (list, tuple)) else [run_fn]
    if not fns or not all(callable(f) for f in fns):
        raise ValueError("run_fn must be a callable that runs one uncached generation (e.g. "
                         "`lambda: pipe(labels=[0, 1], num_inference_steps=28)`) or a list of such callables.")
    if runs < 1:
        raise ValueError(f"runs={runs} must be >= 1 (how many times each run_fn is called).")
    return [f for _ in range(runs) for f in fns]


def record_signals(target: Any, run_fn: RunFn | Sequence[RunFn], signals: Iterable[Signal], *, runs: int = 1,
                   num_steps: int | None = None) -> Recording:
    """Run every run_fn with an all-compute recording schedule and collect the per-call signals."""
    fns = _as_run_fns(run_fn, runs)
    handle = dcache.apply(target, RecordingSchedule(signals), num_steps=num_steps)
    engine = handle.engine
    records = []
    try:
        for fn in fns:
            before = engine.generations
            fn()
            started = engine.generations - before
            if started != 1 or engine.record is None or not engine.record.calls:
                raise ValueError(f"a calibration run_fn must run exactly one generation, but it ran {started}. Pass "
                                 f"one callable per generation (a list), or for a bare transformer pass num_steps=N.")
            records.append(engine.record)
    finally:
        handle.remove()  # flushes the last call's post-compute signals into its record
    transformer = engine.transformer
    scheduler = getattr(target, "scheduler", None)
    last = records[-1]
    runs_out = []
    for rec in records:
        names = rec.branches()
        mapping = _canonical_branches(names)
        per_branch: dict[str, list[dict[str, float]]] = {}
        for call in rec.calls:
            per_branch.setdefault(mapping[call.branch], []).append(dict(call.signals))
        runs_out.append(per_branch)
    return Recording(runs_out, model_identity(transformer), type(transformer).__name__,
                     last.num_steps or (max(c.step for c in last.calls) + 1),
                     type(scheduler).__name__ if scheduler is not None else None,
                     list(last.input_shape[1:]) if last.input_shape else None)


def _finish(rec: Recording, method: str, table: Any, path: str | os.PathLike | None, register: bool,
            extra: dict[str, Any]) -> None:
    if register:
        register_table(method, rec.model_identity, table)
    if path is not None:
        entry = CalibrationEntry(method=method, model_identity=rec.model_identity, model_class=rec.model_class,
                                 table=table, num_steps=rec.num_steps, scheduler=rec.scheduler,
                                 resolution=rec.resolution, runs=len(rec.runs),
                                 provenance={"created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                             "dcache": dcache.__version__, **extra})
        save_calibration(path, entry)


# ------------------------------------------------------------------------------------------------------------------
# MagCache
# ------------------------------------------------------------------------------------------------------------------

def calibrate_magcache(target: Any, run_fn: RunFn | Sequence[RunFn], *, runs: int = 1, num_steps: int | None = None,
                       path: str | os.PathLike | None = None, register: bool = True,
                       decimals: int = 5) -> dict[str, list[float]]:
    """Magnitude ratios per branch, {"cond": [1.0, g1, ...], "uncond": [...]}, from uncached runs.

    target:   a pipeline or a transformer (then pass num_steps); run_fn: callable(s) running one generation each.
    path:     also write/merge the calibration file; register: make it the model's MagCache table right away.
    """
    rec = record_signals(target, run_fn, {Signal.RESIDUAL_NORM_RATIO}, runs=runs, num_steps=num_steps)
    key = Signal.RESIDUAL_NORM_RATIO.value
    table: dict[str, list[float]] = {}
    for branch in rec.runs[0]:
        curves = []
        for run in rec.runs:
            calls = run.get(branch, [])
            curves.append([1.0 if i == 0 else float(c.get(key, 1.0)) for i, c in enumerate(calls)])
        length = min(len(c) for c in curves)
        mean = np.mean([c[:length] for c in curves], axis=0)
        table[branch] = [round(float(g), decimals) for g in mean]
    _finish(rec, "magcache", table, path, register, {"signal": key})
    return table


# ------------------------------------------------------------------------------------------------------------------
# TeaCache
# ------------------------------------------------------------------------------------------------------------------

TEACACHE_SIGNALS = frozenset({Signal.MODULATED_REL_L1, Signal.OUTPUT_DELTA, Signal.OUTPUT_MEAN})


def teacache_points(rec: Recording) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) pairs: modulated-input relL1 and stack-output relL1 between consecutive calls of a branch."""
    xs, ys = [], []
    for run in rec.runs:
        for calls in run.values():
            for prev, cur in zip(calls, calls[1:]):
                x = cur.get(Signal.MODULATED_REL_L1.value)
                delta = cur.get(Signal.OUTPUT_DELTA.value)
                mean = prev.get(Signal.OUTPUT_MEAN.value)
                if x is None or delta is None or not mean:
                    continue
                xs.append(x)
                ys.append(delta / mean)
    return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)


def x_sequences(rec: Recording) -> list[list[float | None]]:
    """Per run and branch, the modulated-input relL1 of each call in step order (None where not measured)."""
    key = Signal.MODULATED_REL_L1.value
    return [[c.get(key) for c in calls] for run in rec.runs for calls in run.values()]


def simulate_teacache(table: dict[str, Any], sequences: list[list[float | None]], threshold: float) -> float:
    """Fraction of calls TeaCache would compute at `threshold` on recorded x sequences (assumes caching leaves x as
    recorded; x depends mostly on the timestep, so this is close)."""
    from .teacache import TeaCacheConfig, TeaCacheSchedule

    schedule = TeaCacheSchedule(TeaCacheConfig(threshold=threshold), {**table, "threshold": threshold})
    computed = total = 0
    for seq in sequences:
        schedule.reset(None)  # type: ignore[arg-type]  (reset ignores the generation info)
        for step, x in enumerate(seq):
            signals = {} if x is None else {Signal.MODULATED_REL_L1: x}
            ctx = CallContext(step=step, num_steps=len(seq), branch="b", call_index=step, timestep=None,
                              signals=signals)
            computed += schedule.decide(ctx) is Action.COMPUTE
            total += 1
    return computed / max(total, 1)


def suggest_teacache_threshold(table: dict[str, Any], sequences: list[list[float | None]],
                               target_compute_ratio: float) -> float:
    """The smallest threshold (log grid, 4 significant digits) whose simulated compute fraction is <= the target."""
    from .teacache import TeaCacheConfig, TeaCacheSchedule

    estimate = TeaCacheSchedule(TeaCacheConfig(threshold=1.0), dict(table)).estimate
    sums = [sum(abs(estimate(x)) for x in seq if x is not None) for seq in sequences]
    if not any(sums):
        raise ValueError("no modulated-input signal was recorded; the calibration runs had fewer than 2 steps.")
    top = 1.01 * max(sums)  # at this threshold every skippable call reuses
    for threshold in np.geomspace(top * 1e-6, top, 400):
        if simulate_teacache(table, sequences, float(threshold)) <= target_compute_ratio:
            return float(f"{threshold:.4g}")
    return float(f"{top:.4g}")


def calibrate_teacache(target: Any, run_fn: RunFn | Sequence[RunFn], *, runs: int = 1, num_steps: int | None = None,
                       path: str | os.PathLike | None = None, register: bool = True,
                       threshold: float | None = None, target_compute_ratio: float = 0.6) -> dict[str, Any]:
    """TeaCache coefficients (numpy.polyfit(x, y, 4), highest power first) from uncached runs.

    Returns {"coefficients": [...], "points": n, "x_range": [lo, hi], "fit_rel_error": mean|fit - y| / mean|y|,
    "threshold": t}. The threshold is the one given, else the smallest one at which TeaCache, simulated on the
    recorded x sequences, computes at most `target_compute_ratio` of the calls (0.6: about 1.7x); it becomes the
    table's recommended threshold. Several runs (different prompts / seeds) give a steadier fit: TeaCache's authors
    used 70 prompts.
    """
    signals = TEACACHE_SIGNALS
    rec = record_signals(target, run_fn, signals, runs=runs, num_steps=num_steps)
    x, y = teacache_points(rec)
    if len(x) < 5:
        raise ValueError(f"TeaCache calibration found only {len(x)} (x, y) points; run more steps (>= 6 per run) or "
                         f"more runs.")
    coefficients = np.polyfit(x, y, 4)
    fit = np.polyval(coefficients, x)
    table: dict[str, Any] = {
        "coefficients": [float(c) for c in coefficients],
        "points": int(len(x)),
        "x_range": [float(x.min()), float(x.max())],
        "fit_rel_error": float(np.abs(fit - y).mean() / max(np.abs(y).mean(), 1e-12)),
    }
    if threshold is None:
        if not 0.0 < target_compute_ratio <= 1.0:
            raise ValueError(f"target_compute_ratio={target_compute_ratio} must be in (0, 1].")
        table["threshold"] = suggest_teacache_threshold(table, x_sequences(rec), target_compute_ratio)
        table["threshold_for"] = {"compute_ratio": target_compute_ratio}
    else:
        table["threshold"] = float(threshold)
    _finish(rec, "teacache", table, path, register, {"signals": sorted(s.value for s in signals)})
    return table


# ------------------------------------------------------------------------------------------------------------------
# Target resolution: sweep a method's main knob, pick the fastest setting that meets a speed or quality target
# ------------------------------------------------------------------------------------------------------------------

# method -> (knob, grid from conservative to aggressive)
MAIN_KNOBS: dict[str, tuple[str, tuple]] = {
    "magcache": ("threshold", (0.02, 0.04, 0.06, 0.1, 0.15, 0.24, 0.4, 0.6)),
    "teacache": ("threshold", (0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.2)),
    "fbcache": ("threshold", (0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.4)),
    "easycache": ("threshold", (0.01, 0.02, 0.035, 0.05, 0.08, 0.12, 0.2, 0.3)),
    "cg_taylor": ("threshold", (0.01, 0.02, 0.03, 0.05, 0.08, 0.13, 0.2, 0.36)),
    "taylorseer": ("interval", (2, 3, 4, 5, 6, 7, 8)),
    "fora": ("interval", (2, 3, 4, 5, 6, 7)),
    "fixed_interval": ("interval", (2, 3, 4, 5, 6)),
    "delta_dit": ("interval", (2, 3, 4, 5, 6)),
    "pab": ("spatial_range", (2, 3, 4, 5, 6)),
}


@dataclass
class TargetResult:
    method: str
    knob: str
    value: Any  # None when no setting met the target
    config: Any  # the chosen MethodConfig (None when none met the target)
    met: bool
    sweep: list[dict[str, float]]  # per grid value: value, compute_ratio, ideal_speedup, psnr


def _parse_target(speed: str | float | None, quality: str | None) -> tuple[str, float]:
    if (speed is None) == (quality is None):
        raise ValueError("pass exactly one target: speed='2x' (ideal speed-up >= 2) or quality='psnr>=30'.")
    if speed is not None:
        text = str(speed).strip().lower().rstrip("x")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"speed={speed!r} must look like '2x' or 2.0 (ideal speed-up).") from None
        if not math.isfinite(value) or value < 1.0:  # NaN passes every comparison: refuse it here, before a sweep
            raise ValueError(f"speed={speed!r} must be a finite speed-up >= 1x (NaN and infinity are not allowed), "
                             f"e.g. speed='2x'.")
        return "speed", value
    text = str(quality).replace(" ", "").lower()
    if not text.startswith("psnr>="):
        raise ValueError(f"quality={quality!r} must look like 'psnr>=30' (dB vs the uncached output).")
    try:
        value = float(text[len("psnr>="):])
    except ValueError:
        raise ValueError(f"quality={quality!r} must look like 'psnr>=30'.") from None
    if not math.isfinite(value):
        raise ValueError(f"quality={quality!r}: the PSNR bound must be a finite number of dB (NaN and infinity are "
                         f"not allowed), e.g. quality='psnr>=30'.")
    return "psnr", value


def psnr(output: torch.Tensor, reference: torch.Tensor, data_range: float | None = None) -> float:
    """Peak signal-to-noise ratio in dB; data_range defaults to 1.0 for [0, 1] data, else the reference's range."""
    out, ref = output.detach().float(), reference.detach().float()
    if data_range is None:
        lo, hi = float(ref.min()), float(ref.max())
        data_range = 1.0 if lo >= 0.0 and hi <= 1.0 else max(hi - lo, 1e-12)
    mse = float(((out - ref) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * math.log10(data_range ** 2 / mse)


def _output_tensor(result: Any) -> torch.Tensor:
    for attr in ("images", "frames", "sample"):
        value = getattr(result, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, np.ndarray):
        return torch.from_numpy(result)
    raise TypeError(f"run_fn must return a tensor (or a pipeline output with tensor .images), got "
                    f"{type(result).__name__}; call the pipeline with output_type='pt'.")


def resolve_target(method: str, *, target: Any, run_fn: RunFn, speed: str | float | None = None,
                   quality: str | None = None, reference_fn: RunFn | None = None, grid: Sequence | None = None,
                   knob: str | None = None, num_steps: int | None = None, scope: str | None = None,
                   **fixed: Any) -> TargetResult:
    """Sweep `method`'s main knob over `grid` and pick the fastest setting meeting the target.

    speed="2x":       among settings with ideal speed-up >= 2, the one with the best PSNR (the least lossy way to
                      be that fast);
    quality="psnr>=30": the setting with the highest ideal speed-up whose PSNR vs the uncached output is >= 30 dB.
    run_fn runs one generation and returns its output (tensor, or pipeline output with .images); reference_fn
    (default run_fn without caching) gives the uncached output. `knob` / `grid` override the swept knob and its
    values (MAIN_KNOBS holds the defaults); `fixed` are other knobs of the method; `scope` is dcache.apply's.
    """
    kind, goal = _parse_target(speed, quality)
    preset = dcache.presets().get(method)
    base = preset.method if preset is not None else method
    if base not in MAIN_KNOBS and (knob is None or grid is None):
        raise ValueError(f"no main knob known for {method!r} (known: {sorted(MAIN_KNOBS)}); pass knob='<field>' and "
                         f"grid=[...] to sweep one of its config fields.")
    knob_name = knob if knob is not None else MAIN_KNOBS[base][0]
    values = list(grid) if grid is not None else list(MAIN_KNOBS[base][1])
    transformer = target if isinstance(target, nn.Module) and not hasattr(target, "scheduler") else getattr(
        target, "transformer", None)
    if getattr(transformer, "_dcache_engine", None) is not None:
        raise RuntimeError("resolve_target needs the model without dcache applied; remove the handle first.")
    reference = _output_tensor((reference_fn or run_fn)())
    sweep: list[dict[str, float]] = []
    configs: list[Any] = []
    for value in values:
        config = dcache.config_for(method, **{**fixed, knob_name: value})
        handle = dcache.apply(target, config, num_steps=num_steps, scope=scope)
        try:
            out = _output_tensor(run_fn())
            stats = handle.stats()
        finally:
            handle.remove()
        sweep.append({"value": value, "compute_ratio": stats.compute_ratio, "ideal_speedup": stats.ideal_speedup,
                      "psnr": psnr(out, reference)})
        configs.append(config)
    if kind == "speed":
        ok = [i for i, row in enumerate(sweep) if row["ideal_speedup"] >= goal]
        best = max(ok, key=lambda i: (sweep[i]["psnr"], -sweep[i]["compute_ratio"])) if ok else None
    else:
        ok = [i for i, row in enumerate(sweep) if row["psnr"] >= goal]
        best = max(ok, key=lambda i: (sweep[i]["ideal_speedup"], sweep[i]["psnr"])) if ok else None
    if best is None:
        return TargetResult(method, knob_name, None, None, False, sweep)
    return TargetResult(method, knob_name, values[best], configs[best], True, sweep)



def format_sweep(result: TargetResult) -> str:
    """One line per swept setting: knob value, compute ratio, ideal speed-up, PSNR; the chosen one marked."""
    lines = [f"{result.method}: {result.knob} sweep on the calibration run"]
    for row in result.sweep:
        mark = "  <- chosen" if result.met and row["value"] == result.value else ""
        lines.append(f"  {result.knob}={row['value']!s:8s} compute ratio {row['compute_ratio']:.3f}  ideal "
                     f"{row['ideal_speedup']:.2f}x  PSNR {row['psnr']:.2f} dB{mark}")
    return "\n".join(lines)


@register_target_resolver
def resolve_for_apply(target: Any, method: Any, *, speed: Any, quality: Any, calibration_run: Any, num_steps: Any,
                      scope: Any, overrides: dict) -> tuple[Any, TargetResult]:
    """dcache.apply(speed= / quality=): the chosen config of `method` (resolve_target on calibration_run), or a
    teaching error (no name to sweep, no calibration run, target not met: the sweep is shown)."""
    _parse_target(speed, quality)  # a malformed target fails first, before asking for a run or sweeping
    what = f"speed={speed!r}" if speed is not None else f"quality={quality!r}"
    if not isinstance(method, str) or method.endswith(".json"):
        raise ValueError(f"{what} sweeps a method's main knob, so the method must be a method or preset name (e.g. "
                         f"'magcache'), not {type(method).__name__} {str(method)[:60]!r}.")
    if calibration_run is None:
        raise ValueError(f"{what} is resolved by sweeping {method!r}'s main knob on a calibration run; pass "
                         f"calibration_run=lambda: pipe(prompt, generator=torch.Generator().manual_seed(1), ...) "
                         f"(one generation, compared with the same generation uncached).")
    result = resolve_target(method, target=target, run_fn=calibration_run, speed=speed, quality=quality,
                            num_steps=num_steps, scope=scope, **overrides)
    if not result.met:
        raise ValueError(f"no setting of {method!r} meets {what} on the calibration run:\n{format_sweep(result)}\n"
                         f"Relax the target, or pick another method (dcache methods).")
    return result.config, result
