"""`dcache generate`: run a pipeline uncached and cached on the same seeds; grid, stats and the speed-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any



import dcache
from dcache.methods import DEFAULT_METHOD
from dcache.memory.report import format_bytes
from dcache.files.atomic import atomic_write_text, prepare_out_dir

from .devices import describe, resolve_device
from .images import DIFF_VMAX, heat, save_grid, save_video
from .progress import Progress
from dcache.quality import median, psnr

from .arguments import check_method, check_steps
from .runner import (ABTiming, GenerationJob, check_model, check_threads, interleaved_runs, load_pipeline,
                     use_threads)
from .timing_checks import spread, timing_warnings

TINY_DEFAULT_LABELS = [str(i) for i in range(10)]


@dataclass
class GenerateResult:
    out_dir: Path
    summary: dict[str, Any]


def generate(*, model: str | None = None, prompts: list[str] | None = None, cache: str = DEFAULT_METHOD,
             steps: int | None = None, seed: int = 0, guidance: float | None = None, out: str = "dcache-out",
             repeats: int = 3, device: str = "auto", dtype: str = "auto", height: int | None = None,
             width: int | None = None, overrides: dict[str, Any] | None = None,
             threads: int | None = None, pipeline_kwargs: dict[str, Any] | None = None,
             scope: str | None = None, speed: str | None = None, quality: str | None = None,
             controlnet: Any = None, progress: Progress | None = None) -> GenerateResult:
    """device / dtype "auto": CUDA (bfloat16), else MPS, else the CPU (float32), see `devices.resolve_device`.
    controlnet: dcache.apply's (cache the pipeline's ControlNet too: "follow", a method, {"method": ..., knobs}).
    progress: bars or one line per stage (default: silent)."""
    if repeats < 0:
        raise ValueError(f"--repeats {repeats} must be >= 0 (0: no timing, one uncached and one cached run).")
    check_threads(threads)
    check_model(model)  # everything that can be checked is checked before the model loads
    check_steps(steps)
    if scope not in (None, "blocks", "call"):
        raise ValueError(f"--scope {scope!r} must be 'blocks' (cache the block stack) or 'call' (the whole call).")
    if speed is not None or quality is not None:
        from dcache.schedules.tuning.targets import check_target

        check_target(speed, quality)
    check_method(cache, dict(overrides or {}), model=model)
    prepare_out_dir(out)  # a file or a read-only folder fails before the model loads
    progress = progress or Progress(enabled=False, quiet=True)
    device, dtype = resolve_device(device, dtype)
    progress.stage(f"loading {model or 'the bundled tiny model'} on {device} ({dtype})")
    pipe, is_tiny = load_pipeline(model, device=device, dtype=dtype)
    use_threads(threads, is_tiny=is_tiny, device=device)
    if is_tiny:  # labels: "3", "seven", or several in one prompt: "0,1,2"
        prompts = [p.strip() for text in prompts for p in text.split(",")] if prompts else TINY_DEFAULT_LABELS
        bad = [p for p in prompts if not _names_a_digit(p)]
        if bad:
            raise ValueError(f"the bundled digit model takes class labels 0-9 (or digit words: 'seven') as --prompt, "
                             f"got {bad}; e.g. --prompt 3 or --prompt 0,1,2.")
    elif not prompts:
        raise ValueError("--prompt is required for this model (e.g. --prompt 'a photo of a cat').")
    job = GenerationJob(pipe, is_tiny, prompts=list(prompts), steps=steps, guidance=guidance, seed=seed,
                        height=height, width=width, extra=dict(pipeline_kwargs or {}))

    method: Any = cache
    target = None
    # a target, or --set cfg_difference=true (kept only if it brings the calibration run closer to its uncached
    # twin: dcache.schedules.tuning.targets.choose_cfg_difference), is resolved on the same prompts, next seed
    difference = dict(overrides or {}).get("cfg_difference") is True
    if speed is not None or quality is not None or difference:
        from dcache.methods import preset_scope
        from dcache.schedules.tuning.targets import resolve_for_apply

        scope = preset_scope(cache) if scope is None else scope  # the chosen config no longer names its preset
        calibration = GenerationJob(pipe, is_tiny, prompts=list(prompts), steps=steps, guidance=guidance,
                                    seed=seed + 1, height=height, width=width, extra=dict(pipeline_kwargs or {}))
        what = speed or quality or "whether to serve cfg_difference"
        progress.stage(f"finding the {cache} setting for {what} on a calibration run (seed {seed + 1})")
        method, target = resolve_for_apply(pipe, cache, speed=speed, quality=quality, calibration_run=calibration,
                                           num_steps=None, scope=scope, overrides=dict(overrides or {}),
                                           progress=progress.runs(f"{cache} sweep"))
        overrides = {}
    progress.stage(f"timing uncached vs cached: one warm-up each, then {repeats} alternating round(s)" if repeats
                   else "one uncached and one cached run (--repeats 0: not timed)")
    if hasattr(pipe, "set_progress_bar_config"):  # steps of the big models; the tiny model's calls take ~0.3 s
        pipe.set_progress_bar_config(disable=is_tiny or not progress.enabled, leave=False)
    with progress.bar(total=2 + 2 * repeats, desc="generate", unit="run") as bar:
        handles: list = []  # the last cached run's handle reports its cache memory after removal

        def enable():
            handles.append(dcache.apply(pipe, method, scope=scope, controlnet=controlnet, **(overrides or {})))
            return handles[-1]

        timing = interleaved_runs(job, enable, repeats, on_run=bar.step)
    reference, cached = timing.reference, timing.cached
    stats, plans = timing.stats, timing.plans
    plan = plans["transformer"]
    batch_size = int(reference.shape[0]) // max(job.frames_per_sample, 1)  # images (videos) per pipeline call

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": model or "tiny (bundled)",
        "device": device,
        "dtype": dtype,
        "device_description": describe(device, dtype),
        "cache": cache,
        "controlnet": controlnet,
        "target": None if target is None else {
            "speed": speed, "quality": quality, "calibration_seed": seed + 1, "knob": target.knob,
            "value": target.value, "sweep": target.sweep},
        "scope": plan.extras.get("scope", "blocks"),
        "prompts": list(prompts),
        "seed": seed,
        "steps": stats.num_steps,
        "calls": stats.calls,
        "calls_fully_computed": stats.calls_fully_computed,
        "units_computed": stats.units_computed,
        "units_reused": stats.units_reused,
        "units_forecast": stats.units_forecast,
        "blocks_per_call": stats.blocks_per_call,
        "compute_ratio": stats.compute_ratio,
        "ideal_speedup": stats.ideal_speedup,
        "batch_size": batch_size,
        **_timing_fields(timing, stats.ideal_speedup),
        "psnr_db": psnr(reference, cached),
        "max_abs_error": float((reference - cached).abs().max()),
        "repeats": repeats,
        "cache_bytes": stats.cache_bytes,
        "memory": handles[-1].memory().to_dict(),  # dcache.memory.report.MemoryReport: peak, by kind and branch
        "stats": stats.to_dict(),
    }
    if job.frames_per_sample:
        save_video(reference, out_dir / "uncached.gif")
        save_video(cached, out_dir / "cached.gif")
        summary["videos"] = ["uncached.gif", "cached.gif"]
    else:
        save_grid([reference, cached, heat(reference - cached)], out_dir / "grid.png",
                  row_labels=["uncached", f"{cache}", "|difference|"], scale=4 if is_tiny else 1,
                  colorbar=DIFF_VMAX)
        summary["grid"] = "grid.png"
    progress.stage(f"writing {out_dir}/")
    plan_files = [("plan.json" if name == "transformer" else f"plan.{name}.json") for name in plans]
    summary["files"] = [*summary.get("videos", []), *([summary["grid"]] if "grid" in summary else []), "stats.json",
                        *plan_files]
    for file, expert_plan in zip(plan_files, plans.values()):  # plan.json; plan.transformer_2.json: a second expert
        expert_plan.save(out_dir / file)
    atomic_write_text(out_dir / "stats.json", json.dumps(_finite(summary), indent=1))
    return GenerateResult(out_dir, summary)


def _timing_fields(timing: ABTiming, ideal_speedup: float) -> dict[str, Any]:
    """stats.json's timing fields: medians of the timed runs (one pipeline call of the whole batch), their spreads,
    the speed-ups and their warnings; null where nothing was timed (--repeats 0)."""
    t_ref, t_cached = timing.seconds_uncached, timing.seconds_cached
    if not t_ref:
        return {**dict.fromkeys(("uncached_seconds", "cached_seconds", "uncached_seconds_spread",
                                 "cached_seconds_spread", "measured_speedup", "uncached_cpu_seconds",
                                 "cached_cpu_seconds", "cpu_speedup", "measured_over_ideal")),
                "timing_warnings": []}
    ref_s, cached_s = median(t_ref), median(t_cached)
    cpu_ref, cpu_cached = median(timing.cpu_uncached), median(timing.cpu_cached)
    measured = ref_s / cached_s if cached_s > 0 else float("nan")
    return {
        "uncached_seconds": ref_s,  # median wall-clock seconds of one pipeline call of the whole batch
        "cached_seconds": cached_s,
        "uncached_seconds_spread": spread(t_ref),
        "cached_seconds_spread": spread(t_cached),
        "measured_speedup": measured,
        "uncached_cpu_seconds": cpu_ref,  # median process CPU seconds (all threads) of the same calls
        "cached_cpu_seconds": cpu_cached,
        "cpu_speedup": cpu_ref / cpu_cached if cpu_cached > 0 else float("nan"),
        "measured_over_ideal": measured / ideal_speedup,
        "timing_warnings": timing_warnings({"uncached": t_ref, "cached": t_cached}),
    }


def _names_a_digit(prompt: str) -> bool:
    from .tiny_pipeline import parse_digit_prompt

    try:
        parse_digit_prompt(prompt)
    except ValueError:
        return False
    return True


def _finite(obj: Any) -> Any:
    """JSON has no inf/nan: write them as strings."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _seconds(spread_: dict[str, float]) -> str:
    """'0.310 s [0.300-0.420]': median [min-max] of the repeats."""
    return f"{spread_['median']:.3f} s [{spread_['min']:.3f}-{spread_['max']:.3f}]"


def _calls_noun(s: dict[str, Any]) -> str:
    """'transformer calls', or 'model calls' when the counts also hold another cached model's (a ControlNet's)."""
    experts = (s.get("stats") or {}).get("experts", {})
    return "model calls" if any(not name.startswith("transformer") for name in experts) else "transformer calls"


def format_summary(s: dict[str, Any]) -> str:
    images = f"{s['batch_size']} image{'s' if s['batch_size'] != 1 else ''}"
    lines = [
        f"model        {s['model']}   cache: {s['cache']} ({s['scope']} scope)   seed {s['seed']}",
        f"device       {s['device_description']}",
        f"steps        {s['calls_fully_computed']}/{s['calls']} {_calls_noun(s)} fully computed "
        f"({s['steps']} steps), units computed {s['units_computed']}, reused {s['units_reused']}, "
        f"forecast {s['units_forecast']} ({s['blocks_per_call']} blocks per call)",
        f"speed-up     ideal {s['ideal_speedup']:.2f}x (compute ratio {s['compute_ratio']:.3f}), " + (
            f"measured {s['measured_speedup']:.2f}x wall-clock, {s['cpu_speedup']:.2f}x process CPU time; "
            f"measured/ideal {s['measured_over_ideal']:.2f}" if s["repeats"] else
            "not measured (--repeats 0: one uncached and one cached run, untimed)"),
        *([f"timing       one call of the batch of {images}, median [min-max] of {s['repeats']} repeat(s): "
           f"uncached {_seconds(s['uncached_seconds_spread'])}, cached {_seconds(s['cached_seconds_spread'])}"]
          if s["repeats"] else []),
        f"quality      PSNR cached vs uncached {s['psnr_db']:.2f} dB, max |error| {s['max_abs_error']:.4f}",
    ]
    # each cached model: Wan 2.2's transformer + transformer_2, a ControlNet (controlnet, controlnet.nets.<i>)
    for name, e in (s.get("stats") or {}).get("experts", {}).items():
        lines.append(f"  {name}: {e['calls_fully_computed']}/{e['calls']} calls fully computed, units computed "
                     f"{e['units_computed']}, reused {e['units_reused']}, forecast {e['units_forecast']}, compute "
                     f"ratio {e['compute_ratio']:.3f}")
    if s.get("memory"):
        m = s["memory"]
        kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in m["by_kind"].items()) or "nothing cached"
        branches = ", ".join(f"{b} {format_bytes(sum(k.values()))}" for b, k in m["by_branch"].items())
        lines.append(f"cache memory peak {format_bytes(m['peak_bytes'])} ({kinds}; per branch {branches})")
    lines += [f"warning      {w}" for w in s.get("timing_warnings", [])]
    t = s.get("target")
    if t:
        if t["speed"] is not None:
            goal = f"speed {t['speed']}"
        elif t["quality"] is not None:
            goal = f"quality {t['quality']}"
        else:  # --set cfg_difference=true: with or without, the one closer to the uncached run
            goal = "the closer to uncached"
        lines.append(f"target       {goal}: {t['knob']}={t['value']} chosen from {len(t['sweep'])} settings on the "
                     f"calibration run (seed {t['calibration_seed']}; sweep in stats.json)")
    return "\n".join(lines)


__all__ = ["generate", "format_summary", "GenerateResult"]
