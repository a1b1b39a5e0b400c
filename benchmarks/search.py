"""Searched plans vs the best dynamic schedule at the same compute ratio, on the bundled tiny digit model.

    python benchmarks/search.py                      # full run (~15-30 min on 2 CPU cores), writes results/search.md
    python benchmarks/search.py --quick              # minutes: fewer steps, smaller searches

Calibration: labels 0..9, seed 0. Held-out: other labels order and noise (seed 1000 + labels 9..0 twice shuffled).
Every plan (searched or recorded from a dynamic method on the held-out set) is scored on the held-out set:
PSNR to the uncached images, the digit classifier's accuracy on the requested labels, and the compute ratio in
block FLOPs counted from shapes (dcache.schedules.search.Template). For each target ratio r (0.5, 0.33) the table
compares each search method's best plan with ratio <= r + tol against the best dynamic schedule with ratio <= r + tol;
"dominates" = at most the dynamic schedule's compute ratio and at least its PSNR.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import dcache
from dcache.pipelines.search_cli import dynamic_seed_plans, make_calibration
from dcache.plan import Plan
from dcache.schedules import search

RESULTS = Path(__file__).resolve().parent / "results" / "search.md"
TARGETS = (0.5, 0.33)
TOL = 0.02
DYNAMIC_SWEEPS = {
    "fbcache": [dict(threshold=t) for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.8)],
    "easycache": [dict(threshold=t) for t in (0.02, 0.05, 0.1, 0.2, 0.4)],
    "magcache": [dict(threshold=t) for t in (0.02, 0.06, 0.12, 0.25, 0.5)],
    "fora": [dict(interval=k) for k in (2, 3, 4)],
    "taylorseer": [dict(interval=k) for k in (2, 3, 4)],
    "fixed_interval": [dict(interval=k) for k in (2, 3, 4)],
}


def load(assets: str | None):
    if assets is None:
        from dcache.pipelines.bundled import load_tiny_pipeline

        return load_tiny_pipeline(), "bundled"
    from diffusers.utils import logging

    from dcache.pipelines.tiny_pipeline import DigitFlowPipeline

    logging.disable_progress_bar()
    pipe = DigitFlowPipeline.from_pretrained(Path(assets) / "tiny-digits", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe, assets


def score(calib, template, plan: Plan) -> dict:
    m = search.measure(calib, template, plan)
    return {"compute_ratio": m.compute_ratio, "psnr": m.quality, "accuracy": m.metrics.get("accuracy")}


def dynamic_points(pipe, calib, template) -> list[dict]:
    rows = []
    for name, sweep in DYNAMIC_SWEEPS.items():
        for overrides in sweep:
            try:
                handle = dcache.apply(pipe, name, count_flops=False, **overrides)
            except (ValueError, TypeError, RuntimeError) as exc:
                print(f"skip {name} {overrides}: {exc}", file=sys.stderr)
                break
            try:
                with torch.no_grad():
                    images = calib.generate().float().cpu()
                plan = handle.plan()
            finally:
                handle.remove()
            ref = calib.reference()
            metrics = calib.metrics_fn(images, ref) if calib.metrics_fn else {}
            rows.append({"method": name, "config": overrides, "compute_ratio": template.compute_ratio(plan),
                         "psnr": calib.quality_fn(images, ref), "accuracy": metrics.get("accuracy")})
    return rows


def best_at(points: list[dict], target: float) -> dict | None:
    ok = [p for p in points if p["compute_ratio"] <= target + TOL]
    return max(ok, key=lambda p: (p["psnr"], -p["compute_ratio"])) if ok else None


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", default=None, help="folder with tiny-digits/ and digit-classifier.safetensors "
                                                    "(default: the bundled model)")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--pop-size", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-span", type=int, default=6)
    ap.add_argument("--methods", default="ecad,lemica,dp")
    ap.add_argument("--quick", action="store_true", help="steps 12, pop 8, 3 generations, span 4")
    ap.add_argument("--out", default=None, help="search output folder (default: a temporary folder)")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/search.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.pop_size, args.generations, args.max_span = 12, 8, 3, 4
    torch.set_num_threads(1)
    t0 = time.time()
    pipe, source = load(args.assets)
    if args.assets is not None:  # the classifier of that folder, for the accuracy column
        import dcache.pipelines.bundled as bundled

        bundled.DIGIT_CLASSIFIER_PATH = Path(args.assets) / "digit-classifier.safetensors"
    calib_labels = [str(i) for i in range(10)]
    held = [str(i) for i in range(10)] * 2
    random.Random(1).shuffle(held)
    calib = make_calibration(pipe, True, calib_labels, steps=args.steps, seed=0)
    heldout = make_calibration(pipe, True, held, steps=args.steps, seed=1000)
    template = search.make_template(calib)
    held_template = search.make_template(heldout)
    out = Path(args.out or tempfile.mkdtemp(prefix="dcache-search-bench-"))
    budgets = tuple(max(2, round(r * args.steps)) for r in TARGETS)

    searched: dict[str, list[dict]] = {}
    timings = {}
    for method in [m for m in args.methods.split(",") if m]:
        t = time.time()
        folder = out / method
        if method == "ecad":
            seeds = dynamic_seed_plans(pipe, calib)
            front = search.ecad_search(calib, folder, search.ECADConfig(pop_size=args.pop_size,
                                                                        generations=args.generations),
                                       seed_plans=seeds, template=template, resume=True)
        elif method == "lemica":
            front = search.lemica_search(calib, folder, search.LeMiCaConfig(budgets=budgets, max_span=args.max_span),
                                         template=template)
        elif method == "dp":
            front = search.dp_search(calib, folder, search.DPConfig(budgets=budgets), template=template)
        else:
            from dcache.schedules.search import router

            cfg = router.RouterConfig(objective=method, target_ratios=TARGETS)
            front = router.router_search(calib, folder, cfg, template=template)
        timings[method] = time.time() - t
        searched[method] = [{"method": method, "plan": p["plan"],
                             **score(heldout, held_template, Plan.load(folder / p["plan"]))} for p in front["points"]]
    dynamic = dynamic_points(pipe, heldout, held_template)

    lines = [f"# Searched plans vs dynamic schedules (tiny digit model, {args.steps} steps)", "",
             f"Command: `python benchmarks/search.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
             f"Weights: {source}. Calibration: labels 0-9, seed 0; held-out: 20 labels, seed 1000. "
             f"Scores on the held-out set: PSNR (dB) to the uncached images, classifier accuracy on the requested "
             f"labels, compute ratio = block FLOPs computed / uncached (counted from shapes). Tolerance on the "
             f"ratio: +{TOL}. Search wall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
             + f"; total {time.time() - t0:.0f} s on CPU.", "",
             "| target ratio | method | plan / config | compute ratio | PSNR | accuracy | best dynamic (config) | "
             "its ratio | its PSNR | its accuracy | dominates |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for target in TARGETS:
        dyn = best_at(dynamic, target)
        for method, points in searched.items():
            best = best_at(points, target)
            if best is None:
                lines.append(f"| {target} | {method} | (no plan at this ratio) | | | | | | | | |")
                continue
            dom = dyn is None or (best["compute_ratio"] <= dyn["compute_ratio"] + 1e-9
                                  and best["psnr"] >= dyn["psnr"])
            dyn_name = f"{dyn['method']} {dyn['config']}" if dyn else "-"
            lines.append(f"| {target} | {method} | `{best['plan']}` | {best['compute_ratio']:.3f} | {best['psnr']:.2f} | "
                         f"{fmt(best['accuracy'], '.2f')} | {dyn_name} | {fmt(dyn and dyn['compute_ratio'])} | "
                         f"{fmt(dyn and dyn['psnr'], '.2f')} | {fmt(dyn and dyn['accuracy'], '.2f')} | "
                         f"{'yes' if dom else 'no'} |")
    lines += ["", "All dynamic points (held-out):", "", "| method | config | compute ratio | PSNR | accuracy |",
              "|---|---|---|---|---|"]
    for d in sorted(dynamic, key=lambda d: d["compute_ratio"]):
        lines.append(f"| {d['method']} | {d['config']} | {d['compute_ratio']:.3f} | {d['psnr']:.2f} | "
                     f"{fmt(d['accuracy'], '.2f')} |")
    lines += ["", "All searched plans (held-out):", "", "| method | plan | compute ratio | PSNR | accuracy |",
              "|---|---|---|---|---|"]
    for method, points in searched.items():
        for p in sorted(points, key=lambda p: p["compute_ratio"]):
            lines.append(f"| {method} | `{p['plan']}` | {p['compute_ratio']:.3f} | {p['psnr']:.2f} | "
                         f"{fmt(p['accuracy'], '.2f')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "benchmark.json").write_text(json.dumps({"dynamic": dynamic, "searched": searched}, indent=1))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
    return text


if __name__ == "__main__":
    main()
