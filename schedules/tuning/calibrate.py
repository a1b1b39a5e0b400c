"""Calibration users can run: MagCache magnitude ratios and TeaCache polynomial coefficients.

    from dcache.schedules.tuning.calibrate import calibrate_magcache, calibrate_teacache
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

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

import dcache
from dcache import Action, CallContext, Granularity, Schedule, Signal

from ..calibration_file import CalibrationEntry, save_calibration
from ..tables import model_identity, register_table

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
    from ..teacache import TeaCacheConfig, TeaCacheSchedule

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
    from ..teacache import TeaCacheConfig, TeaCacheSchedule

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
