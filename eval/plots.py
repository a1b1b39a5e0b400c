"""Plots for reports and analyses (matplotlib, Agg backend; every file written atomically).

    pareto_plot(points, "pareto.png")                      # speed-up vs quality, Pareto front highlighted
    heatmap(matrix [steps, blocks], "change.png", ...)     # per step x block statistics
    curve_plot({"cond": [...]}, "magnitude.png", ...)      # per-step curves (MagCache magnitude ratio)
    image_grid([(label, images, captions), ...], "grid.png")
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont
import torch

from dcache.optional_deps import require
from dcache.files.atomic import atomic_write_with


def _pyplot():
    matplotlib = require("matplotlib")  # the eval extra; names `pip install "dcache[eval]"` when missing
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, dpi: int = 110) -> Path:
    try:
        return atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight", facecolor="white"))
    finally:
        _pyplot().close(fig)


@dataclass
class ParetoPoint:
    label: str
    speedup: float | None  # measured
    ideal_speedup: float | None
    quality: float | None
    timing_valid: bool = True  # False: the measured speed-up exceeds the ideal one (eval.report.invalid_timings)


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool = True) -> list[int]:
    """Indices of the non-dominated points (x = speed-up, higher better; y = quality), sorted by x."""
    idx = [i for i, (x, y) in enumerate(points) if _ok(x) and _ok(y)]
    sign = 1 if higher_is_better else -1
    front = []
    for i in idx:
        xi, yi = points[i][0], sign * points[i][1]
        dominated = any(
            (points[j][0] >= xi and sign * points[j][1] >= yi) and (points[j][0] > xi or sign * points[j][1] > yi)
            for j in idx if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def _ok(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def pareto_plot(points: Sequence[ParetoPoint], path: str | Path, *, quality_name: str = "PSNR vs uncached (dB)",
                higher_is_better: bool = True, title: str = "Speed-up vs quality", reference: str = "uncached",
                measured: str = "measured latency",
                identical_label: str = "identical to uncached (drawn above the scale, not at a value)") -> Path:
    """Measured speed-up (filled) and ideal speed-up from the compute ratio (hollow) against quality; the Pareto
    front of the measured points is a line. A point whose timing is invalid (timing_valid False: measured above
    ideal) is drawn hollow at its ideal speed-up only, its label saying so, and stays off the front. Non-finite
    quality (output identical to the uncached one, PSNR inf) is drawn on a dashed line above the finite points,
    labelled `identical_label`: the line's height is not a value, so it sits well clear of the finite points and
    the axis ticks stop below it. The reference
    (`reference` label) is a black star."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    finite_q = [p.quality for p in points if _ok(p.quality) and p.label != reference]
    span = (max(finite_q) - min(finite_q)) if len(finite_q) > 1 else 1.0
    span = span or 1.0
    if finite_q:
        top = max(finite_q) + 0.3 * span if higher_is_better else min(finite_q) - 0.3 * span
    else:
        top = 1.0
    has_identical = any(p.quality is not None and not _ok(p.quality) for p in points)
    if has_identical:
        ax.axhline(top, color="0.6", lw=0.8, ls="--", zorder=0)
        ax.text(1.0, top, f" {identical_label} ", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                fontsize=7, color="0.3")
    colors = plt.get_cmap("tab10")
    drawn, placed = [], []
    for i, p in enumerate(points):
        q = p.quality if _ok(p.quality) else (top if p.quality is not None else None)
        if q is None:
            continue
        if p.label == reference:
            x = p.speedup if _ok(p.speedup) else 1.0
            ax.scatter([x], [q], marker="*", color="black", s=120, zorder=4, label=f"{reference} (reference)")
            drawn.append((x, q))
            continue
        color = colors(i % 10)
        if not p.timing_valid:  # not drawn at a speed-up it cannot have: only its ideal, named as such
            p = ParetoPoint(f"{p.label} (measured timing invalid)", None, p.ideal_speedup, p.quality)
        if _ok(p.speedup):
            ax.scatter([p.speedup], [q], color=color, s=55, zorder=3, label=p.label)
            drawn.append((p.speedup, q))
            anchor = p.speedup
        else:
            anchor = p.ideal_speedup
        if _ok(p.ideal_speedup):
            ax.scatter([p.ideal_speedup], [q], facecolors="none", edgecolors=[color], s=55, zorder=3,
                       label=None if _ok(p.speedup) else p.label)
            if _ok(p.speedup):
                ax.plot([p.speedup, p.ideal_speedup], [q, q], color=color, lw=0.8, ls=":", zorder=2)
        if _ok(anchor) and len(points) <= 5:  # more points: the legend names them (labels would collide)
            near = sum(1 for (x, y) in placed if abs(x - anchor) < 0.08 * max(anchor, 1) and abs(y - q) < 0.06 * span)
            ax.annotate(p.label, (anchor, q), textcoords="offset points", xytext=(6, 5 - 11 * near), fontsize=8,
                        color=color)
            placed.append((anchor, q))
    front = pareto_front(drawn, higher_is_better)
    if len(front) > 1:
        ax.plot([drawn[i][0] for i in front], [drawn[i][1] for i in front], color="0.4", lw=1.2, zorder=1,
                label="Pareto front (measured)")
    ax.axvline(1.0, color="0.85", lw=0.8, zorder=0)
    ax.set_xlabel(f"speed-up vs uncached  (filled: {measured}, hollow: ideal from compute ratio)", fontsize=9)
    ax.set_ylabel(quality_name)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.margins(x=0.12, y=0.12)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), framealpha=0.85, borderaxespad=0)
    if has_identical and finite_q:  # no tick at or beyond the dashed line: its height is not a quality value
        limit = max(finite_q) + 0.15 * span if higher_is_better else min(finite_q) - 0.15 * span
        low, high = ax.get_ylim()
        ax.set_yticks([t for t in ax.get_yticks() if low <= t <= high and (t <= limit if higher_is_better
                                                                          else t >= limit)])
        ax.set_ylim(low, high)
    return _save(fig, path)


def heatmap(matrix: np.ndarray | torch.Tensor, path: str | Path, *, title: str, xlabel: str = "block",
            ylabel: str = "step", cbar: str = "", cmap: str = "viridis", vmin: float | None = None,
            vmax: float | None = None, xticklabels: Sequence[str] | None = None,
            row_labels: Sequence[str] | None = None) -> Path:
    """A [rows, cols] matrix as an image (rows = steps top to bottom); NaN cells are grey."""
    plt = _pyplot()
    m = np.asarray(matrix, dtype=float)
    rows, cols = m.shape
    if row_labels is not None:  # a few labelled strips (rows) over many columns (steps)
        size = (min(3.0 + 0.22 * cols, 14), 1.2 + 0.32 * rows)
    else:
        size = (min(2.5 + 0.32 * cols, 16), min(1.6 + 0.16 * rows, 12))
    fig, ax = plt.subplots(figsize=size)
    cm = plt.get_cmap(cmap).with_extremes(bad="0.85")
    im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", cmap=cm, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xticklabels is not None and cols <= 64:
        ax.set_xticks(range(cols))
        ax.set_xticklabels(xticklabels, rotation=90 if cols > 12 else 0, fontsize=7)
    if row_labels is not None:
        ax.set_yticks(range(rows))
        ax.set_yticklabels(row_labels, fontsize=8)
    elif rows <= 64:
        step = max(1, rows // 16)
        ax.set_yticks(range(0, rows, step))
    fig.colorbar(im, ax=ax, label=cbar, fraction=0.046, pad=0.04)
    return _save(fig, path)


def curve_plot(curves: dict[str, Sequence[float]], path: str | Path, *, title: str, ylabel: str,
               xlabel: str = "step", hline: float | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, values in curves.items():
        ax.plot(range(len(values)), values, marker="o", ms=3, lw=1.2, label=name)
    if hline is not None:
        ax.axhline(hline, color="0.6", lw=0.8, ls="--")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=8)
    return _save(fig, path)


def _font(size: int = 11):
    try:
        return PIL.ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return PIL.ImageFont.load_default()


def image_grid(rows: Sequence[tuple[str, torch.Tensor, Sequence[str] | None]], path: str | Path, *,
               tile: int = 96, pad: int = 4, label_width: int = 170, caption_height: int = 16,
               note: str | None = None, colorbar: float | None = None) -> Path:
    """Rows (label, images [N, C, H, W] in [0, 1], per-image captions or None) as one PNG. Tiles are resized to
    `tile` pixels high (nearest-neighbour when upscaling small images, so pixels stay visible). colorbar=vmax: the
    heat maps' colour bar below (rows made by dcache.pipelines.images.heat at that vmax)."""
    from dcache.pipelines.images import to_uint8, with_colorbar

    font, small = _font(12), _font(10)
    arrays = [to_uint8(images) for _, images, _ in rows]
    h0, w0 = arrays[0].shape[1:3]
    th, tw = tile, max(1, round(tile * w0 / h0))
    n = max(a.shape[0] for a in arrays)
    row_h = th + caption_height + pad
    top = 18 if note else 0
    canvas = PIL.Image.new("RGB", (label_width + n * (tw + pad) + pad, top + len(rows) * row_h + pad), "white")
    draw = PIL.ImageDraw.Draw(canvas)
    if note:
        draw.text((4, 3), note, fill=(90, 90, 90), font=small)
    for r, ((label, _, captions), arr) in enumerate(zip(rows, arrays)):
        y = top + pad + r * row_h
        _wrap_text(draw, label, (4, y + th // 2 - 8), label_width - 8, font)
        for i in range(arr.shape[0]):
            img = PIL.Image.fromarray(arr[i])
            resample = PIL.Image.NEAREST if th >= img.height else PIL.Image.LANCZOS
            canvas.paste(img.resize((tw, th), resample), (label_width + pad + i * (tw + pad), y))
            if captions is not None and i < len(captions) and captions[i]:
                draw.text((label_width + pad + i * (tw + pad) + 2, y + th + 2), captions[i], fill=(40, 40, 40),
                          font=small)
    if colorbar is not None:
        canvas = with_colorbar(canvas, colorbar, left=label_width + pad)
    return atomic_write_with(path, canvas.save)


def _wrap_text(draw, text: str, xy: tuple[int, int], width: int, font) -> None:
    words, lines, line = [], [], ""
    for w in text.replace("(", " (").replace(",", ", ").split():
        while draw.textlength(w, font=font) > width and len(w) > 1:  # a word wider than the column: split it
            cut = max(1, int(len(w) * width / draw.textlength(w, font=font)))
            words.append(w[:cut])
            w = w[cut:]
        words.append(w)
    for w in words:
        trial = (line + " " + w).strip()
        if draw.textlength(trial, font=font) <= width or not line:
            line = trial
        else:
            lines.append(line)
            line = w
    lines.append(line)
    x, y = xy
    y -= 7 * (len(lines) - 1)
    for i, ln in enumerate(lines[:4]):
        draw.text((x, y + 14 * i), ln, fill=(0, 0, 0), font=font)


__all__ = ["ParetoPoint", "pareto_front", "pareto_plot", "heatmap", "curve_plot", "image_grid"]
