"""Placement without a search: adaptive_keyframe against uniform keyframes on the three bundled models.

    python benchmarks/adaptive.py --out benchmarks/results/adaptive      # ~15 min on 2 shared cores
    python benchmarks/adaptive.py --quick                                # tiny-digits, 8 steps, 1 seed (smoke)

For each bundled model (tiny-digits: Flux, split CFG 1.5; tiny-motion: Wan video, UniPC, split CFG 5; tiny-shapes:
SD3, batched CFG 4) and each compute ratio (0.25, 0.2, 0.143), uniform keyframes computing the same number of steps
per branch (k = round(ratio * N), at 0, 1/(k-1), ..., 1: what a user without a search would pick) beside
`adaptive_keyframe` at that ratio, plus `adaptive_keyframe` with an error tolerance (0.1) instead of a ratio; all in
call scope, order 2. No knob of either was chosen on these models (the tolerance and the gap rule are the method's
defaults, picked from the error magnitudes of tiny-digits' tuning batch). Protocol of benchmarks/transfer.py: one
unmeasured generation first, then held-out seeds 1000.. (every class x 2), PSNR against the uncached samples, compute
ratio from the block meter. Writes <out>/adaptive.json and adaptive.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

SCRATCH = Path(__file__).resolve().parent / "out"
RATIOS = (0.25, 0.2, 0.143)
TOLERANCE = 0.1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2, help="held-out seeds per model")
    ap.add_argument("--quick", action="store_true", help="tiny-digits, 8 steps, 1 seed, one ratio: the code path")
    ap.add_argument("--out", type=Path, default=SCRATCH, help="folder for adaptive.json / adaptive.md")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peers  # noqa: E402
import transfer  # noqa: E402  (the held-out protocol)

from dcache.eval.runner import _git_commit  # noqa: E402
from dcache.files.atomic import atomic_write_text  # noqa: E402


def uniform_keyframes(k: int) -> tuple[float, ...]:
    return tuple(i / (k - 1) for i in range(k)) if k > 1 else (0.0,)


def rows_for(model_name: str, seeds: int, steps: int | None, ratios: tuple[float, ...]) -> list[dict]:
    model = transfer.load_model(model_name, seeds, per_class=2)
    meter = _peers.BlockMeter(model.pipe.transformer)
    transfer.uncached(model, meter, steps)
    n = model.pipe.num_timesteps  # the step count the model's default run used
    contenders = []
    for ratio in ratios:
        k = max(2, round(ratio * n))
        contenders.append((ratio, transfer.dcache_contender(f"uniform keyframes, {k} per branch", "keyframe",
                                                            "untuned", keyframes=uniform_keyframes(k), scope="call")))
        contenders.append((ratio, transfer.dcache_contender(f"adaptive_keyframe compute_ratio={ratio}",
                                                            "adaptive_keyframe", "untuned", compute_ratio=ratio,
                                                            scope="call")))
    contenders.append((None, transfer.dcache_contender(f"adaptive_keyframe tolerance={TOLERANCE}", "adaptive_keyframe",
                                                       "tiny-digits error magnitudes", compute_ratio=None,
                                                       tolerance=TOLERANCE, scope="call")))
    rows = []
    for ratio, contender in contenders:
        row = transfer.measure(model, contender, meter, steps)
        row.update(target_ratio=ratio, steps=n)
        rows.append(row)
        print(f"[tiny-{model_name}] {contender.name:45s} ratio {row.get('compute_ratio', float('nan')):.3f} "
              f"PSNR {row.get('psnr', float('nan')):.2f}", flush=True)
    meter.remove()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | target ratio | contender (call scope) | compute ratio | PSNR dB (mean) | PSNR min |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        target = "–" if r["target_ratio"] is None else f"{r['target_ratio']:g}"
        if "error" in r:
            lines.append(f"| tiny-{r['model']} | {target} | {r['contender']} | – | did not run: {r['error'][:100]} "
                         f"| – |")
            continue
        lines.append(f"| tiny-{r['model']} ({r['steps']} steps) | {target} | {r['contender']} | "
                     f"{r['compute_ratio']:.3f} | {r['psnr']:.2f} | {r['psnr_min']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        rows = rows_for("digits", 1, 8, (0.25,))
    else:
        rows = [r for name in ("digits", "motion", "shapes") for r in rows_for(name, args.seeds, None, RATIOS)]
    command = "python benchmarks/adaptive.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = {"command": command.strip(), "git_commit": _git_commit(Path(__file__).resolve().parents[1]),
              "seeds": args.seeds, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "adaptive.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(args.out / "adaptive.md", table(rows) + "\n")
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
