"""Settings tuned on one bundled model, measured on the others: do dcache's presets and defaults transfer?

    python benchmarks/transfer.py --out benchmarks/results/transfer      # every model (~25 min on 2 shared cores)
    python benchmarks/transfer.py --models motion --seeds 2               # one model, fewer held-out seeds
    python benchmarks/transfer.py --quick                                 # 2 contenders, 1 seed, 6 steps (smoke)

Each preset and default of dcache was chosen on one model (the "tuned on" column): the keyframe and SeaCache
presets on tiny-digits' tuning batch, dbcache on FLUX.1-dev by cache-dit, the fbcache threshold and diffusers'
FirstBlockCache default by their authors. Each row runs it unchanged on each bundled model (tiny-digits: Flux,
tiny-motion: Wan video with UniPC and split CFG 5, tiny-shapes: SD3 with batched CFG 4) beside the untuned form of
the same method at a matching compute ratio (uniform keyframes), and diffusers' own caches as a user would apply
them (`transformer.enable_cache`; SD3's transformer has none, so they cannot run there).

Protocol, per model and contender (one pipeline object; caches put on and taken off in turn):
  * one tuning generation (seed 0, every class) with the cache on and not measured: a self-calibrating method
    (MagCache on a model without a shipped curve) calibrates there, as it would on a user's first generation;
  * held-out generations: seeds 1000.. (`--seeds`), each a batch of every class x `--per-class`, at the model's
    default steps and guidance; PSNR of every sample against the uncached sample of the same seed (frames of a
    clip taken together), the judge's accuracy (the label it reads is the one asked for);
  * compute ratio = block FLOPs executed / block FLOPs of the uncached generations, counted by the same meter for
    every library (`_peers.BlockMeter`);
  * after each contender the uncached output must come back bit-identical (checked; a failure is recorded).
Writes <out>/transfer.json and transfer.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

SCRATCH = Path(__file__).resolve().parent / "out"
MODELS = ("digits", "motion", "shapes")  # benchmarks/_models.py describes each


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--seeds", type=int, default=None, help="held-out seeds (default 4; --quick 1)")
    ap.add_argument("--per-class", type=int, default=2, help="samples of each class per seed")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: each model's; --quick 6)")
    ap.add_argument("--quick", action="store_true", help="2 contenders, 1 seed, 6 steps: checks the code path")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=SCRATCH, help="folder for transfer.json / transfer.md")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch loads

# the heavy imports come after that argument check on purpose, hence the E402 exemptions
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peers  # noqa: E402  (benchmarks/_peers.py: the block meter)
from _models import MODELS as BUNDLED  # noqa: E402  (benchmarks/_models.py: loaders, judges, families)

import dcache  # noqa: E402
from dcache.eval.runner import _git_commit  # noqa: E402  (the script's own checkout: it may run an installed dcache)
from dcache.pipelines.flow_training import eval_labels, samples  # noqa: E402
from dcache.quality import psnr_per_image  # noqa: E402



@dataclass(frozen=True)
class Contender:
    library: str
    name: str
    tuned_on: str  # where its setting was chosen
    enable: Callable[[Any], Callable[[], None]]  # pipe -> remove()
    note: str = ""


# one decision per batched call, as the methods sweep (benchmarks/methods.py DECISIONS) and the committed tables
# measured it: every row here runs a batch of labels, and per-sample decisions have their own benchmark
# (benchmarks/per_sample.py)
DECISIONS = "batch"


def dcache_contender(name: str, spec: str | None, tuned_on: str, note: str = "", **settings) -> Contender:
    settings = {"decisions": DECISIONS, **settings}

    def enable(pipe):
        handle = dcache.apply(pipe, spec, **settings) if spec is not None else dcache.apply(pipe, **settings)
        return handle.remove

    return Contender("dcache", name, tuned_on, enable, note)


def diffusers_contender(name: str, make_config: Callable[[], Any], tuned_on: str, note: str = "") -> Contender:
    def enable(pipe):
        if not hasattr(pipe.transformer, "enable_cache"):
            raise RuntimeError(f"{type(pipe.transformer).__name__} has no enable_cache (not a diffusers CacheMixin): "
                               f"diffusers' caches cannot be applied to it")
        return _peers.enable_diffusers_cache(pipe, make_config()).remove

    return Contender("diffusers", name, tuned_on, enable, note)


def contenders(quick: bool) -> list[Contender]:
    from diffusers import FirstBlockCacheConfig

    rows = [
        dcache_contender("cadence-2x (the default method)", None, "all three bundled models "
                         "(benchmarks/default_choice.py)"),
        dcache_contender("magcache at its defaults", "magcache", "shipped curve: tiny-digits; else this model's "
                         "tuning generation (self-calibration)"),
        dcache_contender("fbcache (default threshold 0.08)", "fbcache", "FLUX.1-dev literature default"),
    ]
    if quick:
        return rows
    rows += [
        dcache_contender("dbcache preset (F8B0 W8 R0.08)", "dbcache", "FLUX.1-dev (cache-dit's default)"),
        dcache_contender("seacache-cadence preset, order 2, call scope", "seacache-cadence", "tiny-digits",
                         order=2, scope="call"),
        dcache_contender("keyframe-5x preset, call scope", "keyframe-5x", "tiny-digits", scope="call"),
        dcache_contender("uniform keyframes 0, 0.2, ..., 1 (untuned), call scope", "keyframe", "untuned",
                         scope="call"),
        dcache_contender("keyframe-8x preset, call scope", "keyframe-8x", "tiny-digits", scope="call"),
        dcache_contender("keyframe-8x preset + cfg_difference, call scope", "keyframe-8x", "tiny-digits",
                         scope="call", cfg_difference=True),
        dcache_contender("uniform keyframes 0, 1/3, 2/3, 1 (untuned), call scope", "keyframe", "untuned",
                         scope="call", keyframes=(0.0, 1 / 3, 2 / 3, 1.0)),
        diffusers_contender("FirstBlockCache (default threshold 0.05)", lambda: FirstBlockCacheConfig(threshold=0.05),
                            "diffusers' default"),
    ]
    return rows


# ------------------------------------------------------------------------------------------------ measurement
@dataclass
class Model:
    name: str
    pipe: Any
    judge: Any
    labels: list[int]
    seeds: list[int]
    reference: dict[int, torch.Tensor] = field(default_factory=dict)  # seed -> uncached samples
    flops: float = 0.0  # block FLOPs of the uncached held-out generations


def generate(pipe, labels: list[int], seed: int, steps: int | None, **call: Any) -> torch.Tensor:
    """The samples of one pipeline call; `call`: more pipeline arguments (e.g. guidance_scale)."""
    kwargs = {} if steps is None else {"num_inference_steps": steps}
    out = pipe(labels=labels, generator=torch.Generator().manual_seed(seed), output_type="pt", **kwargs, **call)
    return samples(out).float()


def as_images(x: torch.Tensor) -> torch.Tensor:
    """Samples [B, 3, H, W] or clips [B, F, 3, H, W] -> [B, C, H, W] (a clip's frames stacked as channels)."""
    return x if x.ndim == 4 else x.flatten(1, 2)


def psnrs_against(outputs: dict[int, torch.Tensor], references: dict[int, torch.Tensor]) -> list[float]:
    """PSNR of every sample of `outputs` (seed -> samples) against the sample of the same seed in `references`."""
    return [p for seed, out in outputs.items()
            for p in psnr_per_image(as_images(out), as_images(references[seed])).tolist()]


def mean_psnr(psnrs: list[float]) -> float:
    """Mean over the finite PSNRs (a sample identical to its reference is +inf); +inf when all are."""
    finite = [p for p in psnrs if math.isfinite(p)]
    return statistics.mean(finite) if finite else math.inf


def load_model(name: str, seeds: int, per_class: int) -> Model:
    spec = BUNDLED[name]
    pipe = spec.load()
    return Model(name, pipe, spec.load_judge(), eval_labels(pipe.num_classes, per_class),
                 [1000 + s for s in range(seeds)])


def uncached(model: Model, meter: _peers.BlockMeter, steps: int | None, **call: Any) -> None:
    meter.reset()
    with meter.count():
        for seed in model.seeds:
            model.reference[seed] = generate(model.pipe, model.labels, seed, steps, **call)
    model.flops = meter.flops


def measure(model: Model, contender: Contender, meter: _peers.BlockMeter, steps: int | None,
            outputs: dict[int, torch.Tensor] | None = None, **call: Any) -> dict:
    """One contender's row; `outputs` (optional) receives its held-out samples, seed -> tensor."""
    row: dict[str, Any] = {"model": model.name, "library": contender.library, "contender": contender.name,
                           "tuned_on": contender.tuned_on}
    start = time.perf_counter()
    try:
        remove = contender.enable(model.pipe)
    except Exception as exc:  # noqa: BLE001 - a contender that cannot run on this model is a finding, not a crash
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    try:
        generate(model.pipe, model.labels, 0, steps, **call)  # the tuning generation (self-calibration), unmeasured
        meter.reset()
        outputs = {} if outputs is None else outputs
        with meter.count():
            for seed in model.seeds:
                outputs[seed] = generate(model.pipe, model.labels, seed, steps, **call)
        psnrs = psnrs_against(outputs, model.reference)
        correct = sum(int((model.judge.predict(out) == torch.tensor(model.labels)).sum()) for out in outputs.values())
        row.update(compute_ratio=meter.flops / model.flops, psnr=mean_psnr(psnrs),
                   psnr_min=min(psnrs), accuracy=correct / (len(model.labels) * len(model.seeds)),
                   samples=len(psnrs))
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        remove()
    again = generate(model.pipe, model.labels, model.seeds[0], steps, **call)
    row["restored_bit_identical"] = bool(torch.equal(again, model.reference[model.seeds[0]]))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


# ------------------------------------------------------------------------------------------------ report
def table(rows: list[dict], models: list[str], uncached_accuracy: dict[str, float]) -> str:
    lines = []
    for name in models:
        family = BUNDLED[name].family
        lines += [f"### tiny-{name} ({family}); uncached judge accuracy {uncached_accuracy[name]:.0%}", "",
                  "| contender | tuned on | measured on | compute ratio | PSNR dB (mean) | PSNR min "
                  "| judge accuracy |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["model"] == name):
            label = f"{r['library']}: {r['contender']}"
            if "error" in r:
                lines.append(f"| {label} | {r['tuned_on']} | tiny-{name} | – | did not run: {r['error'][:150]} "
                             f"| – | – |")
                continue
            flag = "" if r["restored_bit_identical"] else " (uncached output changed after removal!)"
            lines.append(f"| {label}{flag} | {r['tuned_on']} | tiny-{name} held-out seeds | {r['compute_ratio']:.3f} "
                         f"| {r['psnr']:.2f} | {r['psnr_min']:.2f} | {r['accuracy']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    seeds = args.seeds or (1 if args.quick else 4)
    steps = args.steps or (6 if args.quick else None)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows, uncached_accuracy, started = [], {}, time.time()
    for name in models:
        model = load_model(name, seeds, 1 if args.quick else args.per_class)
        meter = _peers.BlockMeter(model.pipe.transformer)
        uncached(model, meter, steps)
        hits = sum(int((model.judge.predict(model.reference[s]) == torch.tensor(model.labels)).sum())
                   for s in model.seeds)
        uncached_accuracy[name] = hits / (len(model.labels) * len(model.seeds))
        for contender in contenders(args.quick):
            row = measure(model, contender, meter, steps)
            rows.append(row)
            shown = row.get("error") or (f"ratio {row['compute_ratio']:.3f}  PSNR {row['psnr']:.2f} dB  "
                                         f"accuracy {row['accuracy']:.0%}")
            print(f"[tiny-{name}] {contender.library}: {contender.name:58s} {shown}", flush=True)
        meter.remove()

    command = "python benchmarks/transfer.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    commit = _git_commit(Path(__file__).resolve().parents[1])
    result = {"command": command.strip(), "git_commit": commit, "seeds": seeds,
              "per_class": 1 if args.quick else args.per_class,
              "steps": steps, "threads": args.threads, "torch": torch.__version__, "platform": platform.platform(),
              "seconds": round(time.time() - started), "uncached_accuracy": uncached_accuracy, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    from dcache.files.atomic import atomic_write_text

    atomic_write_text(args.out / "transfer.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(args.out / "transfer.md", f"`{result['command']}`\n\n" + table(rows, models, uncached_accuracy))
    print(f"wrote {args.out / 'transfer.md'}", flush=True)
    return result


if __name__ == "__main__":
    main()
