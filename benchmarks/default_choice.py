"""Which method should `dcache.apply(pipe)` use? Each candidate at its defaults, on every bundled model, against
the best dcache setting of that model's methods sweep at the same or lower compute ratio.

    python benchmarks/default_choice.py --out benchmarks/results      # every model (~25 min on 2 shared cores)
    python benchmarks/default_choice.py --models motion --only seacache   # one model, some candidates
    python benchmarks/default_choice.py --rerun "^magcache" --out benchmarks/results   # remeasure, keep the rest

A user who writes `dcache.apply(pipe)` tunes nothing, so the default must hold on models nobody tuned it on. Per
model (tiny-digits: Flux, split CFG 1.5; tiny-motion: Wan video, UniPC, split CFG 5; tiny-shapes: SD3, batched CFG
4) each candidate runs exactly as `dcache.apply(pipe, method, **knobs)` with no calibration beyond its own (MagCache
calibrates on its first generation where no curve is shipped), under the protocol of benchmarks/methods.py: the
same held-out seeds and labels as that model's sweep (read from benchmarks/results/methods_<model>.json), PSNR of
the held-out samples against the uncached ones, compute ratio on the tuning batch's second generation with the cache
on (the first, not measured, is where a self-calibrating method calibrates).

**Gap** = the best held-out PSNR of the sweep's dcache rows whose compute ratio is at most the candidate's (x 1.02)
minus the candidate's PSNR: how much a user loses by taking the default instead of the best tuned dcache setting
that computes no more. The sweep's rows sit at bands 0.75 / 0.5 / 0.33 / 0.25, so a candidate between bands is
compared with the band below it (a conservative gap). A default must also save compute: **eligible** = compute
ratio <= 0.65 on every model. The choice: the eligible candidate with the smallest worst gap over the models.

Writes <out>/default_choice.json and default_choice.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
MODELS = ("digits", "motion", "shapes")
MAX_RATIO = 0.65  # a default that computes more than this saves too little to be worth being the default
RATIO_SLACK = 1.02  # sweep rows up to 2 % above the candidate's ratio count as "the same compute"

# name -> (method, knobs): every knob at its default unless named here; the scopes a user can pick in one word
CANDIDATES: dict[str, tuple[str, dict]] = {
    "magcache": ("magcache", {}),
    "magcache order 1": ("magcache", {"order": 1}),
    "seacache": ("seacache", {}),
    "seacache order 2": ("seacache", {"order": 2}),
    "seacache order 2, call scope": ("seacache", {"order": 2, "scope": "call"}),
    # a fixed cadence: compute every other step (first and last computed), a quadratic forecast between, whole calls
    "cadence 1+1, order 2, call scope": ("seacache", {"gate": False, "max_consecutive": 1, "order": 2,
                                                      "scope": "call"}),
    "taylorseer": ("taylorseer", {}),
    "easycache": ("easycache", {}),
    "fbcache": ("fbcache", {}),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--only", default=None, help="regex on the candidate names")
    ap.add_argument("--rerun", default=None, help="regex on the candidate names: measure these again and keep the "
                                                  "other rows of <out>/default_choice.json")
    ap.add_argument("--repeats", type=int, default=3, help="timed batch-1 runs per row")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "out", help="folder for default_choice.{md,json}")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    return args


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad arguments answer here, before torch and diffusers load

import torch  # noqa: E402


def _load_script(stem: str):
    """benchmarks/<stem>.py by path (benchmarks/ is not a package)."""
    name = f"dcache_benchmark_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


methods = _load_script("methods")
peers = methods.peers


def sweep_of(model: str) -> dict:
    """The committed methods sweep of a model (its held-out seeds and its dcache rows)."""
    stem = "methods" if model == "digits" else f"methods_{model}"
    path = methods.RESULTS / f"{stem}.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing; run `python benchmarks/methods.py --model {model} --out "
                         f"benchmarks/results` first (the gaps are measured against its rows).")
    return json.loads(path.read_text())


def best_at_most(sweep: dict, ratio: float) -> dict | None:
    """The sweep's dcache row of highest held-out PSNR among those computing at most `ratio` (x RATIO_SLACK)."""
    rows = [dict(row, method=r["method"]) for r in sweep["results"] if r["library"] == "dcache"
            for row in r["rows"] if row["ratio"] <= ratio * RATIO_SLACK and math.isfinite(row["psnr_heldout"])]
    return max(rows, key=lambda row: row["psnr_heldout"], default=None)


def candidate(name: str) -> peers.Contender:
    import dcache

    method, knobs = CANDIDATES[name]

    def enable(pipe, _setting):
        handle = dcache.apply(pipe, method, **knobs)

        def ratio():
            try:
                return float(handle.stats().compute_ratio)
            except Exception:  # no generation yet
                return None

        return peers.Applied(remove=handle.remove, compute_ratio=ratio)

    return peers.Contender("dcache", name, None, enable)


def warm_point(sweeper, c: peers.Contender) -> dict:
    """The candidate's tuning-batch point after one unmeasured generation with the cache on: a self-calibrating
    method (MagCache without a shipped curve) calibrates there, as on a user's first generation, and the measured
    second generation shows what it then computes."""
    b = sweeper.bench
    applied = c.enable(b.pipe, {})
    try:
        b.tune(b.pipe, c.cfg_mode)  # warm-up, not measured
        with b.meter.count():
            images = b.tune(b.pipe, c.cfg_mode)
    finally:
        applied.remove()
    ref = b.refs[("tune", c.cfg_mode)]
    point = dict(setting={}, text="", ratio=b.meter.flops / b.refs[("tune_flops", c.cfg_mode)], lib_ratio=None,
                 metered=True, psnr=methods.psnr(images, ref), ssim=methods.ssim(images, ref))
    sweeper.log(f"    {c.label:28s} second tuning generation: ratio {point['ratio']:.3f}  PSNR {point['psnr']:.2f}")
    return point


def run_model(model: str, names: list[str], repeats: int, log) -> dict:
    sweep = sweep_of(model)
    meta = sweep["meta"]
    bench = methods.Bench(steps=meta["steps"], tune_labels=None, heldout_seeds=meta["heldout_seeds"],
                          repeats=repeats, seed_labels=meta["seed_labels"], model=methods.models.MODELS[model])
    bench.load()
    log(f"== {bench.model.title}: {meta['steps']} steps, {bench.mode} CFG, held-out seeds {meta['heldout_seeds']}")
    bench.references({bench.mode}, fd_floor=False)
    sweeper = methods.Sweeper(bench, log)
    rows = []
    for name in names:
        c = candidate(name)
        c.cfg_mode = bench.mode
        try:
            row = sweeper.full(c, None, warm_point(sweeper, c))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run on a model is a finding
            log(f"  !! {name}: {type(exc).__name__}: {exc}")
            rows.append(dict(method=name, error=f"{type(exc).__name__}: {exc}"))
            continue
        best = best_at_most(sweep, row["ratio"])
        row["best"] = None if best is None else {k: best[k] for k in ("method", "setting", "ratio", "psnr_heldout")}
        row["gap"] = None if best is None else best["psnr_heldout"] - row["psnr_heldout"]
        row["restored"] = sweeper.check_restored(c)
        rows.append(row)
    return dict(model=model, title=bench.model.title, steps=meta["steps"], mode=bench.mode,
                heldout_seeds=meta["heldout_seeds"], sweep_command=meta["command"], rows=rows)


def choose(data: dict) -> dict:
    """Per candidate: worst gap and largest ratio over the models; the eligible one with the smallest worst gap."""
    summary = {}
    for name in {row["method"] for m in data["models"] for row in m["rows"]}:
        rows = [row for m in data["models"] for row in m["rows"] if row["method"] == name]
        ok = [row for row in rows if "error" not in row and row.get("gap") is not None]
        if len(ok) < len(data["models"]):
            summary[name] = dict(eligible=False, reason="did not run on every model")
            continue
        worst = max(row["gap"] for row in ok)
        top = max(row["ratio"] for row in ok)
        summary[name] = dict(worst_gap=worst, max_ratio=top, eligible=top <= MAX_RATIO,
                             reason="" if top <= MAX_RATIO else f"computes {top:.3f} > {MAX_RATIO} on some model")
    eligible = [n for n, s in summary.items() if s["eligible"]]
    chosen = min(eligible, key=lambda n: (summary[n]["worst_gap"], summary[n]["max_ratio"]), default=None)
    return dict(per_candidate=summary, chosen=chosen)


def write_report(data: dict, out: Path) -> Path:
    from dcache.files.atomic import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    meta = data["meta"]
    lines = ["# The default method: each candidate at its defaults on every bundled model", "", "```",
             meta["command"], "```", "",
             f"Commit {meta['git_commit']} · {meta['date']} · {meta['runtime_s'] / 60:.1f} min · 1 torch thread · "
             f"load average {meta['load_start']} at the start, {meta.get('load_end', '?')} at the end."
             + (f" Rows of `{meta['rerun']['pattern']}` measured by this command; the others kept from "
                f"`{meta['rerun']['kept_from']['command']}` (commit {meta['rerun']['kept_from']['git_commit']}, "
                f"{meta['rerun']['kept_from']['date']})." if meta.get("rerun") else ""), "",
             "**Tuned on:** nothing (every knob at its default). **Measured on:** each model's held-out seeds of its "
             "methods sweep. **Gap** = best sweep dcache row computing at most as much (x 1.02) minus the candidate; "
             f"**eligible** = compute ratio <= {MAX_RATIO} on every model.", ""]
    for m in data["models"]:
        lines += [f"## {m['title']}: {m['steps']} steps, {m['mode']} CFG", "",
                  "| candidate | compute ratio | held-out PSNR | best sweep row at <= that ratio | gap (dB) | "
                  "b1 measured/ideal |", "|---|---|---|---|---|---|"]
        for row in m["rows"]:
            if "error" in row:
                lines.append(f"| {row['method']} | — | did not run: {row['error'][:120]} | — | — | — |")
                continue
            best = row["best"]
            shown = "—" if best is None else (f"{best['psnr_heldout']:.2f} dB · {best['method']} "
                                              f"({best['setting']}) @ {best['ratio']:.3f}")
            gap = "—" if row["gap"] is None else f"{row['gap']:+.2f}"
            lines.append(f"| {row['method']} | {row['ratio']:.3f} | {row['psnr_heldout']:.2f} | {shown} | {gap} | "
                         f"{row['b1_meas_over_ideal']:.2f} |")
        lines.append("")
    choice = data["choice"]
    lines += ["## Over the models", "", "| candidate | worst gap (dB) | largest compute ratio | eligible |",
              "|---|---|---|---|"]
    ranked = sorted(choice["per_candidate"].items(), key=lambda kv: kv[1].get("worst_gap", math.inf))
    for name, s in ranked:
        worst = f"{s['worst_gap']:+.2f}" if "worst_gap" in s else "—"
        top = f"{s['max_ratio']:.3f}" if "max_ratio" in s else "—"
        lines.append(f"| {name} | {worst} | {top} | {'yes' if s['eligible'] else 'no: ' + s['reason']} |")
    lines += ["", f"Chosen: **{choice['chosen']}**." if choice["chosen"] else "No candidate is eligible.", ""]
    notes = methods.RESULTS / "default_choice_notes.md"
    if notes.is_file():
        lines += [notes.read_text().rstrip(), ""]
    md = out / "default_choice.md"
    atomic_write_text(out / "default_choice.json", json.dumps(data, indent=1, default=methods._json_default) + "\n")
    atomic_write_text(md, "\n".join(lines))
    return md


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)

    from dcache.eval.runner import _git_commit

    pattern = args.rerun or args.only
    names = [n for n in CANDIDATES if not pattern or re.search(pattern, n)]
    previous = {}
    if args.rerun and (args.out / "default_choice.json").is_file():  # the rows this run does not measure again
        old = json.loads((args.out / "default_choice.json").read_text())
        previous = {m["model"]: m for m in old["models"]}
    command = "python benchmarks/default_choice.py" + "".join(
        " " + shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    meta = dict(command=command, git_commit=_git_commit(BENCH_DIR.parent), date=time.strftime("%Y-%m-%d %H:%M"),
                load_start=methods._load(), torch=torch.__version__, candidates=names)
    data = dict(meta=meta, models=[])
    if previous:
        meta["rerun"] = dict(pattern=args.rerun, kept_from=dict(command=old["meta"]["command"],
                                                               git_commit=old["meta"]["git_commit"],
                                                               date=old["meta"]["date"],
                                                               rerun=old["meta"].get("rerun")))
    for model in args.models.split(","):
        measured = run_model(model, names, args.repeats, log)
        if model in previous:  # the kept rows first, in their order, then the measured ones in theirs
            fresh = {row["method"] for row in measured["rows"]}
            measured["rows"] = [row for row in previous[model]["rows"] if row["method"] not in fresh] + \
                measured["rows"]
        data["models"].append(measured)
        kept = [m for name, m in previous.items() if name not in args.models.split(",")]  # left as they were
        meta.update(runtime_s=time.time() - started, load_end=methods._load())
        report = dict(data, models=sorted([*data["models"], *kept], key=lambda m: MODELS.index(m["model"])))
        report["choice"] = choose(report)
        md = write_report(report, args.out)  # after every model: a crash keeps what was measured
    data = report
    log(f"wrote {md}; chosen: {data['choice']['chosen']}")
    return md


if __name__ == "__main__":
    main()
