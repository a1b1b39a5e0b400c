"""Summaries and Pareto plots of the committed benchmark results, for BENCHMARKS.md (benchmarks/assemble.py).

Everything here is computed from benchmarks/results/methods.json (benchmarks/methods.py),
benchmarks/results/search.json (benchmarks/search.py) and benchmarks/results/frontier.json (benchmarks/frontier.py);
nothing is measured. Quality is PSNR (dB) of cached vs
uncached samples; compute is the compute ratio = block FLOPs computed / uncached (lower is less work).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable

LIBRARIES = ["dcache", "diffusers", "cache-dit"]
COLORS = {"dcache": "#1f77b4", "diffusers": "#d62728", "cache-dit": "#2ca02c", "plan search": "#9467bd"}
BANDS = [0.75, 0.5, 0.33, 0.25]
BATCH1_RANGE = (0.25, 0.38)  # batch-1 compute ratios of the efficiency table (speed-ups of about 2.6-4x)


def methods_rows(methods: dict) -> list[dict]:
    """The selected settings of every method (one per compute band), measured on the held-out samples."""
    return [row for result in methods["results"] for row in result["rows"]]


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(compute ratio, PSNR) points no other point beats on both (less compute and higher PSNR), by ratio."""
    front, best = [], float("-inf")
    for ratio, psnr in sorted(points, key=lambda p: (p[0], -p[1])):
        if psnr > best:
            front.append((ratio, psnr))
            best = psnr
    return front


def _label(row: dict) -> str:
    """`method (setting)` for a methods.json row, `method (config)` for a dynamic row of search.json, and the
    plan's file name for a scored plan."""
    detail = row.get("setting") or row.get("config") or row.get("plan", "").rsplit("/", 1)[-1].removesuffix(
        ".plan.json")
    return f"{row['method']} ({detail})" if detail else row["method"]


def best_per_band(rows: list[dict]) -> list[dict]:
    """Per compute band and library: the row with the highest held-out PSNR, and dcache's margin over the peers."""
    out = []
    for band in BANDS:
        best = {}
        for library in LIBRARIES:
            mine = [r for r in rows if r["band"] == band and r["library"] == library and r.get("psnr_heldout")]
            best[library] = max(mine, key=lambda r: r["psnr_heldout"]) if mine else None
        peers = [best[lib]["psnr_heldout"] for lib in LIBRARIES[1:] if best[lib]]
        margin = best["dcache"]["psnr_heldout"] - max(peers) if best["dcache"] and peers else None
        out.append({"band": band, "best": best, "margin": margin})
    return out


def batch1_efficiency(rows: list[dict]) -> list[dict]:
    """Per library, over rows whose batch-1 compute ratio is in BATCH1_RANGE: measured / ideal speed-up (wall clock
    and process CPU time), median and best, with the best row."""
    lo, hi = BATCH1_RANGE
    out = []
    for library in LIBRARIES:
        mine = [r for r in rows if r["library"] == library and lo <= r.get("b1_ratio", -1) <= hi
                and r.get("b1_meas_over_ideal")]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["b1_meas_over_ideal"])
        out.append({"library": library, "rows": len(mine),
                    "median": statistics.median(r["b1_meas_over_ideal"] for r in mine),
                    "median_cpu": statistics.median(r["b1_meas_over_ideal_cpu"] for r in mine),
                    "best": best})
    return out


def search_vs_dynamic(search: dict, targets: tuple[float, ...] = (0.5, 0.33)) -> list[dict]:
    """Per target compute ratio: the best held-out PSNR of a searched plan and of a dynamic schedule at a compute
    ratio <= target, and the plan families that Pareto-dominate every dynamic schedule there (search.json's
    verdicts)."""
    out = []
    for target in targets:
        def best(points: list[dict]) -> dict | None:
            within = [p for p in points if p["compute_ratio"] <= target + 1e-9]
            return max(within, key=lambda p: p["psnr"]) if within else None

        plans = [dict(p, family=family) for family, points in search["scored"].items() for p in points]
        met = sorted(key.split(":", 1)[1] for key, ok in search["verdicts"].items()
                     if ok and key.split(":", 1)[0] == f"{target:g}")
        out.append({"target": target, "plan": best(plans), "dynamic": best(search["dynamic"]), "met": met})
    return out


def frontier_best(scenario: dict) -> dict[float, dict[str, dict]]:
    """One scenario of frontier.json: per compute band and library, the row with the highest held-out PSNR."""
    out: dict[float, dict[str, dict]] = {band: {} for band in scenario["bands"]}
    for result in scenario["results"]:
        for row in result["rows"]:
            psnr = row.get("psnr_heldout")
            if row["band"] not in out or not isinstance(psnr, (int, float)) or psnr != psnr:  # NaN
                continue
            best = out[row["band"]].get(row["library"])
            if best is None or psnr > best["psnr_heldout"]:
                out[row["band"]][row["library"]] = row
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _front_plot(ax, series: dict[str, list[tuple[float, float]]], title: str) -> None:
    for name, points in series.items():
        color = COLORS.get(name, "#7f7f7f")
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=16, color=color, alpha=0.35, linewidths=0)
        front = pareto_front(points)
        ax.plot([p[0] for p in front], [p[1] for p in front], "-o", color=color, markersize=4, label=f"{name} "
                f"(Pareto front)")
    ax.invert_xaxis()
    ax.set_xlabel("compute ratio (block FLOPs computed / uncached)  \u2190 more compute")
    ax.set_ylabel("PSNR vs uncached, held-out samples (dB)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")


def plot_methods(methods: dict, path: Path) -> Path:
    """Held-out PSNR vs compute ratio of every method's selected settings, one Pareto front per library."""
    rows = methods_rows(methods)
    series = {lib: [(r["ratio"], r["psnr_heldout"]) for r in rows if r["library"] == lib and r.get("psnr_heldout")]
              for lib in LIBRARIES}
    meta = methods["meta"]
    return _save(series, path, f"Methods sweep: tiny-{meta.get('model', 'digits')}, {meta['steps']} steps, CFG "
                               f"{meta['guidance']} ({meta.get('cfg_mode', 'split')})")


def plot_search(search: dict, path: Path) -> Path:
    """Held-out PSNR vs compute ratio of every scored plan against the dynamic schedules of each library."""
    series = {lib: [(p["compute_ratio"], p["psnr"]) for p in search["dynamic"] if p["library"] == lib]
              for lib in LIBRARIES}
    series["plan search"] = [(p["compute_ratio"], p["psnr"]) for points in search["scored"].values() for p in points]
    return _save(series, path, "Plan search vs dynamic schedules: bundled tiny model, 28 steps")


def _save(series: dict[str, list[tuple[float, float]]], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    _front_plot(ax, {k: v for k, v in series.items() if v}, title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fmt_row(row: dict[str, Any] | None, psnr_key: str = "psnr_heldout", ratio_key: str = "ratio") -> str:
    if row is None:
        return "—"
    return f"{row[psnr_key]:.2f} dB · {_label(row)} @ {row[ratio_key]:.3f}"
