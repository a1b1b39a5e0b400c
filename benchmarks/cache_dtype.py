"""Low-precision caches on the bundled model at equal decisions: PSNR against the full-precision cache, memory saved.

    python benchmarks/cache_dtype.py [--steps 10] [--seeds 2] [--out DIR]
                                     [--methods magcache,fbcache:threshold=0.4,taylorseer,seacache-cadence]

A method is a name with optional config fields, `name:key=value:key=value` (fbcache's default threshold reuses
nothing on the bundled model at 10 steps, hence 0.4). Per method and seed: one run with the method itself
(fp32 cache) records its decisions as a plan
(handle.plan()); the plan is then replayed with the fp32 cache (the reference) and with each cache_dtype, so every
run takes the same decisions and only the cache's precision differs. Reported per method and cache dtype: the mean
PSNR (dB, images in [0, 1]) of the low-precision replay against the fp32 replay, and the peak cached-unit bytes
(handle.memory(), signal references excluded) with the fraction saved. Labels 0-9, split CFG at the bundled default
guidance. Writes cache_dtype.json and cache_dtype.md to --out (default: benchmarks/out, git-ignored scratch).
"""

from __future__ import annotations

import argparse
from pathlib import Path

CODECS = [("bfloat16", None), ("float16", None), ("float8_e4m3fn", "tensor"), ("float8_e4m3fn", "token")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--methods", default="magcache,fbcache:threshold=0.4,taylorseer,seacache-cadence")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()

    import json

    import torch

    import dcache
    from dcache.eval.metrics import psnr_per_image
    from dcache.files.atomic import atomic_write_text
    from dcache.pipelines.bundled import load_tiny_pipeline

    torch.set_num_threads(1)
    pipe = load_tiny_pipeline()
    labels = list(range(10))

    def images(seed):
        return pipe(labels=labels, num_inference_steps=args.steps, output_type="pt",
                    generator=torch.Generator().manual_seed(seed)).images.float()

    def replay(plan, seed, **codec):
        with dcache.apply(pipe, plan, **codec) as handle:
            out = images(seed)
            kinds = handle.memory().by_kind
        return out, sum(n for k, n in kinds.items() if k != "signals"), handle.stats().compute_ratio

    rows = []
    for method in args.methods.split(","):
        psnrs: dict[str, list[float]] = {}
        nbytes: dict[str, int] = {}
        ratios = []
        for seed in range(args.seeds):
            name, *fields = method.split(":")
            config = {k: json.loads(v) for k, v in (f.split("=", 1) for f in fields)}
            with dcache.apply(pipe, name, **config) as handle:
                images(seed)
                plan = handle.plan()
            reference, nbytes["float32"], ratio = replay(plan, seed)
            ratios.append(ratio)
            for dtype, scale in CODECS:
                name = f"{dtype}/{scale}" if scale else dtype
                out, nbytes[name], _ = replay(plan, seed, cache_dtype=dtype, cache_scale=scale)
                psnrs.setdefault(name, []).append(psnr_per_image(out, reference).mean().item())
        rows.append({"method": method, "compute_ratio": sum(ratios) / len(ratios), "cache_bytes": nbytes,
                     "psnr_vs_fp32_cache": {k: sum(v) / len(v) for k, v in psnrs.items()}})
        print(json.dumps(rows[-1]), flush=True)

    names = [f"{d}/{s}" if s else d for d, s in CODECS]
    lines = [f"bundled model, {args.steps} steps, seeds 0..{args.seeds - 1} x labels 0-9, each method's own "
             f"decisions replayed as a plan", "",
             "| method | compute ratio | fp32 cache | " + " | ".join(f"{n}: PSNR dB / bytes (saved)" for n in names)
             + " |", "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        full = r["cache_bytes"]["float32"]
        saved = {n: f"{1 - r['cache_bytes'][n] / full:.0%}" if full else "nothing cached" for n in names}
        cells = [f"{r['psnr_vs_fp32_cache'][n]:.2f} / {_kib(r['cache_bytes'][n])} ({saved[n]})" for n in names]
        lines.append(f"| {r['method']} | {r['compute_ratio']:.3f} | {_kib(full)} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "cache_dtype.md", table)
    atomic_write_text(args.out / "cache_dtype.json", json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}/cache_dtype.md and cache_dtype.json")


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB"


if __name__ == "__main__":
    main()
