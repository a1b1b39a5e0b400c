"""Do searched plans hold up at another guidance scale? `dcache search --guidance` at one scale vs several.

    python benchmarks/guidance_transfer.py --out benchmarks/results/guidance_transfer   # ~30-40 min, 2 CPU cores
    python benchmarks/guidance_transfer.py --quick                                       # ~2 min smoke run

Protocol (bundled digit model, 28 steps, split CFG):
  * Searches: `dcache search --method lemica --forecast-order 2 --max-span 8 --budget 6,4` (6 and 4 computed steps
    of 28: compute ratios 0.214 and 0.143) on the tuning batch (labels 0-9, seed 0), once per --searches entry: at
    guidance 1.5 only (the pipeline's default), at 1.5 and 3 together (every candidate scored by its worst scale),
    and at 1.5 and 3 with `--scope auto` (each plan kept in the scope whose worst-scale score is higher).
    The searches run through the same code as the CLI (`dcache.pipelines.search_cli.run_search`) and are kept in
    --out/search-*; a rerun reuses their measured edges.
  * Held-out: seeds 1000.. x labels 0-9 at guidance 1.5, 2, 3 and 4.5; PSNR of every row against the uncached
    images of the same seeds and scale; the compute ratio from the engine's counters.
  * Each searched plan replays as written (block scope: the stack's residual forecast, the output head recomputed)
    and in call scope (`scope="call"`: the whole call's offset v - x forecast).
  * Beside the plans: dynamic SeaCache (SEA gate, order 2, call scope, threshold 4, consecutive-reuse cap 4 / 6:
    the ratios of the plans), and the frontier's CFG-1.5 keyframes 6 + 5 (benchmarks/frontier.py KEYFRAMES) with
    the branches forecast on their own and with `cfg_difference=True`.
Writes <out>/transfer.md, transfer.json and transfer.png with the command, the commit and the load average.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

SCRATCH = Path(__file__).resolve().parent / "out" / "guidance_transfer"
# search setting -> (guidance scales of the calibration set, --scope)
SEARCHES = {"g1.5": ([1.5], "blocks"), "g1.5+3": ([1.5, 3.0], "blocks"), "g1.5+3-auto": ([1.5, 3.0], "auto")}
HELDOUT_GUIDANCE = (1.5, 2.0, 3.0, 4.5)
BUDGETS = (6, 4)  # computed steps of 28
SEACACHE_CAPS = {6: 4, 4: 6}  # consecutive reuses: 1 compute per 5 / 7 calls at most, the plans' ratios


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=SCRATCH, help="folder for the searches and transfer.md / .json / "
                                                              ".png (default benchmarks/out/guidance_transfer)")
    ap.add_argument("--searches", default=",".join(SEARCHES),
                    help=f"comma-separated search settings, of {list(SEARCHES)} or 'g<a>+<b>[-auto]' (default: "
                         f"all)")
    ap.add_argument("--heldout-seeds", type=int, default=3, help="held-out seeds x 10 labels (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (quality only: nothing here is timed)")
    ap.add_argument("--quick", action="store_true", help="8 steps, labels 1 and 7, one held-out seed")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad arguments answer here, before torch and diffusers load

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontier  # noqa: E402  (its KEYFRAMES, and the methods sweep it loads: load average helpers)


def setting_of(name: str) -> tuple[list[float], str]:
    """'g1.5+3' -> ([1.5, 3.0], "blocks"); 'g1.5+3-auto' -> ([1.5, 3.0], "auto")."""
    if name in SEARCHES:
        return SEARCHES[name]
    scope = "auto" if name.endswith("-auto") else "blocks"
    try:
        return [float(v) for v in name.removesuffix("-auto")[1:].split("+")], scope
    except ValueError:
        raise SystemExit(f"error: search setting {name!r} must look like g1.5, g1.5+3 or g1.5+3-auto") from None


def run(args: argparse.Namespace, log) -> dict:
    import dcache
    from dcache.pipelines.runner import load_pipeline
    from dcache.pipelines.search_cli import run_search
    from dcache.plans.plan import Plan
    from dcache.quality import psnr

    pipe, _ = load_pipeline(None, device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    steps, labels = (8, [1, 7]) if args.quick else (28, list(range(10)))
    seeds = [1000 + i for i in range(1 if args.quick else args.heldout_seeds)]
    budgets = (4, 2) if args.quick else BUDGETS

    plans: dict[str, dict] = {}  # row name -> {"target": plan or method, "kw": apply kwargs, "searched_at": [...]}
    for name in [s.strip() for s in args.searches.split(",") if s.strip()]:
        scales, scope = setting_of(name)
        folder = args.out / f"search-{name}"
        log(f"search {name}: lemica, forecast order 2, budgets {budgets}, guidance {scales}, scope {scope} -> "
            f"{folder}")
        front = run_search("lemica", pipe, True, budget=",".join(map(str, budgets)), out=str(folder), steps=steps,
                           prompts=",".join(map(str, labels)), seed=0, max_span=8, forecast_order=2,
                           guidance=scales, scope=scope, progress=False)
        for point in front["points"]:
            plan = Plan.load(folder / point["plan"])
            computed = round(point["compute_ratio"] * steps)
            label = f"lemica {computed}/{steps} searched at {'+'.join(f'{g:g}' for g in scales)}"
            if scope == "auto":
                label += f", scope auto ({plan.extras.get('scope', 'blocks')})"
            plans[label] = dict(target=plan, kw={}, searched_at=scales, tuning=point["quality"], computed=computed)
            if scope == "blocks":
                plans[f"{label}, call scope"] = dict(target=plan, kw=dict(scope="call"), searched_at=scales,
                                                     tuning=None, computed=computed)
    for computed in budgets:
        cap = SEACACHE_CAPS.get(computed, 4)
        plans[f"seacache o2 call cap {cap}"] = dict(
            target="seacache", kw=dict(scope="call", order=2, threshold=4.0, max_consecutive=cap), searched_at=[],
            computed=computed)
    keyframes = frontier.KEYFRAMES["cfg1.5"]["6+5"]
    plans["keyframes 6+5 (frontier, cfg 1.5)"] = dict(target="keyframe", kw=dict(scope="call", **keyframes),
                                                       searched_at=[1.5], computed=6)
    plans["keyframes 6+5 cfg_difference"] = dict(target="keyframe", kw=dict(scope="call", cfg_difference=True,
                                                                              **keyframes),
                                                  searched_at=[1.5], computed=6)

    def images(guidance: float) -> torch.Tensor:
        return torch.cat([pipe(labels=labels, num_inference_steps=steps, guidance_scale=guidance,
                               generator=torch.Generator().manual_seed(s), output_type="pt").images.float()
                          for s in seeds])

    rows = {name: {"searched_at": p["searched_at"], "computed": p["computed"], "tuning": p.get("tuning"),
                   "at": {}} for name, p in plans.items()}
    for guidance in HELDOUT_GUIDANCE:
        with torch.no_grad():
            ref = images(guidance)
        for name, p in plans.items():
            with dcache.apply(pipe, p["target"], **p["kw"]) as handle, torch.no_grad():
                out = images(guidance)
                ratio = handle.stats().compute_ratio
            value = psnr(out, ref, dtype=torch.float32)
            rows[name]["at"][f"{guidance:g}"] = dict(ratio=ratio, psnr=value)
            log(f"  guidance {guidance:g}: {name}: ratio {ratio:.3f}, {value:.2f} dB")
    return dict(rows=rows, steps=steps, labels=labels, seeds=seeds, heldout_guidance=list(HELDOUT_GUIDANCE))


def write_report(data: dict, out: Path) -> tuple[Path, Path]:
    from dcache.files.atomic import atomic_write_text

    meta, rows = data["meta"], data["rows"]
    scales = [f"{g:g}" for g in data["heldout_guidance"]]
    lines = ["# Guidance transfer of searched plans",
             "",
             f"Bundled digit model, {data['steps']} steps, split CFG; held-out seeds {data['seeds'][0]}.."
             f"{data['seeds'][-1]} x labels {data['labels'][0]}..{data['labels'][-1]}; PSNR (dB) against the "
             f"uncached images of the same scale; compute ratio / PSNR per guidance scale. Commit {meta['git_commit']}"
             f", {meta['date']}, torch {meta['torch']}, diffusers {meta['diffusers']}, load average "
             f"{meta['load_start']} at the start, {meta.get('load_end', '?')} at the end, "
             f"{meta.get('runtime_s', 0) / 60:.1f} min.",
             "",
             f"Command: `{meta['command']}`",
             "",
             "| row | searched at | " + " | ".join(f"guidance {g}" for g in scales)
             + " | worst | loss from 1.5 to the worst |",
             "|---|---|" + "---|" * (len(scales) + 2)]
    for name, r in rows.items():
        at = r["at"]
        if not at:
            continue
        worst = min(v["psnr"] for v in at.values())
        base = at.get("1.5", {}).get("psnr")
        lines.append(f"| {name} | {', '.join(f'{g:g}' for g in r['searched_at']) or 'dynamic'} | "
                     + " | ".join(f"{at[g]['ratio']:.3f} / {at[g]['psnr']:.2f}" if g in at else "-" for g in scales)
                     + f" | {worst:.2f} | {'-' if base is None else format(base - worst, '.2f')} |")
    md = atomic_write_text(out / "transfer.md", "\n".join(lines) + "\n")
    js = atomic_write_text(out / "transfer.json", json.dumps(data, indent=1))
    _plot(data, out / "transfer.png")
    return md, js


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dcache.files.atomic import atomic_write_with

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100, sharey=True)
    groups = sorted({r["computed"] for r in data["rows"].values()}, reverse=True)
    for ax, computed in zip(axes, groups):
        for name, r in data["rows"].items():
            if r["computed"] != computed or not r["at"]:
                continue
            gs = sorted(r["at"], key=float)
            style = "o-" if r["searched_at"] and "lemica" in name else ("s--" if r["searched_at"] else "^:")
            ratio = next(iter(r["at"].values()))["ratio"]
            ax.plot([float(g) for g in gs], [r["at"][g]["psnr"] for g in gs], style, label=f"{name} @ {ratio:.3f}")
        ax.set_title(f"plans with {computed} of {data['steps']} steps computed (legend: compute ratio)", fontsize=9)
        ax.set_xlabel("guidance scale (held-out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("PSNR vs uncached (dB)")
    fig.tight_layout()
    try:
        atomic_write_with(path, fig.savefig)
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = frontier.methods
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)

    import diffusers

    from dcache.eval.runner import _git_commit

    command = "python benchmarks/guidance_transfer.py" + "".join(
        " " + shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    meta = dict(command=command, git_commit=_git_commit(Path(__file__).resolve().parents[1]),
                date=time.strftime("%Y-%m-%d %H:%M"),
                torch=torch.__version__, diffusers=diffusers.__version__, load_start=methods._load())
    args.out.mkdir(parents=True, exist_ok=True)
    data = run(args, log)
    meta.update(runtime_s=time.time() - started, load_end=methods._load())
    data["meta"] = meta
    md, _ = write_report(data, args.out)
    log(f"wrote {md} in {(time.time() - started) / 60:.1f} min")
    return md


if __name__ == "__main__":
    main()
