"""Forecasters against Taylor on every bundled model: held-out PSNR vs uncached at compute ratios ~0.25 and ~0.14.

    python benchmarks/forecasters.py --out benchmarks/results          # 3 models, 2 held-out seeds (~8 min, 2 cores)
    python benchmarks/forecasters.py --models digits --seeds 1          # one model, one seed
    python benchmarks/forecasters.py --tune --out benchmarks/results   # the sweep the defaults were chosen by
    python benchmarks/forecasters.py --tune --only l2p --out benchmarks/results   # L2P's part of that sweep

Schedule: keyframe in call scope (the whole transformer call forecast between keyframes: dcache's setting for ratios
<= 0.25), uniform keyframes f_i = i / k (i = 0..k-1, k = round(ratio * steps)), the same for both CFG branches, at
each model's default steps and guidance. Contenders: the engine's Taylor table of order 1 and 2, and each forecaster
of dcache.schedules.forecasters at its default settings (order 2 serves while its window fills); L2P's table is
fitted per model and ratio (`fit_l2p`) on that model's tuning seeds 0 and 1, with the same keyframes ("l2p-auto": the
same with ridge="auto", the ridge chosen by seed 0's cached sample against its uncached one). The defaults were
chosen by `--tune`: each forecaster's settings swept on tiny-digits only, on its tuning batch (seed 0, never a
reported seed), best mean PSNR over the two ratios; tiny-motion and tiny-shapes were not tuned on.
Held-out generations: seeds 1000.. (`--seeds`), each a batch of every class x `--per-class`; PSNR per sample
(a clip's frames together) against the uncached sample of the same seed. Compute ratio: handle.stats().
Writes <out>/forecasters.json and forecasters.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

MODELS = {  # name: (loader, what it stands for)
    "digits": ("load_tiny_pipeline", "Flux, split CFG 1.5, 28 steps"),
    "motion": ("load_motion_pipeline", "Wan video, split CFG 5, UniPC, 20 steps"),
    "shapes": ("load_shapes_pipeline", "SD3, batched CFG 4, 28 steps"),
}
RATIOS = (0.25, 0.14)
FORECASTERS = ("taylor-o1", "taylor-o2", "foca", "hyca", "spectrum", "dmd", "l2p", "l2p-auto")
L2P_DEFAULT = {"window": 2, "ridge": 10.0}  # fit_l2p's defaults, chosen by --tune on tiny-digits (..._l2p.json)
L2P_SEEDS = {"tune": (1, 2), "report": (0, 1)}  # its calibration runs: never a seed the row is measured on


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--seeds", type=int, default=2, help="held-out seeds (1000, 1001, ...)")
    ap.add_argument("--per-class", type=int, default=1, help="samples of each class per seed")
    ap.add_argument("--tune", action="store_true", help="sweep each forecaster's settings on tiny-digits, seed 0")
    ap.add_argument("--only", default=None, help="with --tune: comma-separated forecaster names to sweep (e.g. l2p)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                    help="folder for forecasters.json / forecasters.md")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch loads

import torch  # noqa: E402

import dcache  # noqa: E402
from dcache.eval.runner import _git_commit  # noqa: E402  (the script's own checkout: it may run an installed dcache)
from dcache.pipelines import bundled  # noqa: E402
from dcache.pipelines.flow_training import eval_labels, samples  # noqa: E402
from dcache.quality import psnr_per_image  # noqa: E402


def keyframes(ratio: float, steps: int) -> tuple[float, ...]:
    """k = round(ratio * steps) uniform fractions i / k: steps round(i / k * (steps - 1)), the last step not one."""
    k = max(1, round(ratio * steps))
    return tuple(i / k for i in range(k))


def setting(name: str | dict, pipe=None, labels=None, keyframes_=None, seeds=()) -> dict:
    """apply() settings of a contender; L2P is fitted first on `seeds` (generations of `pipe` with the keyframes)."""
    if isinstance(name, str) and name.startswith("taylor-o"):
        return {"order": int(name[-1])}
    if name in ("l2p", "l2p-auto") or (isinstance(name, dict) and name.get("name") == "l2p"):
        from dcache.schedules.tuning.l2p_fit import fit_l2p

        knobs = {**L2P_DEFAULT, **({k: v for k, v in name.items() if k != "name"} if isinstance(name, dict) else {})}
        if name == "l2p-auto":  # the ridge chosen on the first calibration run (fit_l2p's ridge="auto")
            knobs["ridge"] = "auto"
        runs = [lambda seed=seed: generate(pipe, labels, seed) for seed in seeds]
        return {"order": 2, "forecaster": fit_l2p(pipe, runs, "keyframe", keyframes=keyframes_, order=2,
                                                  progress=False, **knobs)}
    return {"order": 2, "forecaster": name}


SWEEP = [{"name": "foca", "calibration": g} for g in (0.25, 0.5, 0.75, 1.0)] + [
    {"name": "spectrum", "degree": d, "ridge": r, "window": w}
    for d, r, w in ((1, 0.01, 4), (1, 0.01, 6), (2, 0.01, 6), (2, 0.1, 6), (2, 1.0, 6), (2, 0.01, 4), (3, 1.0, 6))] + [
    {"name": "hyca", "max_order": m, "backtests": b} for m, b in ((1, 1), (1, 2), (2, 1), (2, 2), (2, 3))] + [
    {"name": "dmd", "window": w, "rank": r} for w, r in ((3, 0), (4, 0), (5, 0), (5, 2), (6, 3))] + [
    {"name": "l2p", "window": w, "ridge": r} for w in (2, 3, 4) for r in (0.0, 0.01, 0.1, 1.0, 10.0)]


def tune(per_class: int, only: set[str] | None = None) -> list[dict]:
    """Every SWEEP setting (of the `only` forecasters) on tiny-digits' tuning batch (seed 0) at both ratios; L2P
    fitted on tuning seeds 1 and 2."""
    pipe = bundled.load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    labels = eval_labels(pipe.num_classes, per_class)
    reference = generate(pipe, labels, 0)
    rows = []
    for spec in SWEEP:
        if only is not None and spec["name"] not in only:
            continue
        row = {"forecaster": spec}
        for ratio in RATIOS:
            frames = keyframes(ratio, pipe.default_steps)
            with dcache.apply(pipe, "keyframe", scope="call", keyframes=frames,
                              **setting(spec, pipe, labels, frames, L2P_SEEDS["tune"])):
                row[str(ratio)] = statistics.mean(psnr_per_image(generate(pipe, labels, 0), reference).tolist())
        row["mean"] = statistics.mean(row[str(r)] for r in RATIOS)
        rows.append(row)
        print(f"tune {spec} {row['mean']:.2f} dB", file=sys.stderr)
    return rows


def generate(pipe, labels: list[int], seed: int) -> torch.Tensor:
    out = pipe(labels=labels, generator=torch.Generator().manual_seed(seed), output_type="pt")
    x = samples(out).float()
    return x if x.ndim == 4 else x.flatten(1, 2)  # a clip's frames as channels: PSNR over the whole clip


def run_model(name: str, seeds: list[int], per_class: int) -> list[dict]:
    pipe = getattr(bundled, MODELS[name][0])()
    pipe.set_progress_bar_config(disable=True)
    labels = eval_labels(pipe.num_classes, per_class)
    reference = {seed: generate(pipe, labels, seed) for seed in seeds}
    steps = pipe.default_steps
    rows = []
    for ratio in RATIOS:
        for contender in FORECASTERS:
            start = time.perf_counter()
            frames = keyframes(ratio, steps)
            with dcache.apply(pipe, "keyframe", scope="call", keyframes=frames,
                              **setting(contender, pipe, labels, frames, L2P_SEEDS["report"])) as handle:
                psnrs = []
                for seed in seeds:
                    psnrs += psnr_per_image(generate(pipe, labels, seed), reference[seed]).tolist()
                compute = handle.stats().compute_ratio
            rows.append({"model": name, "target_ratio": ratio, "forecaster": contender, "compute_ratio": compute,
                         "psnr": statistics.mean(psnrs), "psnr_min": min(psnrs), "samples": len(psnrs),
                         "seconds": round(time.perf_counter() - start, 1)})
            print(f"{name} ratio {compute:.3f} {contender:10s} {rows[-1]['psnr']:.2f} dB", file=sys.stderr)
    return rows


def table(rows: list[dict], models: list[str]) -> str:
    lines = ["| model | compute ratio | " + " | ".join(FORECASTERS) + " |", "|---|---|" + "---|" * len(FORECASTERS)]
    for model in models:
        for ratio in RATIOS:
            cells = {r["forecaster"]: r for r in rows if r["model"] == model and r["target_ratio"] == ratio}
            if not cells:
                continue
            best = max(c["psnr"] for c in cells.values())
            values = [f"**{cells[f]['psnr']:.2f}**" if cells[f]["psnr"] == best else f"{cells[f]['psnr']:.2f}"
                      for f in FORECASTERS]
            ratio_cell = f"{next(iter(cells.values()))['compute_ratio']:.3f}"
            lines.append(f"| {model} | {ratio_cell} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {sorted(MODELS)}.")
    torch.set_num_threads(args.threads)
    seeds = [1000 + s for s in range(args.seeds)]
    start = time.perf_counter()
    command = "python benchmarks/forecasters.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    commit = _git_commit(Path(__file__).resolve().parents[1])
    if args.tune:
        only = None if args.only is None else {n.strip() for n in args.only.split(",") if n.strip()}
        rows = tune(args.per_class, only)
        data = {"command": command.strip(), "git_commit": commit, "model": "digits", "seed": 0,
                "ratios": list(RATIOS), "rows": rows, "seconds": round(time.perf_counter() - start)}
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "" if only is None else "_" + "_".join(sorted(only))
        (args.out / f"forecasters_tuning{suffix}.json").write_text(json.dumps(data, indent=1) + "\n")
        return data
    rows = [row for model in models for row in run_model(model, seeds, args.per_class)]
    data = {"command": command.strip(), "git_commit": commit, "seeds": seeds, "per_class": args.per_class,
            "models": {m: MODELS[m][1] for m in models}, "schedule": "keyframe, scope='call', uniform keyframes i/k",
            "machine": f"{platform.machine()} CPU, {args.threads} threads",
            "seconds": round(time.perf_counter() - start), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forecasters.json").write_text(json.dumps(data, indent=1) + "\n")
    md = (f"Held-out PSNR (dB) vs uncached, keyframe schedule in call scope with uniform keyframes, seeds {seeds}, "
          f"every class x {args.per_class}; best of a row in bold.\n\n{table(rows, models)}\n\n`{data['command']}`\n")
    (args.out / "forecasters.md").write_text(md)
    print(md)
    return data


if __name__ == "__main__":
    main()
