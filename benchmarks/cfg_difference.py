"""Does `cfg_difference=True` ever make a generation worse than the same setting without it?

    python benchmarks/cfg_difference.py --out benchmarks/results/cfg_difference     # ~8 min, 1 thread
    python benchmarks/cfg_difference.py --quick                                     # 1 model, 1 guidance (smoke)

For each bundled model with split CFG (tiny-digits, tiny-motion) and guidance 2, 4 and 5, the keyframe presets
(keyframe-5x, keyframe-8x; chosen on tiny-digits' tuning batch at CFG 1.5, so tiny-motion has never been seen and
tiny-digits is judged on held-out seeds at guidance it was not tuned at) run in call scope with and without the CFG
difference, on the held-out seeds of benchmarks/transfer.py's protocol (one unmeasured generation first; PSNR of
every sample against the uncached sample of the same seed and guidance; compute ratio from the block meter). One
row runs tiny-shapes (batched CFG: one call for both branches) with the option on, to show it is said to do
nothing there. The `notes` column is what the handle's health said (cfg_difference_fallback: the difference was
measured worse than the branches' own caches and not served).

"With calibration_run" is `cfg_difference=True` with `calibration_run=` one generation of the tuning seed (seed 0,
every class, at the row's guidance; never a held-out seed): that run decides, against its uncached twin, whether
the difference is served at all (schedules/tuning/targets.py, choose_cfg_difference); the notes say what it chose.

"Served calls' error" separates what the difference changes from everything else the preset caches: the PSNR of
each row against a twin of the preset whose uncond branch computes at every cond keyframe (so the uncond calls the
difference would serve are computed there, and nothing else changes). A higher figure with the difference means it
served those calls closer to the computed ones; a lower PSNR against the uncached samples despite that means the
own caches' error at those calls had been cancelling error made earlier in the generation.
Writes <out>/cfg_difference.json and .md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from pathlib import Path

SCRATCH = Path(__file__).resolve().parent / "out"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2, help="held-out seeds per model")
    ap.add_argument("--guidance", default="2,4,5", help="comma-separated guidance scales")
    ap.add_argument("--quick", action="store_true", help="tiny-digits, guidance 2, 1 seed, 8 steps: the code path")
    ap.add_argument("--out", type=Path, default=SCRATCH, help="folder for cfg_difference.json / .md")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peers  # noqa: E402
import transfer  # noqa: E402  (the held-out protocol: load_model, uncached, measure)

import dcache  # noqa: E402
from dcache.eval.runner import _git_commit  # noqa: E402
from dcache.files.atomic import atomic_write_text  # noqa: E402
from dcache.generations.health import DCacheHealthWarning  # noqa: E402

PRESETS = ("keyframe-5x", "keyframe-8x")


def contender(preset: str, cfg_difference: bool, notes: list, calibration_run=None, **knobs) -> transfer.Contender:
    """calibration_run: given, cfg_difference=True is decided on that run (kept only if the sample comes out closer
    to the uncached one); `notes` then also receives "calibration kept it" / "calibration left it off"."""
    def enable(pipe):
        target = {} if calibration_run is None else {"calibration_run": lambda: calibration_run(pipe)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DCacheHealthWarning)  # the choice is read from handle.target below
            handle = dcache.apply(pipe, preset, scope="call", cfg_difference=cfg_difference, **target, **knobs)
        kept = None if calibration_run is None else bool(handle.target.value)

        def remove():
            notes[:] = handle.stats().health.get("notes", [])
            if kept is not None:
                notes.append(f"calibration {'kept it' if kept else 'left it off'}")
            handle.remove()
        return remove

    name = f"{preset}{' + cfg_difference' if cfg_difference else ''}" \
           f"{' (calibrated)' if calibration_run is not None else ''}, call scope"
    return transfer.Contender("dcache", name, "tiny-digits tuning batch, CFG 1.5", enable)


def run(model_name: str, guidance: float, seeds: int, steps: int | None, with_plain: bool = True) -> list:
    """Per preset: without and with the difference, and the twin that computes the uncond calls at every cond
    keyframe (the calls the difference serves, computed): PSNR against the twin is the error of the served calls
    alone, PSNR against the uncached samples that error plus everything else the preset caches."""
    model = transfer.load_model(model_name, seeds, per_class=2)
    meter = _peers.BlockMeter(model.pipe.transformer)
    transfer.uncached(model, meter, steps, guidance_scale=guidance)
    rows = []
    for preset in PRESETS:
        twin: dict = {}
        if with_plain:
            cond = dcache.presets()[preset].overrides["keyframes"]
            transfer.measure(model, contender(preset, False, [], uncond_keyframes=cond), meter, steps, twin,
                             guidance_scale=guidance)
        for cfg in ((False, True, "calibrated") if with_plain else (True,)):
            notes: list = []
            outputs: dict = {}
            calibrate = None if cfg != "calibrated" else (  # the tuning seed (0), never a held-out one
                lambda pipe: transfer.generate(pipe, model.labels, 0, steps, guidance_scale=guidance))
            row = transfer.measure(model, contender(preset, bool(cfg), notes, calibrate), meter, steps, outputs,
                                   guidance_scale=guidance)
            row.update(guidance=guidance, preset=preset, cfg_difference=cfg, notes=list(notes))
            if twin and outputs:
                row["psnr_vs_twin"] = transfer.mean_psnr(transfer.psnrs_against(outputs, twin))
            rows.append(row)
            print(f"{model_name} g={guidance} {row['contender']}: ratio {row.get('compute_ratio', 0):.3f} "
                  f"PSNR {row.get('psnr', float('nan')):.2f} vs twin {row.get('psnr_vs_twin', float('nan')):.2f} "
                  f"{notes}", flush=True)
    meter.remove()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | guidance | preset (call scope) | compute ratio | PSNR without | PSNR with cfg_difference "
             "| with - without | with calibration_run (tuning seed) | calibrated - without "
             "| served calls' error: without | with | health notes |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    pairs: dict[tuple, dict] = {}
    for r in rows:
        pairs.setdefault((r["model"], r["guidance"], r["preset"]), {})[r["cfg_difference"]] = r
    twin = lambda r: f"{r['psnr_vs_twin']:.2f}" if r and "psnr_vs_twin" in r else "–"  # noqa: E731
    for (model, g, preset), pair in pairs.items():
        on, off, calibrated = pair.get(True, {}), pair.get(False), pair.get("calibrated")
        if "error" in on:
            lines.append(f"| tiny-{model} | {g:g} | {preset} | – | – | did not run: {on['error'][:120]} | – | – | – "
                         f"| – | – | – |")
            continue
        base = f"{off['psnr']:.2f}" if off else "–"
        gain = f"{on['psnr'] - off['psnr']:+.2f}" if off else "–"
        chosen = f"{calibrated['psnr']:.2f}" if calibrated and "psnr" in calibrated else "–"
        chosen_gain = f"{calibrated['psnr'] - off['psnr']:+.2f}" if off and calibrated and "psnr" in calibrated \
            else "–"
        notes = on["notes"] + [n for n in (calibrated or {}).get("notes", []) if n.startswith("calibration")]
        lines.append(f"| tiny-{model} | {g:g} | {preset} | {on['compute_ratio']:.3f} | {base} | {on['psnr']:.2f} "
                     f"| {gain} | {chosen} | {chosen_gain} | {twin(off)} | {twin(on)} | {', '.join(notes) or '–'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    guidances = [float(g) for g in args.guidance.split(",")]
    rows: list[dict] = []
    if args.quick:
        rows += run("digits", guidances[0], 1, 8)
    else:
        for name in ("digits", "motion"):
            for g in guidances:
                rows += run(name, g, args.seeds, None)
        rows += run("shapes", 4.0, 1, None, with_plain=False)
    command = "python benchmarks/cfg_difference.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = {"command": command.strip(), "git_commit": _git_commit(Path(__file__).resolve().parents[1]),
              "seeds": args.seeds, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "cfg_difference.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(args.out / "cfg_difference.md", f"`{result['command']}` (commit {result['git_commit']})\n\n"
                      f"{table(rows)}\n")
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
