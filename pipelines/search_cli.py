"""`dcache search`: offline plan search (ECAD, LeMiCa, DP, L2C, HarmoniCa) and the DisCa learned forecaster.

    dcache search --method ecad --budget 0.5,0.33 --pop-size 16 --generations 8 --out search-ecad
    dcache search --method lemica --budget 0.5,0.33 --out search-lemica
    dcache search --method ecad --granularity stack --forecast-order 1 --out search-ecad-f1   # forecasting plans
    dcache generate --cache search-lemica/plans/lemica-B14.plan.json
    dcache search --method disca --base-plans search-lemica/plans/lemica-B14.plan.json --out search-disca
    dcache generate --cache search-disca/plans/disca-lemica-B14.plan.json
    dcache search --method lemica --forecast-order 2 --guidance 1.5,3 --scope auto --out search-g   # hold up at both
    dcache search --method keyframe --budget 0.2,0.14 --scope auto --out search-kf   # where to compute, 5x and 7x
    dcache generate --cache search-kf/setups/keyframe-k6.setup.json --steps 50      # any step count

DisCa trains a forecaster for the skipped cells of base plans (default: the DP plans at --budget) on --train-seeds
calibration runs and writes each base plan with FORECAST cells served by it (the predictor rides in the plan file).
Keyframe places --budget computed calls per branch in normalised time and forecasts the rest (uniform starts, then
one keyframe moved at a time while the quality rises; resumable from <out>/keyframe-scores.json) and writes, per
budget, a plan and a setup file (<out>/setups/*.setup.json) that apply at any step count.

Writes `<out>/plans/*.plan.json`, `<out>/front.json` (measured quality and compute ratio of every plan),
`<out>/front.png` and `<out>/summary.md`. Quality objective: PSNR of the cached images against the uncached ones
on the calibration set; for the bundled digit model the classifier's accuracy on the requested labels is reported
beside it. With several `--guidance` scales the calibration set runs at each: ECAD's candidates and every front's
plans are scored by their worst scale, LeMiCa's edge errors, DP's residuals and the routers' training losses pool the
scales, DisCa trains at every scale, and the metrics are given per scale. `--scope auto` replays each stack plan of
the front in block scope and in call scope on the calibration set and keeps the better one in the plan file
(`--scope call`: call scope). This is the wiring layer: the search code (`dcache.schedules.tuning.search`) takes the
calibration as callables.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from .devices import AUTO, DEVICE_HELP, DTYPE_HELP, describe, resolve_device
from .progress import Progress

if TYPE_CHECKING:
    import torch

METHODS = ("ecad", "lemica", "dp", "harmonica", "l2c", "disca", "keyframe")
SCOPE_CHOICES = ("blocks", "call", "auto")  # --scope: as searched, call scope, the better of the two per plan
DEFAULT_CALIB_LABELS = "0,1,2,3,4,5,6,7,8,9"


def quality_psnr(images: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR (dB) to the uncached images; identical images score 100 dB (a finite cap, so fronts stay plottable)."""
    import torch

    from dcache.quality import psnr

    value = psnr(images, reference, dtype=torch.float32)
    return 100.0 if math.isinf(value) else min(value, 100.0)


def tiny_metrics(labels: list[int]):
    """metrics_fn for the digit model: classifier accuracy on the requested labels and agreement with uncached."""
    try:
        from .bundled import load_digit_classifier

        classifier = load_digit_classifier()
    except FileNotFoundError:
        classifier = None
    import torch

    target = torch.tensor(labels)

    def metrics(images: torch.Tensor, reference: torch.Tensor) -> dict:
        out = {"psnr": quality_psnr(images, reference)}
        if classifier is not None:
            with torch.no_grad():
                pred, pred_ref = classifier.predict(images), classifier.predict(reference)
            out["accuracy"] = float((pred.cpu() == target).float().mean())
            out["agreement"] = float((pred == pred_ref).float().mean())
        return out

    return metrics


def parse_guidance(text: str) -> list[float]:
    """--guidance: '' -> [] (the pipeline's default scale); '1.5,3' -> [1.5, 3.0] (a plan searched on both)."""
    try:
        scales = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"--guidance {text!r} must be guidance scales like 3 or 1.5,3.") from None
    if any(not math.isfinite(g) for g in scales):
        raise typer.BadParameter(f"--guidance {text!r} must list finite numbers.")
    if len(set(scales)) != len(scales):
        raise typer.BadParameter(f"--guidance {text!r} lists a scale twice; give each scale once.")
    return scales


def check_same_branches(pipe: Any, is_tiny: bool, prompts: list[str], *, steps: int | None, seed: int,
                        scales: list[float]) -> None:
    """Refuse a guidance sweep whose scales run different branches (e.g. 1 = one call per step, 3 = split CFG's cond
    and uncond calls): a plan's rows are per branch. One all-compute generation of the first prompt per scale."""
    from dcache.schedules.tuning import search

    branches = {g: search.make_template(make_calibration(pipe, is_tiny, prompts[:1], steps=steps, seed=seed,
                                                         guidance=g)).branches for g in scales}
    if len({tuple(b) for b in branches.values()}) > 1:
        seen = ", ".join(f"guidance {g:g}: {b}" for g, b in branches.items())
        raise typer.BadParameter(
            f"--guidance scales run different branches ({seen}); a plan's rows are per branch, so search each "
            f"setting separately (e.g. CFG scales > 1 together, guidance 1 on its own).")


class GuidanceSweep:
    """The calibration set at several guidance scales, one generation per scale: () -> the images of every scale,
    concatenated in the order of `scales` ([S * N, C, H, W]). A plan searched on it has to hold up at each scale."""

    def __init__(self, jobs: list, scales: list[float]):
        self.jobs, self.scales = jobs, scales
        self.sizes: list[int] = []  # images per scale, known after the first call

    def __call__(self) -> torch.Tensor:
        import torch

        parts = [job() for job in self.jobs]
        self.sizes = [len(p) for p in parts]
        return torch.cat(parts)

    def split(self, images: torch.Tensor) -> list[torch.Tensor]:
        """`images` of one call (or the reference) cut back into one tensor per scale."""
        if sum(self.sizes) != len(images):
            raise ValueError(f"{len(images)} images do not match the guidance sweep's {self.sizes} per scale; "
                             f"score only images this sweep generated.")
        return list(images.split(self.sizes))


def worst_scale(sweep: GuidanceSweep, quality):
    """quality_fn of a guidance sweep: the plan's quality at its worst scale (a plan that collapses at one scale
    cannot hide behind a good score at another)."""
    def score(images: torch.Tensor, reference: torch.Tensor) -> float:
        return min(quality(a, b) for a, b in zip(sweep.split(images), sweep.split(reference)))

    return score


def sweep_metrics(sweep: GuidanceSweep, metrics):
    """metrics_fn of a guidance sweep: `metrics` on each scale, keys suffixed '@g<scale>', plus the worst PSNR."""
    def per_scale(images: torch.Tensor, reference: torch.Tensor) -> dict:
        out: dict = {}
        for g, a, b in zip(sweep.scales, sweep.split(images), sweep.split(reference)):
            part = metrics(a, b) if metrics is not None else {"psnr": quality_psnr(a, b)}
            out.update({f"{k}@g{g:g}": v for k, v in part.items()})
        out["psnr_worst_scale"] = min(v for k, v in out.items() if k.startswith("psnr@"))
        return out

    return per_scale


def make_calibration(pipe: Any, is_tiny: bool, prompts: list[str], *, steps: int | None, seed: int,
                     guidance: float | list[float] | None = None):
    """The search's calibration set: the prompts at `seed`, at one guidance scale (None: the pipeline's default) or
    at each of a list of scales (`GuidanceSweep`, scored by the worst scale)."""
    from dcache.schedules.tuning.search import Calibration

    from .runner import GenerationJob

    scales = guidance if isinstance(guidance, list) else [guidance]
    settings = {"prompts": list(prompts), "seed": seed, "steps": steps,
                "guidance": scales if len(scales) > 1 else scales[0],
                "quality": "PSNR (dB, capped at 100) of the cached images against the uncached ones"
                           + (", at the worst guidance scale" if len(scales) > 1 else "")}
    jobs = [GenerationJob(pipe, is_tiny, prompts=list(prompts), steps=steps, guidance=g, seed=seed) for g in scales]
    metrics = tiny_metrics([int(p) for p in prompts]) if is_tiny else None
    if len(jobs) == 1:
        return Calibration(pipe, jobs[0], quality_psnr, metrics, settings=settings)
    sweep = GuidanceSweep(jobs, [float(g) for g in scales])
    return Calibration(pipe, sweep, worst_scale(sweep, quality_psnr), sweep_metrics(sweep, metrics),
                       settings=settings)


L2P_FIT_SEED_OFFSET = 1  # L2P is fitted on the calibration prompts at seed + 1 and scored at seed


def add_fit_runs(calib, pipe: Any, is_tiny: bool, prompts: list[str], *, steps: int | None, seed: int,
                 scales: list[float]) -> None:
    """Give the calibration set runs to fit a forecaster on: its prompts at `seed` (not the scored seed), at each of
    its guidance scales, recorded in its settings (so a search's saved scores from in-sample fits are not reused)."""
    from .runner import GenerationJob

    calib.fit_runs = [GenerationJob(pipe, is_tiny, prompts=list(prompts), steps=steps, guidance=g, seed=seed)
                      for g in (scales or [None])]
    calib.settings["l2p_fit_seed"] = seed


def parse_budget(budget: str, num_steps: int) -> tuple[list[float], tuple[int, ...]]:
    """'0.5,0.33' (compute ratios) or '14,9' (computed steps) -> (ratios, computed-step counts)."""
    try:
        values = [float(v) for v in budget.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"--budget {budget!r} must be compute ratios like 0.5,0.33 or step counts like 14,9.")
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter(f"--budget {budget!r} must list positive numbers.")
    if all(v <= 1 for v in values):
        return values, tuple(max(2, round(v * num_steps)) for v in values)
    return [v / num_steps for v in values], tuple(int(v) for v in values)


REUSE_SEEDS = ("fora", "fixed_interval", "fbcache", "easycache")
# The forecasting dynamic schedules (ECAD's seeds when it searches forecasting plans): MagCache's budget with the
# skipped steps forecast, SeaCache order 2, TaylorSeer. Each seed's settings (swept so that the seeds span the
# ratios) are declared by its method (`MethodConfig.search_seeds`, read through dcache.methods.search_seeds).
FORECAST_SEEDS = ("magcache-forecast", "seacache-o2", "taylorseer")


def dynamic_seed_plans(pipe: Any, calib, names=REUSE_SEEDS) -> dict:
    """Recorded plans of dynamic methods on the calibration set (ECAD's seeds). A method that cannot run on this
    model (no calibration, unsupported unit kind, ...) is skipped with a SeedPlanSkipped warning naming it and why."""
    import warnings

    import torch

    import dcache
    from dcache.methods import search_seeds

    declared = search_seeds()  # seed name -> (method, settings); another name: that method or preset as it is
    plans = {}
    for seed_name in names:
        name, sweep = declared.get(seed_name, (seed_name, ({},)))
        for overrides in sweep:
            key = seed_name + "".join(f"-{k}{v}" for k, v in overrides.items())
            try:
                handle = dcache.apply(pipe, name, count_flops=False, **overrides)
            except (ValueError, TypeError, RuntimeError) as exc:
                warnings.warn(f"dcache search: seed plan {key} skipped: {name} cannot be applied to this model "
                              f"({type(exc).__name__}: {exc}).", SeedPlanSkipped, stacklevel=2)
                continue
            try:
                with torch.no_grad():
                    calib.generate()
                plans[key] = handle.plan()
            except (ValueError, RuntimeError) as exc:
                warnings.warn(f"dcache search: seed plan {key} skipped: its calibration run failed "
                              f"({type(exc).__name__}: {exc}).", SeedPlanSkipped, stacklevel=2)
            finally:
                handle.remove()
    return plans


class SeedPlanSkipped(UserWarning):
    """A dynamic method's plan could not be recorded as a seed of the plan search (the message says why)."""


def search_command(
    method: str = typer.Option(..., help=f"one of {', '.join(METHODS)}"),
    model: Optional[str] = typer.Option(None, help="hub id or local pipeline folder; default: the bundled tiny model"),
    budget: str = typer.Option("0.5,0.33",
                               help="target compute ratios (<= 1) or computed steps (> 1), comma-separated"),
    out: str = typer.Option("dcache-search", help="output folder: plans/, front.json, front.png, summary.md"),
    steps: int = typer.Option(28, help="denoising steps the plans are made for"),
    prompts: str = typer.Option(DEFAULT_CALIB_LABELS,
                                help="calibration prompts (tiny model: class labels), comma-separated"),
    seed: int = typer.Option(0, help="calibration seed (noise) and search seed"),
    guidance: str = typer.Option("", help="guidance scale(s) of the calibration set, comma-separated (default: the "
                                          "pipeline's); several, e.g. 1.5,3: every candidate runs at each and is "
                                          "scored by its worst scale, so the plans hold up across guidance"),
    scope: str = typer.Option("blocks", help="scope the plans replay in: blocks (as searched), call (the whole "
                                             "call forecast; stack plans) or auto (each stack plan replayed in both "
                                             "on the calibration set, the better kept)"),
    pop_size: int = typer.Option(16, help="ECAD population size"),
    generations: int = typer.Option(8, help="ECAD generations"),
    resume: bool = typer.Option(False, help="ECAD / routers / DisCa: continue from the checkpoint in <out> "
                                            "(LeMiCa and keyframe always reuse what <out> holds for the same "
                                            "calibration)"),
    max_span: int = typer.Option(8, help="LeMiCa: longest cached segment + 1"),
    forecast_order: int = typer.Option(0, help="LeMiCa / ECAD: 0 reuses the skipped cells; k >= 1 forecasts them "
                                               "with Taylor of order k (edges / candidates measured that way too; "
                                               "ECAD then also seeds with the forecasting dynamic schedules)"),
    granularity: str = typer.Option("module", help="ECAD: the genome's unit, module (ECAD), block or stack (one bit "
                                                   "per step)"),
    iterations: Optional[int] = typer.Option(None, help="L2C / HarmoniCa: router training iterations (default 60); "
                                                     "DisCa: residual-regression iterations (config default)"),
    online_iterations: Optional[int] = typer.Option(None, help="DisCa: closed-loop iterations, one calibration "
                                                            "generation each (config default)"),
    base_plans: str = typer.Option("", help="DisCa: comma-separated base plan files whose skipped cells it learns to "
                                            "forecast (default: the DP plans at --budget)"),
    train_seeds: int = typer.Option(2, help="DisCa: calibration runs (seeds seed, seed+1, ...) it trains on"),
    forecaster: str = typer.Option("taylor", help="keyframe: what serves between keyframes, taylor (the Taylor "
                                                  "series) or l2p (keyframes searched again with L2P fitted on the "
                                                  "calibration set for each candidate, its ridge chosen there; kept "
                                                  "where it scores better than Taylor; about 6x the generations)"),
    l2p_ridges: str = typer.Option("", help="keyframe with --forecaster l2p: the ridge strengths scored for every "
                                            "candidate placement, comma-separated, each >= 0 (default "
                                            "10,1,0.1,0.01,0.001,0; fewer ridges, a faster search)"),
    uneven_cfg: bool = typer.Option(False, help="keyframe with split CFG: also search k conditional + k - 1 "
                                                "unconditional calls per budget, the unconditional calls left out "
                                                "served through the CFG difference (cfg_difference, call scope): "
                                                "(2k - 1) / 2N of the calls; plans keyframe-k<k>u<k - 1>"),
    device: str = typer.Option(AUTO, help=DEVICE_HELP),
    dtype: str = typer.Option(AUTO, help=DTYPE_HELP),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: 1 for the bundled model on the CPU, "
                                                     "as dcache generate; else torch's)"),
    progress: bool = typer.Option(True, help="progress bars with ETA (ECAD: the best quality at ratio 0.5 so "
                                             "far); --no-progress: one line per stage (ECAD: per generation)"),
) -> None:
    """Search cache plans on a calibration set and write the Pareto front (plans, JSON, plot, summary)."""
    from .runner import load_pipeline, removed_if_left_empty, use_threads

    if method not in METHODS:
        raise typer.BadParameter(f"--method {method!r} is not one of {', '.join(METHODS)}.")
    try:
        device, dtype = resolve_device(device, dtype)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    scales = parse_guidance(guidance)
    if scope not in SCOPE_CHOICES:
        raise typer.BadParameter(f"--scope {scope!r} must be one of {', '.join(SCOPE_CHOICES)}.")
    check_search_arguments(method, model=model, steps=steps, budget=budget, threads=threads, pop_size=pop_size,
                           generations=generations, granularity=granularity, forecast_order=forecast_order,
                           max_span=max_span, base_plans=base_plans, train_seeds=train_seeds, seed=seed,
                           forecaster=forecaster, l2p_ridges=l2p_ridges, uneven_cfg=uneven_cfg, scope=scope)
    stages = Progress(enabled=progress)
    stages.stage(f"loading {model or 'the bundled tiny model'}")
    pipe, is_tiny = load_pipeline(model, device=device, dtype=dtype)
    use_threads(threads, is_tiny=is_tiny, device=device)  # before describing the device: its thread count
    at = f", guidance {', '.join(f'{g:g}' for g in scales)}" if scales else ""
    stages.stage(f"{method} search on {describe(device, dtype)}, on the calibration prompts (seed {seed}{at}), "
                 f"writing to {out}/")
    try:
        with removed_if_left_empty(out):
            front = run_search(method, pipe, is_tiny, budget=budget, out=out, steps=steps, prompts=prompts,
                               seed=seed, guidance=scales, scope=scope, pop_size=pop_size, generations=generations,
                               resume=resume, max_span=max_span, iterations=iterations, progress=progress,
                               base_plans=base_plans, train_seeds=train_seeds, online_iterations=online_iterations,
                               forecast_order=forecast_order, granularity=granularity, forecaster=forecaster,
                               l2p_ridges=parse_ridges(l2p_ridges), uneven_cfg=uneven_cfg,
                               on_generation=None if progress else _generation_line(generations))
    except (ValueError, FileNotFoundError) as exc:
        # a damaged or foreign checkpoint (StateFileError), a resume with other settings, an --out that leads
        # elsewhere: one line naming the file and the fix, as `dcache eval` prints them
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {out}/front.json, {out}/front.png, {out}/summary.md and {len(front.get('points', []))} plans:")
    for p in front.get("points", []):
        typer.echo(f"  {p['plan']}  compute ratio {p['compute_ratio']:.3f}  quality {p['quality']:.3f}")
    typer.echo(f"use one with: dcache generate --cache {Path(out) / 'plans' / '<plan>.plan.json'} --steps {steps}")
    if method == "keyframe":
        typer.echo(f"or, at any step count: dcache generate --cache {Path(out) / 'setups' / '<plan>.setup.json'}")


def check_search_arguments(method: str, *, model: str | None, steps: int, budget: str, threads: int | None,
                           pop_size: int, generations: int, granularity: str, forecast_order: int, max_span: int,
                           base_plans: str, train_seeds: int, seed: int, forecaster: str,
                           l2p_ridges: str = "", uneven_cfg: bool = False, scope: str = "call") -> None:
    """Everything `dcache search` can check before the model loads (typer.BadParameter naming the option)."""
    from dcache.plans.plan import Plan
    from dcache.schedules.tuning import search

    from .arguments import check_steps
    from .runner import check_model, check_threads

    try:
        check_model(model)
        check_steps(steps)
        check_threads(threads)
        if steps < 2:
            raise ValueError(f"--steps {steps}: a plan search needs at least 2 steps (one computed, one to skip).")
        ratios, counts = parse_budget(budget, steps)
        if method == "ecad":
            search.ECADConfig(pop_size=pop_size, generations=generations, seed=seed, granularity=granularity,
                              forecast_order=forecast_order)
        if method == "lemica":
            search.LeMiCaConfig(budgets=counts, max_span=max_span, forecast_order=forecast_order)
        if method == "keyframe":
            search.KeyframeSearchConfig(budgets=counts, forecaster=forecaster, uneven_cfg=uneven_cfg, scope=scope,
                                        **_ridges(parse_ridges(l2p_ridges)))
        elif uneven_cfg:
            raise ValueError("--uneven-cfg applies to --method keyframe only.")
        elif forecaster != "taylor":
            raise ValueError(f"--forecaster {forecaster} applies to --method keyframe only.")
        if l2p_ridges.strip() and (method != "keyframe" or forecaster != "l2p"):
            raise ValueError(f"--l2p-ridges {l2p_ridges} applies to --method keyframe --forecaster l2p only.")
        if method == "disca" and train_seeds < 1:
            raise ValueError(f"--train-seeds {train_seeds} must be >= 1.")
        for name in [p.strip() for p in base_plans.split(",") if p.strip()] if method == "disca" else []:
            Plan.load(name)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None


def parse_ridges(text: str) -> tuple[float, ...] | None:
    """--l2p-ridges "10,0" -> (10.0, 0.0); "" -> None (the search's default ridges)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        return None
    try:
        return tuple(float(t) for t in items)
    except ValueError:
        raise ValueError(f"--l2p-ridges {text}: give comma-separated numbers >= 0, e.g. --l2p-ridges 10,1,0.") \
            from None


def _ridges(ridges: tuple[float, ...] | None) -> dict:
    """KeyframeSearchConfig's l2p_ridges knob, left at its default when none were given."""
    return {} if ridges is None else {"l2p_ridges": ridges}


def _generation_line(generations: int):
    """ECAD's on_generation for --no-progress: one line per generation with the best quality so far."""
    def on_generation(generation: int, info: dict) -> None:
        best = info.get("best_quality_at_0.5")
        typer.echo(f"[dcache] ecad generation {generation}/{generations}: best quality at compute ratio 0.5 so far "
                   f"{'-' if best is None else format(best, '.2f')}", err=True)

    return on_generation


def run_search(method: str, pipe: Any, is_tiny: bool, *, budget: str = "0.5,0.33", out: str = "dcache-search",
               steps: int = 28, prompts: str = DEFAULT_CALIB_LABELS, seed: int = 0, pop_size: int = 16,
               generations: int = 8, resume: bool = False, max_span: int = 8, iterations: int | None = None,
               progress: bool = True, seed_methods: tuple[str, ...] = REUSE_SEEDS,
               on_generation=None, base_plans: str = "", train_seeds: int = 2,
               online_iterations: int | None = None, forecast_order: int = 0, granularity: str = "module",
               guidance: list[float] | None = None, scope: str = "blocks", forecaster: str = "taylor",
               l2p_ridges: tuple[float, ...] | None = None, uneven_cfg: bool = False) -> dict:
    """The search behind `dcache search`, on an already loaded pipeline; returns the front (as in front.json).
    `guidance`: the calibration set's scales (None / []: the pipeline's default; several: scored by the worst).
    `scope`: "blocks" keeps the plans as searched; "call" / "auto" rescore the front's stack plans in call scope / in
    both scopes and keep the better (`search.choose_scope`)."""
    from dcache.schedules.tuning import search

    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}.")
    if scope not in SCOPE_CHOICES:
        raise ValueError(f"scope {scope!r} must be one of {', '.join(SCOPE_CHOICES)}.")
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    prompt_list = [p.strip() for p in prompts.split(",") if p.strip()]
    scales = list(guidance or [])
    if len(scales) > 1:
        check_same_branches(pipe, is_tiny, prompt_list, steps=steps, seed=seed, scales=scales)
    calib = make_calibration(pipe, is_tiny, prompt_list, steps=steps, seed=seed, guidance=scales or None)
    if method == "keyframe" and forecaster == "l2p":
        add_fit_runs(calib, pipe, is_tiny, prompt_list, steps=steps, seed=seed + L2P_FIT_SEED_OFFSET, scales=scales)
    from dcache.schedules.tuning.search.core import is_main_process

    with Progress(enabled=progress and is_main_process()).bar(total=None, desc=f"{method} search",
                                                             unit=" generations") as bar:
        calib.generate = CountedGenerations(calib.generate, bar)
        calib.fit_runs = [CountedGenerations(run, bar) for run in calib.fit_runs]
        return _search_front(method, pipe, is_tiny, calib, search, budget=budget, out=out, steps=steps,
                             prompt_list=prompt_list, seed=seed, scales=scales, pop_size=pop_size,
                             generations=generations, resume=resume, max_span=max_span, iterations=iterations,
                             progress=progress, seed_methods=seed_methods, on_generation=on_generation,
                             base_plans=base_plans, train_seeds=train_seeds, online_iterations=online_iterations,
                             forecast_order=forecast_order, granularity=granularity, scope=scope,
                             forecaster=forecaster, l2p_ridges=l2p_ridges, uneven_cfg=uneven_cfg)


class CountedGenerations:
    """A calibration set's generate() that steps a bar at every generation. Every search method spends its time in
    calibration generations (the template, the reference, edges, candidates, seeds), so the bar shows a search
    working from its first generation, whatever phase it is in; the methods' own bars (ECAD generations, LeMiCa
    edges) count their own units below it."""

    def __init__(self, generate, bar):
        self.generate, self.bar = generate, bar

    def __call__(self):
        images = self.generate()
        self.bar.step()
        return images

    def __getattr__(self, name: str):  # a GuidanceSweep's split / scales / sizes
        return getattr(self.generate, name)


def _search_front(method: str, pipe: Any, is_tiny: bool, calib, search, *, budget: str, out: str, steps: int,
                  prompt_list: list[str], seed: int, scales: list[float], pop_size: int, generations: int,
                  resume: bool, max_span: int, iterations: int | None, progress: bool, seed_methods: tuple[str, ...],
                  on_generation, base_plans: str, train_seeds: int, online_iterations: int | None,
                  forecast_order: int, granularity: str, scope: str, forecaster: str,
                  l2p_ridges: tuple[float, ...] | None, uneven_cfg: bool = False) -> dict:
    template = search.make_template(calib)
    front = _run_method(method, pipe, is_tiny, calib, template, budget=budget, out=out, steps=steps,
                        prompts=prompt_list, seed=seed, scales=scales, pop_size=pop_size, generations=generations,
                        resume=resume, max_span=max_span, iterations=iterations, progress=progress,
                        seed_methods=seed_methods, on_generation=on_generation, base_plans=base_plans,
                        train_seeds=train_seeds, online_iterations=online_iterations,
                        forecast_order=forecast_order, granularity=granularity, scope=scope,
                        forecaster=forecaster, l2p_ridges=l2p_ridges, uneven_cfg=uneven_cfg)
    if scope == "blocks" or method == "keyframe":  # the keyframe search chooses its scope itself
        return front
    from dcache.schedules.tuning.search.scope_choice import SCOPES

    return search.choose_scope(calib, template, out, ("call",) if scope == "call" else SCOPES)


def _run_method(method: str, pipe: Any, is_tiny: bool, calib, template, *, budget: str, out: str, steps: int,
                prompts: list[str], seed: int, scales: list[float], pop_size: int, generations: int, resume: bool,
                max_span: int, iterations: int | None, progress: bool, seed_methods: tuple[str, ...],
                on_generation, base_plans: str, train_seeds: int, online_iterations: int | None,
                forecast_order: int, granularity: str, scope: str = "blocks", forecaster: str,
                l2p_ridges: tuple[float, ...] | None = None, uneven_cfg: bool = False) -> dict:
    """One search method on the calibration set; writes and returns its front."""
    from dcache.schedules.tuning import search

    ratios, counts = parse_budget(budget, template.num_steps)
    if method == "ecad":
        try:
            cfg = search.ECADConfig(pop_size=pop_size, generations=generations, seed=seed, granularity=granularity,
                                    forecast_order=forecast_order)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        seeds = dynamic_seed_plans(pipe, calib, (FORECAST_SEEDS if forecast_order else ()) + tuple(seed_methods))
        return search.ecad_search(calib, out, cfg, seed_plans=seeds, resume=resume, template=template,
                                  progress=progress, on_generation=on_generation)
    if method == "lemica":
        cfg = search.LeMiCaConfig(budgets=counts, max_span=max_span, forecast_order=forecast_order)
        return search.lemica_search(calib, out, cfg, template=template, progress=progress)
    if method == "keyframe":
        cfg = search.KeyframeSearchConfig(budgets=counts, scope=scope, forecaster=forecaster, uneven_cfg=uneven_cfg,
                                          **_ridges(l2p_ridges))
        return search.keyframe_search(calib, out, cfg, template=template, progress=progress)
    if method == "dp":
        return search.dp_search(calib, out, search.DPConfig(budgets=counts), template=template, progress=progress)
    if method == "disca":
        return _run_disca(pipe, is_tiny, calib, template, out=out, steps=steps, prompts=prompts, seed=seed,
                          scales=scales, counts=counts, base_plans=base_plans, train_seeds=train_seeds,
                          iterations=iterations, online_iterations=online_iterations, resume=resume,
                          progress=progress)
    from dcache.schedules.tuning.search import router

    cfg = router.RouterConfig(objective=method, iterations=60 if iterations is None else iterations, seed=seed,
                              target_ratios=tuple(ratios))
    return router.router_search(calib, out, cfg, resume=resume, template=template, progress=progress)


def _run_disca(pipe: Any, is_tiny: bool, calib, template, *, out: str, steps: int, prompts: list[str], seed: int,
               scales: list[float], counts: tuple[int, ...], base_plans: str, train_seeds: int, iterations: int | None,
               online_iterations: int | None, resume: bool, progress: bool) -> dict:
    from dcache.plans.plan import Plan
    from dcache.schedules.tuning import search
    from dcache.schedules.tuning.search import disca

    from .runner import GenerationJob

    if train_seeds < 1:
        raise typer.BadParameter(f"--train-seeds {train_seeds} must be >= 1.")
    files = [p.strip() for p in base_plans.split(",") if p.strip()]
    if files:
        bases = {Path(f).name.removesuffix(".json").removesuffix(".plan"): Plan.load(f) for f in files}
    else:
        front = search.dp_search(calib, Path(out) / "base-dp", search.DPConfig(budgets=counts), template=template,
                                 progress=progress)
        bases = {Path(p["plan"]).name.removesuffix(".plan.json"): Plan.load(Path(out) / "base-dp" / p["plan"])
                 for p in front["points"]}
    runs = [GenerationJob(pipe, is_tiny, prompts=list(prompts), steps=steps, seed=seed + k, guidance=g)
            for k in range(train_seeds) for g in (scales or [None])]  # every training seed at every scale
    overrides = {k: v for k, v in (("iterations", iterations), ("online_iterations", online_iterations))
                 if v is not None}
    cfg = disca.DisCaConfig(seed=seed, **overrides)
    return disca.disca_search(calib, out, bases, cfg, template=template, runs=runs, resume=resume, progress=progress)
