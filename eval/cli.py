"""Typer commands `dcache eval` and `dcache analyze` (batch generation is `dcache generate --prompts FILE`).

The `dcache` CLI (pipelines/cli.py) registers them; this module also runs on its own, which is what
`accelerate launch` needs:

    accelerate launch --num_processes 2 -m dcache.eval.cli eval --methods fora,fbcache --seeds 8 --out eval-out

(`-m dcache.pipelines.cli` works the same and has every `dcache` command, e.g. `generate --prompts FILE`.)
"""

from __future__ import annotations

import shlex
import sys
from typing import Optional

import typer

from dcache.optional_deps import explain_missing

ERRORS = (ValueError, FileNotFoundError, ImportError, RuntimeError, TypeError)
THREADS_HELP = "torch CPU threads (default: 1 for the bundled model on the CPU, as dcache generate; else torch's)"


def _fail(exc: Exception) -> None:
    hint = explain_missing(exc)  # an optional dependency that is not installed: the extra that brings it
    typer.secho(f"error: {hint or exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _command_line(name: str) -> str:
    argv = sys.argv[1:]
    if argv and argv[0] == name:
        argv = argv[1:]
    return "dcache " + name + (" " + shlex.join(argv) if argv else "")


def _call_arguments(pairs: list[str]) -> dict:
    from dcache.pipelines.runner import check_call_images, parse_overrides

    try:
        return check_call_images(parse_overrides(pairs, flag="--call", example="num_frames=17"))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _device_and_dtype(device: str, dtype: str, command: str) -> tuple[str, str]:
    """`auto` resolved (dcache.pipelines.devices) and said on stderr: the device and dtype the command runs on."""
    from dcache.pipelines.devices import describe, resolve_device

    try:
        device, dtype = resolve_device(device, dtype)
    except ValueError as exc:
        _fail(exc)
    typer.echo(f"[dcache] {command} on {describe(device, dtype)}", err=True)
    return device, dtype


def _stage_lines(command: str):
    """on_record for --no-progress: one line when a method starts (its first record), none per generation."""
    seen: set[str] = set()

    def on_record(label: str, item) -> None:
        if label not in seen:
            seen.add(label)
            typer.echo(f"[dcache] {command}: {label}", err=True)

    return on_record


def eval_command(
    model: Optional[str] = typer.Option(None, help="hub id or local pipeline folder; default: the bundled tiny model"),
    methods: list[str] = typer.Option(["fora"], "--methods", "-m",
                                      help="comma-separated methods / presets / plan files; settings as "
                                           "name:key=value:key=value (repeatable)"),
    prompts: str = typer.Option("builtin", help="'builtin', a prompt file (.txt/.json/.jsonl), or labels like 0,1,2 "
                                                "for the tiny model"),
    num_prompts: Optional[int] = typer.Option(None, help="use the first N prompts"),
    seeds: int = typer.Option(2, help="number of seeds per prompt (seeds seed-offset .. seed-offset + N - 1)"),
    seed_offset: int = typer.Option(0, help="first seed"),
    steps: Optional[int] = typer.Option(None, help="inference steps (pipeline default if unset)"),
    guidance: Optional[float] = typer.Option(None, help="guidance scale (pipeline default if unset)"),
    batch_size: Optional[int] = typer.Option(None, help="prompts per pipeline call (default 10 tiny, 1 otherwise)"),
    repeats: int = typer.Option(3, help="timed repeats per pipeline call"),
    warmup: int = typer.Option(1, help="untimed warm-up calls per method and process"),
    metrics: str = typer.Option("auto", help="comma-separated: psnr,ssim,lpips,max_abs,mean_abs,temporal,fid,"
                                             "accuracy,clip_score,image_reward, or auto"),
    flops: bool = typer.Option(True, "--flops/--no-flops", help="count FLOPs of one call per method"),
    device: str = typer.Option("auto", help="auto (default: cuda, under accelerate each process's GPU; else mps, "
                                            "else cpu), cpu, cuda, cuda:1, mps"),
    dtype: str = typer.Option("auto", help="auto (default: bfloat16 on CUDA, float32 elsewhere), float32, bfloat16 "
                                           "or float16"),
    height: Optional[int] = typer.Option(None), width: Optional[int] = typer.Option(None),
    call: list[str] = typer.Option([], "--call", help="more pipeline call arguments key=value (repeatable; JSON "
                                                       "values; @FILE opens an image), e.g. --call num_frames=17 for "
                                                       "video pipelines, --call image=@input.png for Kontext / edit "
                                                       "pipelines, --call control_image=@edges.png for ControlNets"),
    grid_items: int = typer.Option(1, help="pipeline calls shown in the image grids"),
    classifier: Optional[str] = typer.Option(None, help="digit classifier .safetensors (tiny model fid/accuracy)"),
    clip_model: str = typer.Option("openai/clip-vit-base-patch16",
                                   help="clip_score: a hub id or a local folder with a CLIP model (save_pretrained)"),
    image_reward_model: str = typer.Option("ImageReward-v1.0", help="image_reward: a model name or an ImageReward.pt "
                                                                    "path"),
    out: str = typer.Option("dcache-eval", help="report folder (resumes when it holds the same eval)"),
    threads: Optional[int] = typer.Option(None, help=THREADS_HELP),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a progress bar with ETA (stderr); "
                                                                         "--no-progress: one line per method"),
) -> None:
    """Evaluate caching methods against the uncached pipeline: report.md/.html, results.json, grids, Pareto plot."""
    from .runner import EvalConfig, run_eval

    device, dtype = _device_and_dtype(device, dtype, "eval")
    method_list = [m.strip() for spec in methods for m in spec.split(",") if m.strip()]
    pipeline_kwargs = _call_arguments(call)
    cfg = EvalConfig(model=model, methods=method_list, prompts=prompts, num_prompts=num_prompts, seeds=seeds,
                     seed_offset=seed_offset, steps=steps, guidance=guidance, batch_size=batch_size, repeats=repeats,
                     warmup=warmup, flops=flops, metrics=metrics, device=device, dtype=dtype, height=height,
                     width=width, pipeline_kwargs=pipeline_kwargs, grid_items=grid_items, classifier=classifier,
                     clip_model=clip_model, image_reward_model=image_reward_model, out=out,
                     command=_command_line("eval"), threads=threads)
    from dcache.pipelines.runner import removed_if_left_empty

    try:
        with removed_if_left_empty(out):
            result = run_eval(cfg, progress=progress, on_record=None if progress else _stage_lines("eval"))
    except ERRORS as exc:
        _fail(exc)
        return
    from accelerate import PartialState

    if PartialState().is_main_process:  # already initialised by the run
        from .report import caveats, markdown_table, table_rows

        typer.echo(markdown_table(*table_rows(result.results)))
        for line in caveats(result.results):
            typer.echo(f"warning: {line}")
        typer.echo(f"wrote {result.out_dir}/: {', '.join(result.files)}")


def analyze_command(
    model: Optional[str] = typer.Option(None, help="hub id or local pipeline folder; default: the bundled tiny model"),
    prompts: str = typer.Option("builtin", help="'builtin', a prompt file, or labels like 0,1,2 for the tiny model"),
    num_prompts: Optional[int] = typer.Option(None, help="use the first N prompts"),
    seeds: int = typer.Option(1, help="number of seeds per prompt"),
    steps: Optional[int] = typer.Option(None, help="inference steps (pipeline default if unset)"),
    guidance: Optional[float] = typer.Option(None, help="guidance scale (pipeline default if unset)"),
    batch_size: Optional[int] = typer.Option(None, help="prompts per pipeline call"),
    device: str = typer.Option("auto", help="auto (default: cuda, else mps, else cpu), cpu, cuda, cuda:1, mps"),
    dtype: str = typer.Option("auto", help="auto (default: bfloat16 on CUDA, float32 elsewhere), float32, bfloat16 "
                                           "or float16"),
    height: Optional[int] = typer.Option(None), width: Optional[int] = typer.Option(None),
    out: str = typer.Option("dcache-analyze", help="output folder for PNGs, analysis.json, summary.md"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a progress bar with ETA (stderr)"),
) -> None:
    """Redundancy analysis: per step x block heat maps, the MagCache curve, suggested settings."""
    from .analyze import AnalyzeConfig, run_analyze

    device, dtype = _device_and_dtype(device, dtype, "analyze")

    cfg = AnalyzeConfig(model=model, prompts=prompts, num_prompts=num_prompts, seeds=seeds, steps=steps,
                        guidance=guidance, batch_size=batch_size, device=device, dtype=dtype, height=height,
                        width=width, out=out, command=_command_line("analyze"))
    try:
        result = run_analyze(cfg, progress=progress)
    except ERRORS as exc:
        _fail(exc)
        return
    from accelerate import PartialState

    if PartialState().is_main_process:  # already initialised by the run
        typer.echo((result.out_dir / "summary.md").read_text().split("## Figures")[0].rstrip())
        typer.echo(f"wrote {result.out_dir}/: {', '.join(result.files)}")


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="dcache evaluation commands (also available as `dcache eval` / `dcache analyze`).")
app.command("eval")(eval_command)
app.command("analyze")(analyze_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()


__all__ = ["eval_command", "analyze_command", "app", "main"]
