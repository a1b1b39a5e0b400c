"""Quality of dcache caches on the bundled model loaded in bfloat16 (as users load big models on GPUs).

    python benchmarks/half_precision.py [--steps 28] [--seeds 4]

For each method at its default setting: PSNR of the bf16 cached images against the bf16 uncached ones (what caching
costs in bf16) and against the fp32 uncached ones (bf16 rounding and caching together), next to the fp32 cached
PSNR. Labels 0-9, seeds 0..N-1, split CFG at the bundled default guidance.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--methods", default="magcache,fbcache,seacache-cadence,taylorseer-lite")
    args = parser.parse_args()

    import torch

    import dcache
    from dcache.eval.metrics import psnr_per_image
    from dcache.pipelines.bundled import load_tiny_pipeline

    torch.set_num_threads(1)
    labels = list(range(10))

    def images(pipe, seed):
        return pipe(labels=labels, num_inference_steps=args.steps, output_type="pt",
                    generator=torch.Generator().manual_seed(seed)).images.float()

    pipes = {"fp32": load_tiny_pipeline(), "bf16": load_tiny_pipeline(dtype=torch.bfloat16)}
    seeds = range(args.seeds)
    uncached = {k: [images(p, s) for s in seeds] for k, p in pipes.items()}
    print(f"bundled model, {args.steps} steps, seeds 0..{args.seeds - 1} x labels 0-9")
    print("| method | compute ratio (bf16) | PSNR bf16 cached vs bf16 uncached | vs fp32 uncached | "
          "fp32 cached vs fp32 uncached |")
    print("|---|---|---|---|---|")
    base = torch.cat([psnr_per_image(b, f) for b, f in zip(uncached["bf16"], uncached["fp32"])]).mean()
    print(f"| (uncached bf16) | 1.000 | inf | {base:.2f} | inf |")
    for method in args.methods.split(","):
        row = {}
        for kind, pipe in pipes.items():
            with dcache.apply(pipe, method) as handle:
                cached = [images(pipe, s) for s in seeds]
                row[kind] = (handle.stats().compute_ratio, cached)
        ratio, bf16 = row["bf16"]
        vs_bf16 = torch.cat([psnr_per_image(c, u) for c, u in zip(bf16, uncached["bf16"])]).mean()
        vs_fp32 = torch.cat([psnr_per_image(c, u) for c, u in zip(bf16, uncached["fp32"])]).mean()
        fp32 = torch.cat([psnr_per_image(c, u) for c, u in zip(row["fp32"][1], uncached["fp32"])]).mean()
        print(f"| {method} | {ratio:.3f} | {vs_bf16:.2f} | {vs_fp32:.2f} | {fp32:.2f} |")


if __name__ == "__main__":
    main()
