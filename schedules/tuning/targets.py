"""Target resolution: sweep a method's main knob, pick the fastest setting that meets a speed or quality target.

    result = resolve_target("magcache", target=pipe, run_fn=run, quality="psnr>=30")   # TargetResult
    print(format_sweep(result))
    dcache.apply(pipe, "magcache", quality="psnr>=30", calibration_run=run)          # the same, through apply

Each setting of the grid runs the calibration generation once with the method applied and is compared with the
uncached generation (PSNR in dB); `dcache.apply(speed= / quality=)` reaches `resolve_for_apply` through the
registry (`register_target_resolver`), so the core never names this module.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

import dcache
from dcache.generations.health import DCacheHealthWarning, quiet
from dcache.methods import knob_sweep, preset_scope, register_target_resolver
from dcache.quality import psnr

RunFn = Callable[[], Any]


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


def check_target(speed: str | float | None, quality: str | None) -> None:
    """A speed= / quality= target's form, checked before any model loads (the same errors as the sweep's)."""
    _parse_target(speed, quality)


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
                   progress: bool | Callable[[str], None] = True, **fixed: Any) -> TargetResult:
    """Sweep `method`'s main knob over `grid` and pick the fastest setting meeting the target.

    speed="2x":       among settings with ideal speed-up >= 2, the one with the best PSNR (the least lossy way to
                      be that fast);
    quality="psnr>=30": the setting with the highest ideal speed-up whose PSNR vs the uncached output is >= 30 dB.
    run_fn runs one generation and returns its output (tensor, or pipeline output with .images); reference_fn
    (default run_fn without caching) gives the uncached output. `knob` / `grid` override the swept knob and its
    values (defaults: the config's `main_knob`); `fixed` are other knobs of the method; `scope` is dcache.apply's.
    A method that calibrates itself on its first generation (MagCache on a model without shipped ratios) is
    calibrated once first, on run_fn, and every setting then runs with that calibration (1 + len(grid) runs).
    progress: a bar over the runs on stderr (True), a callable given one line per run, or nothing (False).
    """
    kind, goal = _parse_target(speed, quality)
    declared = knob_sweep(method)  # a preset's own main knob, else its method's
    if scope is None:
        scope = preset_scope(method)  # a preset that runs in call scope sweeps there too
    if declared is None and (knob is None or grid is None):
        known = sorted(name for name in dcache.methods() if knob_sweep(name) is not None)
        raise ValueError(f"no main knob known for {method!r} (known: {known}); pass knob='<field>' and "
                         f"grid=[...] to sweep one of its config fields.")
    knob_name = knob if knob is not None else declared[0]
    values = list(grid) if grid is not None else list(declared[1])
    transformer = target if isinstance(target, nn.Module) and not hasattr(target, "scheduler") else getattr(
        target, "transformer", None)
    if getattr(transformer, "_dcache_engine", None) is not None:
        raise RuntimeError("resolve_target needs the model without dcache applied; remove the handle first.")
    runs = _RunCounter(progress, 1 + len(values), f"dcache: {method} {knob_name} sweep")
    try:
        # a method that calibrates itself (MagCache without shipped ratios) would spend every setting's run on its
        # measuring generation (all computed, ratio 1.000): measure once here and sweep with what it measured
        measured, reference = _calibrate_once(method, target, run_fn, runs, num_steps=num_steps, scope=scope,
                                              fixed={**fixed, knob_name: values[0]})
        fixed = {**fixed, **measured}
        if reference is None or reference_fn is not None:
            if reference is not None:  # measured and a reference of the caller's: one run more than counted
                runs.grow(1)
            reference = _output_tensor((reference_fn or run_fn)())
            runs.done("uncached reference")
        sweep: list[dict[str, float]] = []
        configs: list[Any] = []
        for value in values:
            config = dcache.config_for(method, **{**fixed, knob_name: value})
            handle = dcache.apply(target, config, num_steps=num_steps, scope=scope)
            try:
                with quiet():  # a sweep tries settings that reuse nothing or everything on purpose
                    out = _output_tensor(run_fn())
                stats = handle.stats()
            finally:
                with quiet():
                    handle.remove()
            sweep.append({"value": value, "compute_ratio": stats.compute_ratio,
                          "ideal_speedup": stats.ideal_speedup,
                          # float32, data range 1 for [0, 1] outputs, else the reference's max - min
                          "psnr": psnr(out, reference, data_range=None, dtype=torch.float32)})
            configs.append(config)
            runs.done(f"{knob_name}={value}: ideal {stats.ideal_speedup:.2f}x, {sweep[-1]['psnr']:.1f} dB")
    finally:
        runs.close()
    if kind == "speed":
        ok = [i for i, row in enumerate(sweep) if row["ideal_speedup"] >= goal]
        best = max(ok, key=lambda i: (sweep[i]["psnr"], -sweep[i]["compute_ratio"])) if ok else None
    else:
        ok = [i for i, row in enumerate(sweep) if row["psnr"] >= goal]
        best = max(ok, key=lambda i: (sweep[i]["ideal_speedup"], sweep[i]["psnr"])) if ok else None
    if best is None:
        return TargetResult(method, knob_name, None, None, False, sweep)
    return TargetResult(method, knob_name, values[best], configs[best], True, sweep)


def choose_cfg_difference(method: str, *, target: Any, run_fn: RunFn, num_steps: int | None = None,
                          scope: str | None = None, progress: bool | Callable[[str], None] = True,
                          **fixed: Any) -> TargetResult:
    """Whether `method` (with `fixed` knobs) serves split CFG's unconditional calls through the CFG difference: the
    calibration generation runs with cfg_difference False and True, and the one closer to the uncached generation
    (PSNR) is chosen; a tie (the difference served nothing) keeps it off.

    Why a run and not only the run-time check. While it runs, the difference is checked against the branches' own
    caches at the steps where both computed (dcache.runtime.cfg_difference) and served only where it forecasts the
    calls better. A served call's smaller error can still lie more along the error the earlier cached steps left in
    the sample, and make the finished sample worse; only the uncached generation shows that, and a calibration run
    has it. Both settings compute the same calls, so the choice costs no speed."""
    fixed = {k: v for k, v in fixed.items() if k != "cfg_difference"}
    # speed 1x: every setting qualifies and the best PSNR wins; on a tie the first (off)
    return resolve_target(method, target=target, run_fn=run_fn, speed=1.0, knob="cfg_difference",
                          grid=[False, True], num_steps=num_steps, scope=scope, progress=progress, **fixed)


def _say_cfg_difference(choice: TargetResult) -> None:
    """A warning when cfg_difference=True was asked for and the calibration run chose to leave it off."""
    if choice.value is not False:
        return
    without, with_it = (row["psnr"] for row in choice.sweep)
    why = ("it served no call (see the handle's health notes for why)" if with_it == without else
           f"the generation came out further from the uncached one with it ({with_it:.2f} dB) than without it "
           f"({without:.2f} dB)")
    warnings.warn(f"cfg_difference=True was left off: on the calibration run {why}. handle.target.sweep holds both "
                  f"runs; pass cfg_difference=True without calibration_run= to serve it whenever its run-time "
                  f"check allows.", DCacheHealthWarning, stacklevel=5)


def _calibrate_once(method: str, target: Any, run_fn: RunFn, runs: "_RunCounter", *, num_steps: int | None,
                    scope: str | None, fixed: dict) -> tuple[dict, torch.Tensor | None]:
    """({config fields of the measured calibration}, the measuring run's output) for a schedule that calibrates
    itself on its first generation (Schedule.calibrating); ({}, None) for every other. The measuring generation
    computes every step, so its output is the uncached reference and doubles as it."""
    handle = dcache.apply(target, dcache.config_for(method, **fixed), num_steps=num_steps, scope=scope)
    try:
        schedule = handle.engine.schedule
        if not schedule.calibrating:
            return {}, None
        out = _output_tensor(run_fn())
        measured = schedule.measured_config()
    finally:
        handle.remove()
    if measured is None:
        raise RuntimeError(f"{method!r} calibrates itself on its first generation, but the calibration run did not "
                           f"complete one (every step of every branch); pass a calibration_run that runs one whole "
                           f"generation.")
    runs.done(f"calibrating {method} (all steps computed)")
    return measured, out


class _RunCounter:
    """The sweep's progress, one tick per generation: a tqdm bar on stderr (progress=True), a callable given one
    line per run (progress=fn), or nothing (False)."""

    def __init__(self, progress: bool | Callable[[str], None], total: int, desc: str):
        self._line = progress if callable(progress) else None
        self._bar = None
        if progress is True:
            import sys

            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, file=sys.stderr)
        self.total, self.count = total, 0

    def grow(self, n: int) -> None:
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def done(self, name: str) -> None:
        self.count += 1
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)
            self._bar.update(1)
        elif self._line is not None:
            self._line(f"run {self.count}/{self.total}: {name}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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
                      scope: Any, overrides: dict, progress: bool | Callable[[str], None] = True
                      ) -> tuple[Any, TargetResult]:
    """dcache.apply(speed= / quality=): the chosen config of `method` (resolve_target on calibration_run), or a
    teaching error (no name to sweep, no calibration run, target not met: the sweep is shown). Without a target,
    cfg_difference=True among the overrides lets the calibration run decide whether the difference is served
    (choose_cfg_difference); with one, the sweep runs with the overrides as given."""
    if speed is None and quality is None and calibration_run is not None:
        if overrides.get("cfg_difference") is not True:
            raise ValueError("calibration_run= alone chooses nothing: give a target with it (speed='2x' or "
                             "quality='psnr>=30'), or cfg_difference=True to let the run decide whether the CFG "
                             "difference is served.")
        _check_name(method, "cfg_difference=True with calibration_run=")
        choice = choose_cfg_difference(method, target=target, run_fn=calibration_run, num_steps=num_steps,
                                       scope=scope, progress=progress, **overrides)
        _say_cfg_difference(choice)
        return choice.config, choice
    _parse_target(speed, quality)  # a malformed target fails first, before asking for a run or sweeping
    what = f"speed={speed!r}" if speed is not None else f"quality={quality!r}"
    _check_name(method, what)
    if calibration_run is None:
        raise ValueError(f"{what} is resolved by sweeping {method!r}'s main knob on a calibration run; pass "
                         f"calibration_run=lambda: pipe(prompt, generator=torch.Generator().manual_seed(1), ...) "
                         f"(one generation, compared with the same generation uncached).")
    result = resolve_target(method, target=target, run_fn=calibration_run, speed=speed, quality=quality,
                            num_steps=num_steps, scope=scope, progress=progress, **overrides)
    if not result.met:
        raise ValueError(f"no setting of {method!r} meets {what} on the calibration run:\n{format_sweep(result)}\n"
                         f"Relax the target, or pick another method (dcache methods).")
    return result.config, result


def _check_name(method: Any, what: str) -> None:
    if not isinstance(method, str) or method.endswith(".json"):
        raise ValueError(f"{what} sweeps a method's knob, so the method must be a method or preset name (e.g. "
                         f"'magcache'), not {type(method).__name__} {str(method)[:60]!r}.")
