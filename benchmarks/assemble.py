"""Assemble BENCHMARKS.md (one page) and its Pareto plots from the result files the benchmarks commit.

    python benchmarks/assemble.py

Reads benchmarks/results/{methods,search,frontier,forecasters}.json, the `dcache eval` folder
benchmarks/results/eval_tiny/ and the detail pages benchmarks/results/*.md, writes
benchmarks/results/pareto_{methods,search}.png and BENCHMARKS.md.
Results whose recorded provenance is a checkout with uncommitted changes (a git commit ending in "+dirty") are
refused: the page names the command that reproduces them from a committed tree instead of showing them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import gpu_part  # noqa: E402
from summary import (BATCH1_RANGE, batch1_efficiency, best_per_band, fmt_row, frontier_best,  # noqa: E402
                     methods_rows, plot_methods, plot_search, search_vs_dynamic)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EVAL_DIR = RESULTS / "eval_tiny"
RERUN = {
    "methods": "python benchmarks/methods.py --out benchmarks/results",
    "methods_motion": "python benchmarks/methods.py --model motion --heldout-seeds 10 --repeats 5 --out "
                      "benchmarks/results",
    "methods_shapes": "python benchmarks/methods.py --model shapes --heldout-seeds 5 --repeats 5 --out "
                      "benchmarks/results",
    "overhead": "python benchmarks/overhead.py --out benchmarks/results --rounds 9 --thresholds 0,0.1,0.2,0.4 "
                "--magcache-thresholds 0.06,0.5,100:4:0,100:7:0 --keyframes 6,4 "
                "--forecasters foca,hyca,spectrum,dmd,l2p --adaptive 0.214,0.143",
    "per_sample": "python benchmarks/per_sample.py --batches 1,4 --steps 8 --rounds 3 "
                  "--out benchmarks/results/per_sample.md",
    "search": "python benchmarks/search.py --out benchmarks/out/search   # then copy search.{md,json} to "
              "benchmarks/results",
    "frontier": "python benchmarks/frontier.py --out benchmarks/results",
    "default_choice": "python benchmarks/default_choice.py --repeats 3 --out benchmarks/results",
    "frontier_motion": "python benchmarks/frontier.py --model motion --heldout-seeds 10 --repeats 5 --out "
                       "benchmarks/results",
    "frontier_shapes": "python benchmarks/frontier.py --model shapes --heldout-seeds 5 --repeats 5 --out "
                       "benchmarks/results",
    "cfg_difference": "python benchmarks/frontier.py --only '^cfg3$' --search-cfg-difference --no-robustness "
                      "--out benchmarks/results/cfg_difference",
    "guidance_transfer": "python benchmarks/guidance_transfer.py --out benchmarks/results/guidance_transfer",
    "eval": "bash benchmarks/eval_tiny.sh",
    "transfer": "python benchmarks/transfer.py --out benchmarks/results/transfer",
    "cfg_difference_check": "python benchmarks/cfg_difference.py --out benchmarks/results/cfg_difference_check",
    "adaptive": "python benchmarks/adaptive.py --out benchmarks/results/adaptive",
    "forecasters": "python benchmarks/forecasters.py --seeds 1 --out benchmarks/results",
    "forecast_cost": "python benchmarks/forecast_cost.py --out benchmarks/results",
    "kernels": "OMP_NUM_THREADS=1 python benchmarks/kernels.py --out benchmarks/results/kernels_cpu.md",
    "kernels-gpu": "python benchmarks/kernels.py --device cuda --dtype bf16 --out benchmarks/results/kernels_cuda.md",
}


class DirtyResultsError(ValueError):
    """Results produced by a checkout with uncommitted changes: no commit reproduces them."""


def check_provenance(commit: str | None, source: Path, rerun: str) -> None:
    """Refuse results whose recorded commit is an uncommitted tree ("<sha>+dirty")."""
    if commit and commit.endswith("+dirty"):
        raise DirtyResultsError(
            f"{source.relative_to(ROOT)} was produced from a checkout with uncommitted changes ({commit}), so no "
            f"commit reproduces it. Commit (or stash) the changes and rerun `{rerun}`, then "
            f"`python benchmarks/assemble.py`.")


def eval_section(folder: Path, script: str = "benchmarks/eval_tiny.sh") -> str:
    """The main table of a `dcache eval` report folder, with the command that produced it and links to the rest."""
    results = json.loads((folder / "results.json").read_text())
    check_provenance(results.get("environment", {}).get("git_commit"), folder / "results.json", f"bash {script}")
    report = (folder / "report.md").read_text()
    table = report.split("## Results", 1)[1].split("\n## ", 1)[0].strip()
    facts = [line for line in report.splitlines() if line.startswith("- **")]
    rel = folder.relative_to(ROOT)
    return "\n".join([
        "```", f"bash {script}   # makes the plans it evaluates, then runs:", results["command"], "```",
        "", *facts, "", table, "",
        f"The table is copied from [{rel}/report.md]({rel}/report.md) (the full report, also as "
        f"[report.html]({rel}/report.html); every number in [results.json]({rel}/results.json)). The CPU-time "
        f"speed-up and the compute ratio are the stable columns; wall clock varies with the machine's load.",
        "", f"![speed-up vs quality]({rel}/pareto.png)",
    ])


def _eval_part() -> str:
    if not (EVAL_DIR / "results.json").is_file():
        return f"Not recorded yet: run `{RERUN['eval']}`, then `python benchmarks/assemble.py`."
    try:
        return eval_section(EVAL_DIR)
    except DirtyResultsError as error:
        print(f"assemble.py: not shown: {error}", file=sys.stderr)
        return (f"**To be rerun.** The recorded report ({EVAL_DIR.relative_to(ROOT)}/) comes from a checkout with "
                f"uncommitted changes, so it is not shown here. Reproduce it from a committed tree with "
                f"`{RERUN['eval']}` (about 15 minutes on the benchmark machine), then "
                f"`python benchmarks/assemble.py`.")


def _load(name: str) -> dict | None:
    path = RESULTS / name
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    meta = data.get("meta", {}) if isinstance(data.get("meta"), dict) else {}
    check_provenance(meta.get("git_commit") or data.get("git_commit"), path, RERUN[path.stem])
    return data


def _link(name: str) -> str:
    return f"[benchmarks/results/{name}](benchmarks/results/{name})"


def intro(methods: dict | None) -> str:
    meta = methods["meta"] if methods else {}
    versions = f"torch {meta.get('torch', '?')}, diffusers {meta.get('diffusers', '?')}, cache-dit " \
               f"{meta.get('cache_dit', '?')}" if meta else ""
    return f"""# Benchmarks

**What was measured.** Unless a section names another bundled model, figures come from tiny-digits
(`pipelines/assets/tiny-digits`: a 16x16, one-channel, class-conditional rectified-flow model, a real diffusers
`FluxTransformer2DModel` with 2 double-stream + 6 single-stream blocks, width 128); the methods sweep, batch-1
efficiency, forecasters, transfer and CFG-difference sections also run on tiny-motion (a Wan video DiT with UniPC and
split CFG 5) and tiny-shapes (an SD3 MM-DiT with batched CFG 4), described in docs/bundled-models.md. Everything ran
on a 2-core x86-64 CPU with one torch thread ({versions}), except the last section's figures, measured on an
NVIDIA H100 at real model sizes. The bundled models are small, so the CPU numbers rank methods and measure each
library's cache-path overhead; they do not predict the wall-clock speed-up on a large model on a GPU, where the share
of time outside the blocks is smaller. The benchmark machine was shared with other work, so wall-clock speed-ups
are noisy: the tables also give the compute ratio (block FLOPs computed / uncached, counted from shapes) and
process-CPU-time speed-ups.

**Quality** is the PSNR (dB) of cached vs uncached samples of the same seeds: 100 held-out samples (seeds
1000-1009 x digits 0-9, 28 steps, CFG 1.5) unless a section says otherwise; settings and calibrations were chosen on
a separate tuning batch (seed 0). Higher PSNR at a lower compute ratio is better.

Each section links its full, generated tables (`benchmarks/results/*.md`) and says how to rerun it; after a rerun,
`python benchmarks/assemble.py` rebuilds this page and its plots from the committed JSON.
"""


DIGITS = "tiny-digits (Flux, split CFG 1.5, Euler, 28 steps)"
MODEL_RESULTS = {"tiny-digits": "methods", "tiny-motion": "methods_motion", "tiny-shapes": "methods_shapes"}
TUNING = ("Tuned on: each method's knob searched, and every calibration made, on this model's tuning batch (seed 0, "
          "every class); measured on: its held-out seeds.")
PEERS_NOTE = (
    "**Peers at their best, and out of the box.** Every peer's knob is swept like dcache's, over the same bands. "
    "diffusers' SeaCache reads the scheduler's step, sigma and step count from `cache_context(name, step_index=..., "
    "sigma=..., num_inference_steps=...)` and otherwise runs fail-open, computing every call: the bundled pipelines "
    "pass them, as diffusers 0.42.1's `WanPipeline` does, but its `FluxPipeline` and `QwenImagePipeline` do not, "
    "so there SeaCache does nothing unless the user's own loop supplies them. diffusers' caches cannot be put on "
    "`SD3Transformer2DModel` (not a `CacheMixin` in 0.42.1). cache-dit 1.5.3's calibrators (TaylorSeer, FoCa, DMD) "
    "raise `AssertionError: State 'transformer_blocks_Bn_residual' not found` on SD3's blocks at F1B0 unless "
    "`enable_encoder_calibrator=False`, which tiny-shapes' rows set. diffusers' TaylorSeer hooks the modules whose "
    "names `re.fullmatch` `^blocks.*attn` (and the like): Wan's `blocks.<i>.attn1` / `attn2` do not, so out of the "
    "box it caches nothing on a Wan transformer; tiny-motion's rows pass `cache_identifiers=[r\"^blocks\\.\\d+\\."
    "attn[12]$\"]`. At their defaults on tiny-digits, diffusers' FirstBlockCache (threshold 0.05) reuses nothing "
    "(the transfer section below).")


def methods_part(methods: dict, stem: str = "methods") -> str:
    meta = methods["meta"]
    rows = methods_rows(methods)
    plot_methods(methods, RESULTS / f"pareto_{stem}.png")
    plot = f"benchmarks/results/pareto_{stem}.png"
    unavailable = "".join(f" {name}: {why}." for name, why in meta.get("unavailable", {}).items())
    lines = [
        f"{len({(r['library'], r['method']) for r in rows})} method configurations of dcache, diffusers' built-in "
        f"caches (`diffusers.hooks`) and cache-dit, each at the settings closest to four compute bands ({len(rows)} "
        f"rows); {meta['heldout_samples']} held-out samples, {meta['steps']} steps, CFG {meta['guidance']:g} "
        f"({meta.get('cfg_mode', 'split')}); last measured {meta['date'][:10]} ({_link(stem + '.md')} gives the "
        f"command behind each row). {TUNING}{unavailable}",
        "", f"![held-out PSNR vs compute ratio, one Pareto front per library]({plot})", "",
        "**Best per compute band** (band c holds compute ratios within a factor 1.18 of c; held-out PSNR, the "
        "method and setting, @ its compute ratio):", "",
        "| band | dcache | diffusers | cache-dit | dcache − best peer |", "|---|---|---|---|---|",
    ]
    for band in best_per_band(rows):
        best = band["best"]
        margin = f"{band['margin']:+.2f} dB" if band["margin"] is not None else "—"
        lines.append(f"| ~{band['band']:g} | {fmt_row(best['dcache'])} | {fmt_row(best['diffusers'])} | "
                     f"{fmt_row(best['cache-dit'])} | {margin} |")
    lines += [
        "", f"Full table (every row: batch-1 and batch-10 speed-ups, SSIM, classifier accuracy, Fréchet distance): "
            f"{_link(stem + '.md')}" + (f"; the analysis of these results: {_link(stem + '_notes.md')}"
                                        if (RESULTS / f"{stem}_notes.md").is_file() else "")
            + f"; raw numbers: {_link(stem + '.json')}.",
        "", f"Rerun: `{RERUN[stem]}` (`--rerun REGEX` re-measures the matching rows only).",
    ]
    return "\n".join(lines)


def other_models_part(part) -> str:
    """`part(methods, stem)` for the sweeps of the bundled models other than tiny-digits, one subsection each."""
    out = []
    for model, stem in list(MODEL_RESULTS.items())[1:]:
        data = _load(f"{stem}.json")
        if data is None:
            continue
        out += [f"### {data['meta'].get('model_title', model)}", "", part(data, stem), ""]
    return "\n".join(out)


def batch1_table(methods: dict, stem: str = "methods") -> str:
    """The batch-1 efficiency table of one sweep."""
    lo, hi = BATCH1_RANGE
    lines = [
        f"Rows of the sweep whose batch-1 compute ratio is {lo}-{hi}; measured / ideal speed-up, median of "
        f"{methods['meta']['repeats']} runs interleaved with an uncached twin pipeline ({_link(stem + '.md')}; "
        f"load average {methods['meta'].get('load_start', '?')} at the start, {methods['meta'].get('load_end', '?')} "
        f"at the end):", "",
        "| library | rows | median measured/ideal (wall) | median (CPU time) | best (wall) |", "|---|---|---|---|---|",
    ]
    for entry in batch1_efficiency(methods_rows(methods)):
        best = entry["best"]
        lines.append(f"| {entry['library']} | {entry['rows']} | {entry['median']:.2f} | {entry['median_cpu']:.2f} | "
                     f"{best['b1_meas_over_ideal']:.2f} · {best['method']} ({best['setting']}), "
                     f"{best['b1_speedup_wall']:.2f}x at {best['b1_ratio']:.3f} |")
    return "\n".join(lines)


def batch1_part(methods: dict) -> str:
    lines = [
        "How much of the ideal speed-up (1 / compute ratio) a cache delivers at batch 1, where the work outside the "
        "blocks (embedders, RoPE, norms, the pipeline step) and the cache path's own cost weigh most.", "",
        f"### {DIGITS}", "", batch1_table(methods), "", other_models_part(batch1_table),
    ]
    lines += [
        "", "dcache's call scope (`scope=\"call\"`) reuses whole transformer calls, so it also skips the work outside "
            "the blocks; block-scope caches of every library are capped by it. The split of a batch-1 call into that "
            f"floor, block compute and cache-path overhead, per library: {_link('overhead.md')} (analysis: "
            f"{_link('overhead_notes.md')}).",
        "", f"Rerun: `{RERUN['overhead']}`; the table above comes with the methods sweep.",
    ]
    per_sample = RESULTS / "per_sample.md"
    if per_sample.is_file():  # what per-sample decisions cost (dcache.runtime.lanes, docs/serving.md)
        lines += ["", "### Per-sample decisions", "", PER_SAMPLE_TEXT, "", per_sample.read_text().strip(), "",
                  f"Rerun: `{RERUN['per_sample']}`."]
    return "\n".join(lines)


PER_SAMPLE_TEXT = (
    "Per-sample decisions (decisions='sample', the default) run each row of a batched call of a method that reads a "
    "signal up to its decision at batch 1 (the embedders; a probe block for FBCache-style methods), then the rows "
    "that decided alike as one call on their stacked caches (docs/serving.md). The cost per batched call is the time "
    "with decisions='sample' minus the time with decisions='batch' at a setting where both compute everything: every "
    "row decides alike, so each call runs whole and the difference is the decision step. Where rows decide "
    "differently they run as two sub-batches; what that adds besides the model (gathering each group's rows, "
    "stacking the lanes' caches and cutting them back, scattering the outputs) is the last column. At batch 1 "
    "nothing is split. TeaCache decides from the modulated input: the decision step is four rows' embedders at "
    "batch 1. FBCache decides from its first block's output: each row also runs that probe block at batch 1, and "
    "where every row computes the whole-batch call runs it again (so that call equals the uncached batch bit for "
    "bit): on this 8-block model that is the largest cost in the table; on a model of dozens of blocks the probe is "
    "one of them. Methods that decide from the step alone, and decisions='batch', run one batched call.")


def search_part(search: dict) -> str:
    plot_search(search, RESULTS / "pareto_search.png")
    plot = "benchmarks/results/pareto_search.png"
    lines = [
        "Static plans found offline (`dcache search`: ECAD, LeMiCa, a DP over step groups, the HarmoniCa and L2C "
        "routers, optionally replayed with Taylor forecasts or a learned DisCa forecaster) against every dynamic "
        "schedule of the methods sweep, on the same 100 held-out samples.", "",
        f"![searched plans vs dynamic schedules]({plot})", "",
        "| compute ratio <= | best searched plan | best dynamic schedule | plan families that beat every dynamic "
        "schedule there |", "|---|---|---|---|",
    ]
    for entry in search_vs_dynamic(search):
        met = ", ".join(f"`{name}`" for name in entry["met"]) or "none"
        lines.append(f"| {entry['target']:g} | {fmt_row(entry['plan'], 'psnr', 'compute_ratio')} | "
                     f"{fmt_row(entry['dynamic'], 'psnr', 'compute_ratio')} | {met} |")
    lines += [
        "", "A family beats the dynamic schedules at a ratio when one of its plans Pareto-dominates every dynamic "
            "row near that ratio (benchmarks/search.py's verdicts; one search seed, no confidence intervals).",
        "", f"Every scored plan and the DisCa-vs-Taylor comparison: {_link('search.md')}; analysis: "
            f"{_link('search_notes.md')}; raw numbers: {_link('search.json')}.",
        "", f"Rerun: `{RERUN['search']}` (1-2 hours; searches found in `--out` are reused, a rerun only re-scores).",
    ]
    return "\n".join(lines)


FRONTIER_TARGETS = {0.2: 42.0, 0.125: 35.0}  # held-out PSNR targets of the 28-step bands (benchmarks/frontier.py)


def _efficiency(scenario: dict, band: float) -> str:
    """The best batch-1 measured / ideal speed-up of dcache's rows in a band, call scope and block scope."""
    rows = [row for r in scenario["results"] if r["library"] == "dcache" for row in r["rows"] if row["band"] == band]
    cells = []
    for in_call in (True, False):
        # method names carry the scope as a word: "keyframe call", "keyframe call foca", "keyframe blocks"
        mine = [row for row in rows if ("call" in row["method"].split()) == in_call and row.get("b1_meas_over_ideal")]
        top = max(mine, key=lambda row: row["b1_meas_over_ideal"]) if mine else None
        cells.append(f"{top['b1_meas_over_ideal']:.2f}; {top['b1_meas_over_ideal_cpu']:.2f}" if top else "—")
    return " / ".join(cells)


def _kept_scenarios(frontier: dict) -> str:
    """The scenarios a merged report kept from other runs (benchmarks/frontier.py --merge), with their commits."""
    kept = [sc for sc in frontier["scenarios"] if sc.get("measured")]
    return "".join(f"; {sc['name']} kept from the run at commit {sc['measured']['git_commit']} "
                   f"({sc['measured']['date'][:10]})" for sc in kept)


def frontier_part(frontier: dict) -> str:
    """Best row per band and library of every frontier scenario, the targets, the plot and the rerun command."""
    meta = frontier["meta"]
    lines = [
        "dcache's best settings against diffusers' caches and cache-dit at compute ratios 0.20 (5x ideal) and 0.125 "
        "(8x), at CFG 1.5 (the sweep's setting), CFG 3 and without CFG, and a 10-step generation at 0.5 and 0.3; "
        "each library's knobs searched on the tuning batch for the bands (c / 1.18 .. c x 1.18), held-out PSNR vs "
        f"uncached; measured {meta['date'][:10]} at commit {meta['git_commit']} (load average {meta['load_start']} "
        f"at the start, {meta.get('load_end', '?')} at the end){_kept_scenarios(frontier)}.", "",
        "![held-out PSNR vs compute ratio per scenario](benchmarks/results/frontier_pareto.png)", "",
        "| scenario | band | dcache | diffusers | cache-dit | dcache batch-1 measured/ideal: call scope / block scope "
        "(wall; CPU time) |", "|" + "---|" * 6,
    ]
    for sc in frontier["scenarios"]:
        for band, best in frontier_best(sc).items():
            cells = [fmt_row(best.get(lib)) for lib in ("dcache", "diffusers", "cache-dit")]
            row = best.get("dcache")
            # the scenario's own targets (40 / 33 dB with CFG); runs written before they were stored: 42 / 35 dB
            targets = {float(k): v for k, v in sc.get("targets", {}).items()}
            target = targets.get(band) if targets else FRONTIER_TARGETS.get(band) if sc["steps"] == 28 else None
            if row is not None and target is not None:
                cells[0] += f" ({'meets' if row['psnr_heldout'] >= target else 'below'} {target:g} dB)"
            lines.append(f"| {sc['name']} ({sc['steps']} steps, guidance {sc['guidance']:g}) | ~{band:g} | "
                         + " | ".join(cells) + f" | {_efficiency(sc, band)} |")
    notes = RESULTS / "frontier_notes.md"
    if notes.is_file():  # its summary: the text before the first "## " heading (the rest is on the linked page)
        lines += ["", notes.read_text().split("\n## ", 1)[0].strip()]
    lines += [
        "", f"Every row (batch-1 speed-ups, SSIM, accuracy, FD as a share of the seed-to-seed FD), the searched "
            f"keyframes and the plan-replay robustness table: {_link('frontier.md')}; the reading: "
            f"{_link('frontier_notes.md')}; raw numbers: {_link('frontier.json')}.",
        "", f"Rerun: `{RERUN['frontier']}` (`--quick` for a one-minute smoke run, `--search` to search the keyframes "
            "again on the tuning batch).",
    ]
    return "\n".join(lines)


def _l2p_tuning(data: dict) -> str:
    """Where a run's L2P rows were fitted, if it has any."""
    has = any(r["method"] == "keyframe call l2p" for sc in data["scenarios"] for r in sc["results"])
    return (" and L2P's own keyframes searched on seed 0, L2P fitted per candidate on its tuning seeds 1-2 with its "
            "ridge chosen on seed 0" if has else "")


def model_frontier_part(stem: str) -> str:
    """The frontier of a bundled model other than tiny-digits (benchmarks/frontier.py --model): per scenario and
    band the best row of each library, dcache's margin over the best peer, and the PSNR target."""
    data = _load(f"{stem}.json")
    if data is None:
        return ""
    meta = data["meta"]
    title = meta.get("model_title", stem)
    lines = [
        f"### {title}", "",
        f"Tuned on: dcache's keyframes searched on {title}'s tuning batch (seed 0){_l2p_tuning(data)}, every "
        f"other dcache default on tiny-digits; each peer's knob swept on the same tuning batch. Measured on: held-out "
        f"seeds "
        f"{data['scenarios'][0]['heldout_seeds'][0]}..{data['scenarios'][0]['heldout_seeds'][-1]} x every class; "
        f"{meta['date'][:10]}, commit {meta['git_commit']}, load average {meta['load_start']} at the start, "
        f"{meta.get('load_end', '?')} at the end.", "",
        "| scenario | band | dcache | diffusers | cache-dit | margin over the best peer |", "|" + "---|" * 6,
    ]
    for sc in data["scenarios"]:
        targets = {float(k): v for k, v in sc.get("targets", {}).items()}
        for band, best in frontier_best(sc).items():
            cells = [fmt_row(best.get(lib)) for lib in ("dcache", "diffusers", "cache-dit")]
            row = best.get("dcache")
            if row is not None and band in targets:
                cells[0] += f" ({'meets' if row['psnr_heldout'] >= targets[band] else 'below'} {targets[band]:g} dB)"
            peer = max((best[lib] for lib in best if lib != "dcache"), key=lambda r: r["psnr_heldout"], default=None)
            margin = f"{row['psnr_heldout'] - peer['psnr_heldout']:+.2f} dB" if row and peer else "no peer row"
            mode = f", {sc['mode']} CFG" if sc.get("mode") and sc["guidance"] > 1 else ""
            lines.append(f"| {sc['name']} ({sc['steps']} steps, guidance {sc['guidance']:g}{mode}) | ~{band:g} | "
                         + " | ".join(cells) + f" | {margin} |")
    notes = RESULTS / f"{stem}_notes.md"
    if notes.is_file():
        lines += ["", notes.read_text().split("\n## ", 1)[0].strip()]
    lines += ["", f"![held-out PSNR vs compute ratio](benchmarks/results/{stem}_pareto.png)", "",
              f"Every row, the searched keyframes and the uniform / FoCa / L2P / adaptive / transferred rows: "
              f"{_link(stem + '.md')}. Rerun: `{RERUN[stem]}`."]
    return "\n".join(lines)


CFG_DIFFERENCE = RESULTS / "cfg_difference" / "frontier.json"  # the CFG-3 run with the cfg-diff contender


def cfg_difference_part() -> str:
    """Real CFG (guidance 3) with and without forecasting the CFG difference: per band, keyframes with the uncond
    branch cached on its own, with cfg_difference, the best dcache row, and the best peers, from one run."""
    if not CFG_DIFFERENCE.is_file():
        return ""
    data = json.loads(CFG_DIFFERENCE.read_text())
    meta = data["meta"]
    check_provenance(meta.get("git_commit"), CFG_DIFFERENCE, RERUN["cfg_difference"])
    lines = ["### Real CFG: forecasting the CFG difference", "",
             "With guidance 3 the branches' forecast errors reach the sample as 3 e_c - 2 e_u; with an unconditional "
             "branch one keyframe short (the only way to reach 0.196 or 0.125 with split CFG) they stop cancelling. "
             "`cfg_difference=True` (call scope) serves the unconditional calls as the conditional output minus a "
             "forecast of the CFG difference over the steps both branches computed. One run, tuning batch for the "
             f"searches, held-out PSNR; commit {meta['git_commit']}, {meta['date'][:10]} (load average "
             f"{meta['load_start']} at the start, {meta.get('load_end', '?')} at the end).", "",
             "| band | keyframe call (branches on their own) | keyframe call cfg-diff | best dcache | diffusers | "
             "cache-dit |", "|" + "---|" * 6]
    for sc in data["scenarios"]:
        best = frontier_best(sc)
        for band, per_library in best.items():
            by_method = {}
            for result in sc["results"]:
                for row in result["rows"]:
                    if row["band"] == band and result["library"] == "dcache":
                        by_method.setdefault(result["method"], row)
            cells = [fmt_row(by_method.get("keyframe call")), fmt_row(by_method.get("keyframe call cfg-diff")),
                     fmt_row(per_library.get("dcache")), fmt_row(per_library.get("diffusers")),
                     fmt_row(per_library.get("cache-dit"))]
            lines.append(f"| ~{band:g} | " + " | ".join(cells) + " |")
    rel = CFG_DIFFERENCE.parent.relative_to(ROOT)
    lines += ["", f"Every row: [{rel}/frontier.md]({rel}/frontier.md) (plot: [{rel}/frontier_pareto.png]"
                  f"({rel}/frontier_pareto.png)). Rerun: `{RERUN['cfg_difference']}`."]
    return "\n".join(lines)


GUIDANCE_TRANSFER = RESULTS / "guidance_transfer" / "transfer.json"


def guidance_transfer_part() -> str:
    """Searched plans (one guidance scale vs several), dynamic SeaCache and the frontier keyframes replayed at other
    guidance scales on held-out seeds; the hand-written reading from the folder's notes.md."""
    if not GUIDANCE_TRANSFER.is_file():
        return ""
    data = json.loads(GUIDANCE_TRANSFER.read_text())
    meta = data["meta"]
    check_provenance(meta.get("git_commit"), GUIDANCE_TRANSFER, RERUN["guidance_transfer"])
    scales = [f"{g:g}" for g in data["heldout_guidance"]]
    lines = ["### Searched plans at other guidance scales", "",
             "`dcache search --guidance` runs the calibration set at each listed scale and scores a plan by its "
             "worst one. Plans searched at 1.5 and at 1.5 + 3 (LeMiCa, Taylor-2 forecasts), replayed as written and "
             f"in call scope, against dynamic SeaCache and the frontier's CFG-1.5 keyframes; {data['steps']} steps, "
             f"held-out seeds {data['seeds'][0]}..{data['seeds'][-1]} x 10 labels, PSNR vs the uncached images "
             f"of the same scale; commit {meta['git_commit']}, {meta['date'][:10]} (load average "
             f"{meta['load_start']} at the start, {meta.get('load_end', '?')} at the end).", "",
             "| row | searched at | compute ratio | " + " | ".join(f"guidance {g}" for g in scales)
             + " | loss 1.5 -> 3 |", "|" + "---|" * (len(scales) + 4)]
    for name, row in data["rows"].items():
        at = row["at"]
        if not at:
            continue
        loss = at["1.5"]["psnr"] - at["3"]["psnr"] if "1.5" in at and "3" in at else None
        lines.append(f"| {name} | {', '.join(f'{g:g}' for g in row['searched_at']) or 'dynamic'} | "
                     f"{next(iter(at.values()))['ratio']:.3f} | "
                     + " | ".join(f"{at[g]['psnr']:.2f}" if g in at else "-" for g in scales)
                     + f" | {'-' if loss is None else format(loss, '.2f')} |")
    rel = GUIDANCE_TRANSFER.parent.relative_to(ROOT)
    notes = GUIDANCE_TRANSFER.parent / "notes.md"
    if notes.is_file():
        lines += ["", notes.read_text().strip()]
    lines += ["", f"Plot: [{rel}/transfer.png]({rel}/transfer.png); the searches' fronts and plans: {rel}/search-*/. "
                  f"Rerun: `{RERUN['guidance_transfer']}` (~30 min; a rerun reuses the searches' measured edges)."]
    return "\n".join(lines)


def kernels_part() -> str:
    return "\n".join([
        "The fused kernels (residual apply / capture with statistics, relative L1, Taylor update and forecast, axpy) "
        "have Triton and plain-torch implementations; the tests check both against an fp32 reference (Triton under "
        "its CPU interpreter). Recorded: the CPU (torch path) table, " + _link("kernels_cpu.md") + ". The CUDA "
        "bandwidth table is not recorded yet.",
        "", f"Rerun: `{RERUN['kernels']}`; on a CUDA machine: `{RERUN['kernels-gpu']}`.",
    ])


def transfer_part() -> str:
    """benchmarks/transfer.py's tables (presets and defaults on the three bundled models) and their reading."""
    folder = RESULTS / "transfer"
    if not (folder / "transfer.json").is_file():
        return f"Not recorded yet: run `{RERUN['transfer']}`, then `python benchmarks/assemble.py`."
    result = json.loads((folder / "transfer.json").read_text())
    check_provenance(result.get("git_commit"), folder / "transfer.json", RERUN["transfer"])
    reading = folder / "reading.md"
    parts = [reading.read_text().strip()] if reading.is_file() else []
    parts.append((folder / "transfer.md").read_text().strip())
    parts.append(f"Measured from commit {result.get('git_commit')}, {result['seeds']} held-out seeds x every class x "
                 f"{result['per_class']}, {result['threads']} torch thread, {result['seconds']} s. Rerun: "
                 f"`{RERUN['transfer']}`.")
    return "\n\n".join(parts)


def script_part(name: str, stem: str, intro: str) -> str:
    """A benchmark script's table (results/<name>/<stem>.md) under `intro`, with its commit and rerun command."""
    folder = RESULTS / name
    path = folder / f"{stem}.json"
    if not path.is_file():
        return f"Not recorded yet: run `{RERUN[name]}`, then `python benchmarks/assemble.py`."
    result = json.loads(path.read_text())
    check_provenance(result.get("git_commit"), path, RERUN[name])
    table = (folder / f"{stem}.md").read_text().strip()
    if table.startswith("`"):  # a first line that repeats the command: given below instead
        table = table.split("\n", 1)[1].strip()
    reading = folder / "reading.md"
    return "\n\n".join([intro, table] + ([reading.read_text().strip()] if reading.is_file() else []) + [
        f"Measured from commit {result.get('git_commit')}, {result.get('seeds')} held-out seed(s) x every class x 2. "
        f"Rerun: `{RERUN[name]}`."])


def default_part() -> str:
    """The default method: each candidate's worst gap over the models, the chosen one's row per model, the reading."""
    data = _load("default_choice.json")
    if data is None:
        return f"Not recorded yet: run `{RERUN['default_choice']}`, then `python benchmarks/assemble.py`."
    meta, choice = data["meta"], data["choice"]
    lines = [
        "`dcache.apply(pipe)` must hold on models nobody tuned it on. Each candidate runs at its defaults on every "
        "bundled model, on the held-out seeds of that model's methods sweep; its **gap** is the best tuned dcache "
        "row of the sweep that computes no more (x 1.02) minus its PSNR. Tuned on: nothing; measured on: each "
        f"model's held-out seeds. Last command: `{meta['command']}` (commit {meta['git_commit']}, "
        f"{meta['date']}).", "",
        "| candidate | " + " | ".join(f"{m['title'].split(' (')[0]}: ratio, PSNR, gap" for m in data["models"])
        + " | worst gap |", "|" + "---|" * (len(data["models"]) + 2)]
    ranked = sorted(choice["per_candidate"].items(), key=lambda kv: kv[1].get("worst_gap", float("inf")))
    for name, summary in ranked:
        cells = []
        for m in data["models"]:
            row = next((r for r in m["rows"] if r["method"] == name), None)
            cells.append("—" if row is None or "error" in row else
                         f"{row['ratio']:.3f}, {row['psnr_heldout']:.2f} dB, {row['gap']:+.2f}")
        worst = f"{summary['worst_gap']:+.2f}" if "worst_gap" in summary else "—"
        mark = " (**chosen**)" if name == choice["chosen"] else ("" if summary["eligible"] else " (computes > 0.65)")
        lines.append(f"| {name}{mark} | " + " | ".join(cells) + f" | {worst} |")
    notes = RESULTS / "default_choice_notes.md"
    if notes.is_file():
        lines += ["", notes.read_text().split("## Reading", 1)[-1].strip()]
    lines += ["", f"Every row and its reference row: {_link('default_choice.md')}. Rerun: `{RERUN['default_choice']}` "
                  "(`--rerun REGEX` measures some candidates again and keeps the rest)."]
    return "\n".join(lines)


CFG_CHECK_INTRO = (
    "`cfg_difference=True` should never make a generation worse than the same setting without it. It serves the "
    "unconditional calls through the difference only while that measures better than the branches' own caches at "
    "the steps both computed (docs/methods.md, keyframe; `dcache/runtime/cfg_difference.py`), and says when it fell "
    "back, could not check, or had no split CFG to act on (the health notes column). The check scores the served "
    "calls' own error; the two \"served calls' error\" columns measure exactly that (PSNR against a twin of the "
    "preset whose uncond branch computes those calls), and it improved in every row where the difference was served. "
    "What the check cannot see is how a served call's error lines up with the error already in the sample: where a "
    "row is negative, the difference's smaller error lay more along it (the reading below). A calibration run sees "
    "it: with `calibration_run=` the difference is kept only if that generation comes out closer to its uncached "
    "twin with it (the \"with calibration_run\" columns; the run is the tuning seed's, never a held-out one). The "
    "keyframe presets were searched on "
    "tiny-digits at CFG 1.5; every guidance here is one they were not tuned at, and tiny-motion was never tuned on.")
ADAPTIVE_INTRO = (
    "Placement without a search: `adaptive_keyframe` places its computed steps at run time from the forecast error "
    "it measures at each computed step, for a compute ratio (a hard budget) or an error tolerance. Beside it, uniform "
    "keyframes with the same computed steps per branch (what a user without a search would pick). No setting of "
    "either was chosen on these models.")


def forecasters_part() -> str:
    """benchmarks/forecasters.py's table: each forecaster against Taylor orders 1-2 on the bundled models."""
    path = RESULTS / "forecasters.json"
    if not path.is_file():
        return f"Not recorded yet: run `{RERUN['forecasters']}`, then `python benchmarks/assemble.py`."
    result = json.loads(path.read_text())
    check_provenance(result.get("git_commit"), path, RERUN["forecasters"])
    table = (RESULTS / "forecasters.md").read_text().strip()
    reading = RESULTS / "forecasters_reading.md"
    return "\n\n".join(([reading.read_text().strip()] if reading.is_file() else []) + [
        "What a FORECAST serves between keyframes: the engine's Taylor table (order 1, 2) or one of the forecasters "
        "of `dcache.schedules.forecasters` (FoCa, HyCa, Spectrum, DMD, L2P; formulas and papers in "
        "[docs/methods.md](docs/methods.md#forecasters)), each at its default settings, chosen on tiny-digits' tuning "
        "batch (seed 0; `python benchmarks/forecasters.py --tune`, "
        "[forecasters_tuning.json](benchmarks/results/forecasters_tuning.json), L2P's "
        "[forecasters_tuning_l2p.json](benchmarks/results/forecasters_tuning_l2p.json)); tiny-motion and tiny-shapes "
        "were not tuned on. L2P's table is fitted per model and ratio on that model's tuning seeds 0 and 1 "
        "(calibration runs, as a user fits it on their own prompts), at its default ridge (`l2p`) and with the "
        "ridge chosen on seed 0 by `fit_l2p(ridge=\"auto\")` (`l2p-auto`); the rows are measured on held-out seeds.",
        table,
        f"Measured from commit {result.get('git_commit')}, held-out seeds {result['seeds']} x every class x "
        f"{result['per_class']}, {result['machine']}, {result['seconds']} s. Rerun: `{RERUN['forecasters']}`."])


def forecast_cost_part() -> str:
    """benchmarks/forecast_cost.py's table: what one forecast costs, with the fit kept and made again."""
    path = RESULTS / "forecast_cost.json"
    if not path.is_file():
        return f"Not recorded yet: run `{RERUN['forecast_cost']}`, then `python benchmarks/assemble.py`."
    result = json.loads(path.read_text())
    check_provenance(result.get("git_commit"), path, RERUN["forecast_cost"])
    reading = RESULTS / "forecast_cost_reading.md"
    return "\n\n".join(["### What a forecast costs"] + ([reading.read_text().strip()] if reading.is_file() else [])
                        + [(RESULTS / "forecast_cost.md").read_text().strip()])


def build() -> str:
    methods, search, frontier = _load("methods.json"), _load("search.json"), _load("frontier.json")
    missing = "Not recorded yet: run `{}`, then `python benchmarks/assemble.py`."
    parts = [intro(methods)]
    parts.append("## Methods vs diffusers and cache-dit\n\n" + PEERS_NOTE + f"\n\n### {DIGITS}\n\n"
                 + (methods_part(methods) if methods else missing.format(RERUN["methods"]))
                 + "\n\n" + other_models_part(methods_part))
    parts.append("## The default method\n\n" + default_part())
    parts.append("## Batch-1 efficiency\n\n" + (batch1_part(methods) if methods else missing.format(RERUN["methods"])))
    parts.append("## Plan search vs dynamic schedules\n\n" + (search_part(search) if search else
                                                               missing.format(RERUN["search"])))
    parts.append("## Beyond 4x: the frontier below 0.25\n\n" + f"### {DIGITS}\n\n"
                 + (frontier_part(frontier) if frontier else missing.format(RERUN["frontier"]))
                 + "\n\n" + cfg_difference_part() + "\n\n" + guidance_transfer_part()
                 + "\n\n" + model_frontier_part("frontier_motion") + "\n\n" + model_frontier_part("frontier_shapes"))
    parts.append("## Forecasters beyond Taylor\n\n" + forecasters_part() + "\n\n" + forecast_cost_part())
    parts.append("## Tuned on one model, measured on another\n\n" + transfer_part())
    parts.append("## CFG difference: checked against its own baseline\n\n"
                 + script_part("cfg_difference_check", "cfg_difference", CFG_CHECK_INTRO))
    parts.append("## Adaptive keyframes: placement without a search\n\n"
                 + script_part("adaptive", "adaptive", ADAPTIVE_INTRO))
    parts.append("## A `dcache eval` report\n\n" + _eval_part())
    parts.append("## Kernels\n\n" + kernels_part())
    parts.append("## On a GPU, at real scale\n\n" + gpu_part(RESULTS / "gpu"))
    return "\n\n".join(part.strip() for part in parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0] + " Takes no arguments.").parse_args(argv)
    try:
        page = build()
    except DirtyResultsError as error:
        sys.exit(f"assemble.py: refused: {error}")
    (ROOT / "BENCHMARKS.md").write_text(page)


if __name__ == "__main__":
    main()
