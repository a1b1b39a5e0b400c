"""The `dcache` command line: generate, methods, support (and the commands other packages add)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from dcache.methods import DEFAULT_METHOD
from dcache.optional_deps import explain_missing
from .devices import AUTO, DEVICE_HELP, DTYPE_HELP, describe, resolve_device
from .progress import Progress
from .search_cli import search_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="dcache: feature caching for diffusion transformers in diffusers pipelines.")


def _print_versions(asked: bool) -> None:
    """--version: dcache's version and those of what it runs on (what a bug report needs), read from the installed
    packages' metadata: nothing is imported, so it answers in a fraction of a second."""
    if not asked:
        return
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    typer.echo(f"dcache {of('dcache')} (torch {of('torch')}, diffusers {of('diffusers')}, "
               f"python {platform.python_version()})")
    raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_versions, is_eager=True,
                                          help="print the versions of dcache, torch, diffusers and python, and exit")
             ) -> None:
    pass  # the options of `dcache` itself (the help text is the Typer app's)


def _parse_overrides(pairs: list[str]) -> dict:
    from .runner import parse_overrides

    try:
        return parse_overrides(pairs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _call_arguments(pairs: list[str]) -> dict:
    from .runner import check_call_images, parse_overrides

    try:
        return check_call_images(parse_overrides(pairs, flag="--call", example="num_frames=17"))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _controlnet_setting(value: Optional[str]) -> object:
    """--controlnet: 'follow', a method name, or a JSON object ({"method": ..., knobs}); checked by dcache.apply."""
    if value is None or not value.lstrip().startswith("{"):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--controlnet {value!r} is not a JSON object ({exc.msg}); e.g. --controlnet "
                                 f"'{{\"method\": \"fixed_interval\", \"interval\": 3}}' or --controlnet follow.")


def _fail(exc: Exception) -> None:
    # an error that also has a command-line wording (e.g. the `dcache calibrate` command instead of Python) uses it
    typer.secho(f"error: {getattr(exc, 'cli_message', None) or exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def generate(
    model: Optional[str] = typer.Option(None, help="hub id or local pipeline folder; default: the bundled tiny model"),
    prompt: Optional[str] = typer.Option(None, help="prompt; for the tiny model, class labels like '3' or '0,1,2'"),
    cache: str = typer.Option(DEFAULT_METHOD, help="method name, preset, or plan/config JSON file (default: dcache's "
                                                   "default method)"),
    scope: Optional[str] = typer.Option(None, help="'blocks' (default) caches the block stack; 'call' the whole "
                                                  "transformer call x -> v (skips embedders and head too; for "
                                                  "methods that decide before the call, e.g. magcache, seacache, "
                                                  "easycache); a plan replays in the scope it was recorded in"),
    speed: Optional[str] = typer.Option(None, help="target instead of a threshold: e.g. 2x = the least lossy setting "
                                                  "of --cache's main knob with ideal speed-up >= 2, found on a "
                                                  "calibration run (same prompts, seed + 1)"),
    quality: Optional[str] = typer.Option(None, help="target instead of a threshold: e.g. 'psnr>=30' = the fastest "
                                                    "setting keeping 30 dB on the calibration run"),
    steps: Optional[int] = typer.Option(None, help="number of inference steps (pipeline default if unset)"),
    seed: int = typer.Option(0, help="random seed (same for the uncached and cached runs)"),
    guidance: Optional[float] = typer.Option(None, help="guidance scale (pipeline default if unset)"),
    out: str = typer.Option("dcache-out", help="output folder for grid.png / videos, stats.json, plan.json"),
    repeats: int = typer.Option(3, help="timed repeats per variant (after one warm-up); 0: no timing, just one "
                                         "uncached and one cached run"),
    device: str = typer.Option(AUTO, help=DEVICE_HELP),
    dtype: str = typer.Option(AUTO, help=DTYPE_HELP),
    height: Optional[int] = typer.Option(None), width: Optional[int] = typer.Option(None),
    set_: list[str] = typer.Option([], "--set", help="method config override key=value (repeatable)"),
    call: list[str] = typer.Option([], "--call", help="more pipeline call arguments key=value (repeatable; JSON "
                                                       "values; @FILE opens an image), e.g. --call num_frames=17 for "
                                                       "video pipelines, --call image=@input.png for Kontext / edit "
                                                       "pipelines, --call control_image=@edges.png for ControlNets"),
    controlnet: Optional[str] = typer.Option(None, help="ControlNet pipelines: cache the ControlNet model too: "
                                                        "'follow' (the --cache schedule decides), a method name "
                                                        "(its own schedule), or a JSON object such as "
                                                        "'{\"method\": \"fixed_interval\", \"interval\": 3}'"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: 1 for the bundled model)"),
    prompts_file: Optional[str] = typer.Option(
        None, "--prompts", help="batch mode: a prompt file (.txt one per line, .json list, .jsonl), 'builtin', or "
                                "labels 0,1,2 for the tiny model; writes one image per prompt x seed + manifest.json "
                                "(with --cache only, no uncached reference; split over processes under "
                                "`accelerate launch`)"),
    seeds: int = typer.Option(1, help="batch mode: seeds per prompt (--seed .. --seed + N - 1)"),
    num_prompts: Optional[int] = typer.Option(None, help="batch mode: use the first N prompts"),
    batch_size: Optional[int] = typer.Option(None, help="batch mode: prompts per pipeline call (default 10 tiny, 1 "
                                                        "otherwise)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bars with ETA (stderr); "
                                                                         "--no-progress: one line per stage"),
) -> None:
    """Run uncached and cached on the same seeds; write a grid and stats; print the speed-up and PSNR.
    With --prompts FILE: generate every prompt x seed with the cache (batch mode, resumable)."""
    controlnet_setting = _controlnet_setting(controlnet)
    from .runner import removed_if_left_empty

    if prompts_file is not None:  # batch mode hands every apply option over with the --set ones
        if speed is not None or quality is not None:
            _fail(ValueError("--speed / --quality are not taken with --prompts (batch mode): find the setting first "
                             "with `dcache generate --cache <method> --speed 2x` (its stats.json 'target' names the "
                             "chosen value), then pass it with --set <knob>=<value>, or pass the plan.json it wrote "
                             "as --cache."))
        extra = [] if controlnet is None else [f"controlnet={json.dumps(controlnet_setting)}"]
        extra += [] if scope is None else [f"scope={json.dumps(scope)}"]
        with removed_if_left_empty(out):
            _generate_batch(prompts_file, prompt, model=model, cache=cache, seeds=seeds, seed=seed,
                            num_prompts=num_prompts, steps=steps, guidance=guidance, batch_size=batch_size,
                            device=device, dtype=dtype, height=height, width=width, overrides=[*set_, *extra],
                            threads=threads, pipeline_kwargs=_call_arguments(call), out=out, progress=progress)
        return
    from .generate import format_summary, generate as run

    prompts = None if prompt is None else [prompt]  # the digit model's "0,1,2" is split once it is known
    try:
        with removed_if_left_empty(out):
            result = run(model=model, prompts=prompts, cache=cache, steps=steps, seed=seed, guidance=guidance,
                         out=out, repeats=repeats, device=device, dtype=dtype, height=height, width=width,
                         overrides=_parse_overrides(set_), threads=threads, pipeline_kwargs=_call_arguments(call),
                         scope=scope, speed=speed, quality=quality, controlnet=controlnet_setting,
                         progress=Progress(enabled=progress))
    except (ValueError, RuntimeError, TypeError, FileNotFoundError) as exc:
        _fail(exc)
        return
    typer.echo(format_summary(result.summary))
    typer.echo(f"wrote        {result.out_dir}/: {', '.join(result.summary['files'])}")


def _generate_batch(prompts_file: str, prompt: Optional[str], *, seed: int, overrides: list[str], **kw) -> None:
    """`dcache generate --prompts FILE`: dcache.eval.batch.generate_batch; the main process prints the summary."""
    import shlex

    from dcache.eval.batch import generate_batch

    if prompt is not None:
        _fail(ValueError("pass either --prompt (one generation, uncached vs cached) or --prompts FILE (batch), not "
                         "both."))
    try:
        kw["device"], kw["dtype"] = resolve_device(kw["device"], kw["dtype"])
    except ValueError as exc:
        _fail(exc)
    typer.echo(f"[dcache] batch generation on {describe(kw['device'], kw['dtype'])}", err=True)
    # the command as run, from the parsed options (sys.argv is the test runner's under CliRunner)
    options = {"prompts": prompts_file, "seed": seed,
               **{k: v for k, v in kw.items() if k not in ("pipeline_kwargs", "progress")}}
    command = "dcache generate " + shlex.join(
        [a for k, v in options.items() if v is not None for a in (f"--{k.replace('_', '-')}", str(v))]
        + [a for pair in overrides for a in ("--set", pair)]
        + [a for k, v in kw["pipeline_kwargs"].items() for a in ("--call", f"{k}={json.dumps(v)}")])
    try:
        result = generate_batch(prompts=prompts_file, seed_offset=seed, overrides=_parse_overrides(overrides),
                                command=command, **kw)
    except (ValueError, RuntimeError, TypeError, FileNotFoundError, ImportError) as exc:
        _fail(exc)
        return
    from accelerate import PartialState

    if PartialState().is_main_process:  # already initialised by the run
        s = result.summary
        typer.echo(f"{s['images']} images ({s['num_prompts']} prompts x {s['num_seeds']} seeds) with "
                   f"{s['cache'] or 'no cache'} on {s['processes']} process(es): compute ratio "
                   f"{s['compute_ratio']:.3f} (ideal speed-up {1 / s['compute_ratio']:.2f}x)")
        typer.echo(f"wrote {result.out_dir}/ (images/, manifest.json)")


@app.command()
def calibrate(
    model: Optional[str] = typer.Option(None, help="hub id or local pipeline folder; default: the bundled tiny model"),
    method: str = typer.Option("magcache", help="magcache (magnitude ratios), teacache (polynomial fit), or a "
                                                "profiled method: ertacache, profilingdit, invardiff, bac (a plan)"),
    prompt: Optional[str] = typer.Option(None, help="calibration prompt(s); tiny model: labels like '0,1,2'"),
    steps: Optional[int] = typer.Option(None, help="number of inference steps to calibrate for"),
    seeds: int = typer.Option(1, help="number of calibration runs (seeds 0..N-1)"),
    guidance: Optional[float] = typer.Option(None),
    out: Optional[str] = typer.Option(None, help="magcache / teacache: calibration file, entries merged (default "
                                                 "dcache-calibration.json); profiled methods: plan file (default "
                                                 "dcache-METHOD.plan.json), or an existing calibration file to add "
                                                 "the plan to. Written atomically."),
    device: str = typer.Option(AUTO, help=DEVICE_HELP), dtype: str = typer.Option(AUTO, help=DTYPE_HELP),
    set_: list[str] = typer.Option([], "--set", help="profiled methods: config field key=value used by the "
                                                     "calibration (repeatable), e.g. --set compute_ratio=0.4"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a bar over the calibration runs with ETA "
                                                                         "(stderr); --no-progress: one line per run"),
) -> None:
    """Calibrate a method for a model and print how to generate with the file it writes."""
    import shlex

    import dcache
    from dcache.methods import calibrated_methods, calibrator

    from .arguments import check_steps
    from .runner import GenerationJob, check_model, load_pipeline

    # what each method's config declares (MethodConfig.calibrator): a table, or a plan (the profiled methods)
    table_methods, plan_methods = calibrated_methods("table"), calibrated_methods("plan")
    try:
        if method not in table_methods and method not in plan_methods:
            raise ValueError(f"--method {method!r} has no calibration; choose one of "
                             f"{table_methods + plan_methods}.")
        overrides = _parse_overrides(set_)
        if overrides and method in table_methods:
            raise ValueError(f"--set configures a profiled method's calibration ({', '.join(plan_methods)}); "
                             f"{method} takes no config fields here.")
        if seeds < 1:
            raise ValueError(f"--seeds {seeds} must be >= 1.")
        check_model(model)  # everything that can be checked is checked before the model loads
        check_steps(steps)
        if method in plan_methods:
            dcache.config_for(method, **overrides)
        device, dtype = resolve_device(device, dtype)
        pipe, is_tiny = load_pipeline(model, device=device, dtype=dtype)
        typer.echo(f"[dcache] calibrating {method} on {describe(device, dtype)}", err=True)
        if prompt is None and not is_tiny:
            raise ValueError("--prompt is required for this model.")
        prompts = ([p.strip() for p in prompt.split(",")] if is_tiny else [prompt]) if prompt else \
            [str(i) for i in range(10)]
        jobs = [GenerationJob(pipe, is_tiny, prompts=prompts, steps=steps, guidance=guidance, seed=s)
                for s in range(seeds)]
        generate = "dcache generate" + ("" if model in (None, "", "tiny") else f" --model {shlex.quote(model)}")
        if hasattr(pipe, "set_progress_bar_config"):  # the big models' step bars: one line per step under our bar
            pipe.set_progress_bar_config(disable=is_tiny or not progress, leave=False)
        # uncached recording runs: one per seed (magcache, teacache); profiled methods may run a job again
        with Progress(enabled=progress).bar(total=len(jobs), desc=f"calibrate {method}", unit="run") as bar:
            jobs = [_CountedRun(job, bar, f"seed {job.seed}", progress) for job in jobs]
            if method in plan_methods:
                _calibrate_plan(method, pipe, jobs, out or f"dcache-{method}.plan.json", overrides, generate)
                return
            out = out or "dcache-calibration.json"
            table = calibrator(method)[1](pipe, jobs, path=out)
    except (ValueError, RuntimeError, FileNotFoundError, TypeError) as exc:
        _fail(exc)
        return
    typer.echo(f"calibrated {method}:")
    for line in _table_lines(table):
        typer.echo(f"  {line}")
    typer.echo(f"wrote {out}; use it with: {generate} --cache {method} --set calibration={shlex.quote(out)}")


def _table_lines(table: dict) -> list[str]:
    """A calibration table as readable lines: a long list of numbers as its length and range, short ones in full.
    MagCache: "cond: 28 magnitude ratios, first 1, last 0.9712, range 0.9123 .. 1.021"."""
    lines = []
    for key, value in table.items():
        numbers = isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value)
        if numbers and len(value) > 6:
            lines.append(f"{key}: {len(value)} values, first {value[0]:.4g}, last {value[-1]:.4g}, range "
                         f"{min(value):.4g} .. {max(value):.4g}")
        elif numbers:
            lines.append(f"{key}: {', '.join(f'{v:.4g}' for v in value)}")
        else:
            lines.append(f"{key}: {value}")
    return lines


class _CountedRun:
    """A calibration run that advances the progress bar when it ends (or prints a line, with --no-progress)."""

    def __init__(self, job, bar, name: str, bars: bool):
        self.job, self.bar, self.name, self.bars = job, bar, name, bars
        self.runs = 0

    def __call__(self):
        result = self.job()
        self.runs += 1
        if self.bars:
            self.bar.step(self.name)
        else:
            typer.echo(f"[dcache] calibration run done ({self.name})", err=True)
        return result

    def __getattr__(self, name: str):  # the job's fields (prompts, steps, seed) for the calibrators that read them
        return getattr(self.job, name)


def _calibrate_plan(method: str, pipe, jobs: list, out: str, overrides: dict, generate: str) -> None:
    """`dcache calibrate --method ertacache|profilingdit|invardiff|bac`: the plan, written to `out`."""
    import shlex

    from dcache.schedules.tuning.plan_calibration import calibrate_plan, save_plan_calibration

    plan = calibrate_plan(method, pipe, jobs, **overrides)
    kind = save_plan_calibration(out, method, plan, pipe.transformer)
    typer.echo(f"calibrated {method}: a {plan.granularity} plan of {plan.num_steps} steps x {len(plan.units)} units, "
               f"branches {sorted(plan.actions)}, {plan.compute_ratio():.3f} of its cells computed; replays at any "
               f"step count (nearest calibrated step)")
    quoted = shlex.quote(out)
    typer.echo(f"wrote {out} ({'a plan file' if kind == 'plan' else 'its entry in the calibration file'}); use it "
               f"with:")
    if kind == "plan":
        typer.echo(f"  {generate} --cache {quoted}")
    typer.echo(f"  {generate} --cache {method} --set calibration={quoted}")
    typer.echo(f"  python: dcache.apply(pipe, {method!r}, calibration={out!r})")


@app.command()
def estimate(
    model: Optional[str] = typer.Option(None, help="shipped config name (--list), folder with transformer/config.json "
                                                  "or config.json, a config.json, or a hub id (config only); default: "
                                                  "the bundled tiny model"),
    cache: str = typer.Option(DEFAULT_METHOD, help="method name, preset, or 'all'"),
    set_: list[str] = typer.Option([], "--set", help="method config override key=value (repeatable)"),
    height: Optional[int] = typer.Option(None), width: Optional[int] = typer.Option(None),
    frames: Optional[int] = typer.Option(None, help="video frames (pixel space)"),
    steps: Optional[int] = typer.Option(None), batch: int = typer.Option(1, help="prompts per call"),
    guidance: Optional[float] = typer.Option(None, help="CFG scale (<= 1: one branch)"),
    text_tokens: Optional[int] = typer.Option(None, help="prompt tokens the pipeline passes"),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16"),
    scope: Optional[str] = typer.Option(None, help="'blocks' (default) or 'call'"),
    as_json: bool = typer.Option(False, "--json", help="print the estimates as JSON"),
    list_: bool = typer.Option(False, "--list", help="list the shipped configs and their usual settings"),
    table: bool = typer.Option(False, "--table", help="print the table of docs/memory.md: peak cache per method for "
                                                      "every shipped config at its usual settings"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a bar over the estimates (stderr)"),
) -> None:
    """Cache memory (peak, per unit kind, branch and expert), FLOPs per call and the compute ratio range of a method,
    from the model's config on the meta device: no weights, no GPU, before any run."""
    import warnings

    from . import estimate as est

    # dcache's own UserWarnings stay quiet here, e.g. MagCache's self-calibration note
    warnings.filterwarnings("ignore", category=UserWarning, module=r"dcache\.")
    try:
        if list_:
            for name, info in est.shipped_models().items():
                typer.echo(f"{name:18s} {info['hub_id']:42s} {info['width']}x{info['height']} {info['frames']}f "
                           f"{info['steps']} steps, guidance {info['guidance']} ({info['cfg']})")
            return
        bars = Progress(enabled=progress and not as_json, quiet=as_json)  # --json: the JSON alone
        if table:  # ~1 s per (model, method): a bar over them
            with bars.bar(total=est.table_size(), desc="estimate --table", unit="estimate") as bar:
                text = est.markdown_table(dtype=dtype, on_row=bar.step)
            typer.echo(text)
            return
        spec = est.resolve_model(model)
        setting = est.with_overrides(spec.setting, height=height, width=width, frames=frames, steps=steps,
                                     guidance=guidance, text_tokens=text_tokens)
        import dcache

        names = sorted(dcache.methods()) if cache == "all" else [cache]
        with bars.bar(total=len(names) * len(spec.experts), desc="estimate", unit="estimate") as bar:
            rows = est.estimate_spec(spec, names, overrides=_parse_overrides(set_), batch=batch, dtype=dtype,
                                     setting=setting, scope=scope, on_row=bar.step)
    except (ValueError, RuntimeError, TypeError, FileNotFoundError) as exc:
        _fail(exc)
        return
    if as_json:
        typer.echo(json.dumps([{"method": r.method, "expert": r.expert, **r.estimate.to_dict()} for r in rows],
                              indent=1))
        return
    typer.echo(est.format_rows(spec, setting, rows, batch, dtype))
    typer.echo("compute ratio: lowest = the schedule replayed with every change signal reading 'no change' over "
               "its main knob's range (structural limits only), highest = every call computed")


@app.command()
def methods(name: Optional[str] = typer.Argument(None, help="a method or preset: print its full documentation")
            ) -> None:
    """List the caching methods and presets (one line each), or document one: `dcache methods magcache`."""
    import dcache
    from dcache.method_docs import describe, summary

    known, presets = dcache.methods(), dcache.presets()
    if name is None:
        for method, cls in sorted(known.items()):
            typer.echo(f"{method:22s} {summary(cls)}")
        for preset_name, preset in sorted(presets.items()):
            typer.echo(f"{preset_name:22s} preset of {preset.method}: {preset.doc or preset.overrides}")
        return
    if name in presets:
        preset = presets[name]
        typer.echo(f"{name}: preset of {preset.method}, {preset.doc}\nOverrides: {preset.overrides}\n")
        name = preset.method
    if name not in known:
        try:
            dcache.config_for(name)  # raises the registry's error: the name, close matches, the known names
        except ValueError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
    typer.echo(describe(known[name], presets))


@app.command()
def support() -> None:
    """Print which diffusers transformer classes dcache supports."""
    from dcache.model.support_matrix import render_markdown

    typer.echo(render_markdown())


app.command("search")(search_command)
from dcache.eval.cli import analyze_command, eval_command  # noqa: E402  (eval/cli.py imports only typer at load)
app.command("eval")(eval_command); app.command("analyze")(analyze_command)  # noqa: E702


def main() -> None:
    try:
        app()
    except Exception as error:  # an optional dependency that is not installed: name the extra that brings it
        hint = explain_missing(error)
        if hint is None:
            raise
        typer.echo(f"error: {hint}", err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
