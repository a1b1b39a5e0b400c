"""`dcache analyze`: where is a diffusion transformer redundant across steps? Heat maps and suggested settings.

Runs the *uncached* pipeline (an all-compute dcache tracking schedule, bit-identical to the plain pipeline) on a few
prompts and seeds and measures, for every branch (cond / uncond), step i >= 1 and block b, on the block residual
r = block(x) - x (hidden stream, image tokens):

    change[i, b]    = sum|r_i - r_{i-1}| / sum|r_{i-1}|            relative L1 change (low = reusable)
    cosine[i, b]    = <r_i, r_{i-1}> / (|r_i| |r_{i-1}|)           direction similarity (high = reusable)
    magnitude[i, b] = mean_tokens ||r_i|| / ||r_{i-1}||            magnitude ratio (near 1 = reusable)

and the same three for the whole block stack (stack residual = last block output - first block input); the stack
magnitude ratio per step is the MagCache curve gamma_i. Sums are pooled over all images of all generations, then
divided, so the numbers do not depend on how the generations are split over processes (`accelerate launch`).

Writes into --out: change_<branch>.png, cosine_<branch>.png, magnitude_<branch>.png, magcache_curve.png,
stack_change.png, analysis.json (every number + the suggested settings) and summary.md.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


from .plots import curve_plot, heatmap

MAGCACHE_THRESHOLDS = (0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.4)
STACK = "stack"


@dataclass
class AnalyzeConfig:
    model: str | None = None
    prompts: str = "builtin"
    num_prompts: int | None = None
    seeds: int = 1
    seed_offset: int = 0
    steps: int | None = None
    guidance: float | None = None
    batch_size: int | None = None
    height: int | None = None
    width: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    out: str = "dcache-analyze"
    command: str | None = None


class _Sums:
    """Per (branch, unit, step) float64 sums of the statistics' numerators / denominators (mergeable)."""

    KEYS = ("diff", "ref", "dot", "aa", "bb", "ratio", "tokens")

    def __init__(self):
        self.data: dict[tuple[str, str, int], dict[str, float]] = defaultdict(lambda: dict.fromkeys(self.KEYS, 0.0))
        self._prev: dict[tuple[str, str], tuple[int, torch.Tensor]] = {}

    def add(self, branch: str, unit: str, step: int, r: torch.Tensor) -> None:
        """r: residual [B, T, D] of this call; compared with the previous step's residual of (branch, unit)."""
        r = r.detach().double()
        prev = self._prev.get((branch, unit))
        if prev is not None and prev[0] == step - 1 and prev[1].shape == r.shape:
            p = prev[1]
            d = self.data[(branch, unit, step)]
            d["diff"] += float((r - p).abs().sum())
            d["ref"] += float(p.abs().sum())
            d["dot"] += float((r * p).sum())
            d["aa"] += float((p * p).sum())
            d["bb"] += float((r * r).sum())
            norms_r, norms_p = r.reshape(-1, r.shape[-1]).norm(dim=-1), p.reshape(-1, p.shape[-1]).norm(dim=-1)
            d["ratio"] += float((norms_r / norms_p.clamp_min(1e-12)).sum())
            d["tokens"] += float(norms_r.numel())
        self._prev[(branch, unit)] = (step, r)

    def new_generation(self) -> None:
        self._prev.clear()

    def plain(self) -> dict:
        return {f"{b}|{u}|{s}": v for (b, u, s), v in self.data.items()}


def merge_sums(parts: list[dict]) -> dict[tuple[str, str, int], dict[str, float]]:
    out: dict[tuple[str, str, int], dict[str, float]] = defaultdict(lambda: dict.fromkeys(_Sums.KEYS, 0.0))
    for part in parts:
        for key, vals in part.items():
            b, u, s = key.split("|")
            for k, v in vals.items():
                out[(b, u, int(s))][k] += v
    return out


def statistics_from_sums(sums: dict[tuple[str, str, int], dict[str, float]], num_steps: int,
                         units: list[str]) -> dict[str, dict[str, list[list[float]]]]:
    """{branch: {"change"|"cosine"|"magnitude": [steps][units] (NaN at step 0)}}."""
    branches = sorted({b for b, _, _ in sums})
    out: dict[str, dict[str, list[list[float]]]] = {}
    for b in branches:
        mats = {k: [[math.nan] * len(units) for _ in range(num_steps)] for k in ("change", "cosine", "magnitude")}
        for j, u in enumerate(units):
            for i in range(num_steps):
                d = sums.get((b, u, i))
                if d is None or d["tokens"] == 0:
                    continue
                mats["change"][i][j] = d["diff"] / d["ref"] if d["ref"] > 0 else math.nan
                den = math.sqrt(d["aa"] * d["bb"])
                mats["cosine"][i][j] = d["dot"] / den if den > 0 else math.nan
                mats["magnitude"][i][j] = d["ratio"] / d["tokens"]
        out[b] = mats
    return out


def simulate_magcache(gamma: list[float], threshold: float, max_skip_steps: int = 3,
                      retention_ratio: float = 0.2) -> str:
    """The MagCache decision rule (schedules/magcache.py) on a magnitude curve: 'C'/'R' per step."""
    n = len(gamma)
    retain = int(retention_ratio * n + 0.5)
    acc = [1.0, 0.0, 0.0]
    out = []
    for i in range(n):
        if i < max(retain, 1):
            out.append("C")
            continue
        acc[0] *= gamma[i]
        acc[1] += 1
        acc[2] += abs(1.0 - acc[0])
        if acc[2] <= threshold and acc[1] <= max_skip_steps:
            out.append("R")
        else:
            acc = [1.0, 0.0, 0.0]
            out.append("C")
    return "".join(out)


def suggest(stats: dict, gamma: dict[str, list[float]], units: list[str]) -> dict[str, Any]:
    """Suggested settings from the measured curves (heuristics; `dcache eval` checks them)."""
    out: dict[str, Any] = {}
    main = "cond" if "cond" in stats else sorted(stats)[0]
    stack_change = [row[units.index(STACK)] for row in stats[main]["change"]]
    finite = sorted(c for c in stack_change if math.isfinite(c))
    n = len(stack_change)
    if finite:
        median = finite[len(finite) // 2]
        high = [i for i, c in enumerate(stack_change) if math.isfinite(c) and c > 2 * median]
        warm = 1
        while warm < n and warm in high:  # the leading run of fast-changing steps
            warm += 1
        cutoff = 0
        while cutoff < n - warm and (n - 1 - cutoff) in high:  # the trailing run of fast-changing steps
            cutoff += 1
        out["warmup_steps"] = warm
        out["cutoff_steps"] = cutoff
        # MagCache's published default keeps the first 20% of steps; keep at least that
        out["retention_ratio"] = round(max(0.2, warm / n), 2) if n else 0.2
        out["median_stack_change"] = median
    block_units = [u for u in units if u != STACK]
    if block_units:
        mean_change = {}
        for j, u in enumerate(units):
            if u == STACK:
                continue
            vals = [row[j] for row in stats[main]["change"] if math.isfinite(row[j])]
            mean_change[u] = sum(vals) / len(vals) if vals else math.nan
        ranked = sorted((v, u) for u, v in mean_change.items() if math.isfinite(v))
        out["most_stable_blocks"] = [u for _, u in ranked[:3]]
        out["least_stable_blocks"] = [u for _, u in ranked[::-1][:3]]
        out["block_mean_change"] = mean_change
    curve = gamma.get(main)
    if curve:
        retention = out.get("retention_ratio", 0.2)
        table = []
        for t in MAGCACHE_THRESHOLDS:
            plan = {b: simulate_magcache(g, t, retention_ratio=retention) for b, g in gamma.items()}
            computed = sum(p.count("C") for p in plan.values())
            total = sum(len(p) for p in plan.values())
            table.append({"threshold": t, "steps_computed": computed, "calls": total,
                          "ideal_speedup": total / computed if computed else math.inf, "decisions": plan})
        out["magcache_thresholds"] = table
        # the largest threshold whose simulated speed-up stays <= 2x: a conservative starting point
        ok = [row for row in table if row["ideal_speedup"] <= 2.0]
        pick = ok[-1] if ok else table[0]
        spec = f"magcache:threshold={pick['threshold']}:retention_ratio={retention}"
        out["magcache"] = {"threshold": pick["threshold"], "retention_ratio": retention, "max_skip_steps": 3,
                           "ratios": gamma.get("cond", curve), "ratios_uncond": gamma.get("uncond"),
                           "simulated_ideal_speedup": pick["ideal_speedup"], "spec": spec}
    return out


@dataclass
class AnalyzeResult:
    out_dir: Path
    analysis: dict[str, Any]
    files: list[str] = field(default_factory=list)


def run_analyze(cfg: AnalyzeConfig, *, progress: bool = True) -> AnalyzeResult:
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    from dcache.pipelines.runner import GenerationJob, load_pipeline
    from dcache.schedules.tuning.profiling import ProfileSession, residual

    from .prompts import load_prompts
    from .runner import _process_device, _quiet_load, environment, make_items, process_state

    if cfg.seeds < 1:
        raise ValueError(f"--seeds {cfg.seeds} must be >= 1.")
    state = process_state(cfg.device)
    device = _process_device(cfg.device, state)
    pipe, is_tiny = _quiet_load(load_pipeline, cfg.model, device, cfg.dtype)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    prompts = load_prompts(cfg.prompts, is_tiny=is_tiny, limit=cfg.num_prompts)
    seeds = list(range(cfg.seed_offset, cfg.seed_offset + cfg.seeds))
    items = make_items(prompts, seeds, cfg.batch_size or (10 if is_tiny else 1))
    with state.split_between_processes(items) as mine:
        mine = list(mine)

    sums = _Sums()
    num_steps = 0
    with ProfileSession(pipe) as session:
        units = [f"b{s.index}" for s in session.blocks] + [STACK]
        last = len(session.blocks) - 1
        stack_in: dict[tuple[str, int], torch.Tensor] = {}

        def on_block(slot, where, h_in, e_in, h_out, e_out):
            nonlocal num_steps
            num_steps = max(num_steps, where.step + 1)
            sums.add(where.branch, f"b{slot.index}", where.step, residual(h_out, h_in))
            if slot.index == 0:
                stack_in.clear()
                stack_in[(where.branch, where.step)] = h_in
            if slot.index == last and (where.branch, where.step) in stack_in:
                sums.add(where.branch, STACK, where.step, residual(h_out, stack_in.pop((where.branch, where.step))))

        session.on_block(on_block)
        bar = tqdm(mine, desc="analyze", disable=not progress or not state.is_local_main_process, unit="gen")
        for item in bar:
            sums.new_generation()
            GenerationJob(pipe, is_tiny, prompts=list(item.prompts), steps=cfg.steps, guidance=cfg.guidance,
                          seed=item.seed, height=cfg.height, width=cfg.width)()
        header = session.plan_header()

    parts = gather_object([(sums.plain(), num_steps)])
    state.wait_for_everyone()
    num_steps = max(n for _, n in parts)
    merged = merge_sums([p for p, _ in parts])
    stats = statistics_from_sums(merged, num_steps, units)
    gamma = {b: [1.0] + [m[i][units.index(STACK)] for i in range(1, num_steps)] for b, m in
             ((b, s["magnitude"]) for b, s in stats.items())}
    gamma = {b: [round(g, 5) if math.isfinite(g) else 1.0 for g in curve] for b, curve in gamma.items()}
    suggestions = suggest(stats, gamma, units)
    analysis = {"format": "dcache.analysis", "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "command": cfg.command, "model": cfg.model or "tiny (bundled)", "model_class": header["model_class"],
                "block_layout": header["block_layout"], "num_steps": num_steps, "units": units,
                "prompts": prompts, "seeds": seeds, "statistics": stats, "magcache_curve": gamma,
                "suggestions": suggestions, "environment": environment(device, state.num_processes)}
    files: list[str] = []
    if state.is_main_process:
        files = write_analysis(Path(cfg.out), analysis)
    state.wait_for_everyone()
    return AnalyzeResult(Path(cfg.out), analysis, files)


def write_analysis(out: Path, analysis: dict) -> list[str]:
    from .report import _json_safe, _write

    out.mkdir(parents=True, exist_ok=True)
    units = analysis["units"]
    files = []
    specs = {"change": ("relative L1 change of the block residual vs the previous step (low = reusable)", "magma_r",
                        None, None),
             "cosine": ("cosine similarity of the block residual with the previous step (high = reusable)",
                        "viridis", None, 1.0),
             "magnitude": ("magnitude ratio ||r(i)|| / ||r(i-1)|| (near 1 = reusable)", "coolwarm", None, None)}
    for branch, mats in analysis["statistics"].items():
        for key, (title, cmap, vmin, vmax) in specs.items():
            m = torch.tensor(mats[key], dtype=torch.float64)[:, :-1]  # blocks only; the stack has its own plot
            if key == "magnitude":  # symmetric around 1
                finite = m[torch.isfinite(m)]
                dev = float((finite - 1).abs().max()) if finite.numel() else 1.0
                vmin, vmax = 1 - dev, 1 + dev
            name = f"{key}_{branch}.png"
            heatmap(m.numpy(), out / name, title=f"{title} [{branch}]", cbar=key, cmap=cmap, vmin=vmin, vmax=vmax,
                    xticklabels=units[:-1])
            files.append(name)
    curve_plot(analysis["magcache_curve"], out / "magcache_curve.png",
               title="MagCache magnitude ratio gamma_i of the stack residual", ylabel="gamma_i", hline=1.0)
    files.append("magcache_curve.png")
    stack_j = units.index(STACK)
    curve_plot({b: [row[stack_j] for row in s["change"]] for b, s in analysis["statistics"].items()},
               out / "stack_change.png", title="relative L1 change of the stack residual per step",
               ylabel="relL1 vs previous step")
    files.append("stack_change.png")
    _write(out / "analysis.json", json.dumps(_json_safe(analysis), indent=1))
    _write(out / "summary.md", render_summary(analysis, files))
    return sorted(files + ["analysis.json", "summary.md"])


def render_summary(analysis: dict, files: list[str]) -> str:
    s = analysis["suggestions"]
    lines = [f"# dcache analyze: {analysis['model']}", ""]
    if analysis.get("command"):
        lines += ["```", analysis["command"], "```", ""]
    lines += [f"{analysis['model_class']}, blocks per list {analysis['block_layout']}, {analysis['num_steps']} steps, "
              f"{len(analysis['prompts'])} prompt(s) x {len(analysis['seeds'])} seed(s), branches "
              f"{', '.join(analysis['statistics'])}.", ""]
    lines += ["## Suggested settings", ""]
    if "warmup_steps" in s:
        lines.append(f"- Always compute the first **{s['warmup_steps']}** and the last **{s['cutoff_steps']}** "
                     f"step(s): there the stack residual changes more than 2x its median "
                     f"({s['median_stack_change']:.3f} per step). For FORA / fixed-interval: "
                     f"`warmup_steps={s['warmup_steps']}`, `cutoff_steps={s['cutoff_steps']}`; for MagCache "
                     f"`retention_ratio={s['retention_ratio']}` (at least its default 0.2).")
    if "magcache" in s:
        m = s["magcache"]
        lines.append(f"- MagCache: `{m['spec']}` with the measured curve as `ratios` (analysis.json "
                     f"`suggestions.magcache`); simulated ideal speed-up {m['simulated_ideal_speedup']:.2f}x.")
    if "most_stable_blocks" in s:
        lines.append(f"- Most stable blocks (lowest mean change, first to cache): "
                     f"{', '.join(s['most_stable_blocks'])}; least stable: {', '.join(s['least_stable_blocks'])}.")
    lines.append("- Check any setting with `dcache eval --methods ...` before relying on it.")
    if s.get("magcache_thresholds"):
        lines += ["", "MagCache thresholds on the measured curve (simulated decisions, C compute / R reuse):", "",
                  "| threshold | calls computed | ideal speed-up | decisions |", "|--:|--:|--:|---|"]
        for row in s["magcache_thresholds"]:
            dec = " / ".join(f"{b}: `{p}`" for b, p in row["decisions"].items())
            lines.append(f"| {row['threshold']} | {row['steps_computed']}/{row['calls']} | "
                         f"{row['ideal_speedup']:.2f}x | {dec} |")
    lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in files] + [""]
    return "\n".join(lines)


__all__ = ["AnalyzeConfig", "AnalyzeResult", "run_analyze", "simulate_magcache", "statistics_from_sums",
           "merge_sums", "suggest", "write_analysis"]
