"""Image grids and video files for humans to look at (PIL only; no extra dependency)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageDraw
import torch

from dcache.files.atomic import atomic_write_with


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[N, C, H, W] in [0, 1] -> [N, H, W, 3] uint8."""
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return np.repeat(arr, 3, axis=-1) if arr.shape[-1] == 1 else arr[..., :3]


# The difference heat maps' fixed scale: |cached - uncached| per pixel (images in [0, 1], channels averaged) of 0 is
# black, DIFF_VMAX / 2 red, DIFF_VMAX and above yellow. Fixed, not the image's own maximum, so the colour says how
# large a difference is: at 45 dB PSNR (RMS error 0.006) a map stays near black, at 20 dB (RMS 0.1) it runs red.
DIFF_VMAX = 0.25


def heat(diff: torch.Tensor, vmax: float = DIFF_VMAX) -> torch.Tensor:
    """|a - b| per pixel as a black-red-yellow heat map [N, 3, H, W] in [0, 1], saturating at vmax."""
    d = (diff.abs().mean(dim=1, keepdim=True) / max(float(vmax), 1e-8)).clamp(0, 1)
    return torch.cat([d.mul(2).clamp(0, 1), (d * 2 - 1).clamp(0, 1), torch.zeros_like(d)], dim=1)


def with_colorbar(canvas: PIL.Image.Image, vmax: float = DIFF_VMAX, *, left: int = 4,
                  title: str = "|cached - uncached| per pixel (images in [0, 1])") -> PIL.Image.Image:
    """`canvas` with the heat maps' colour bar below it: the black-red-yellow ramp from 0 to vmax, ticks at 0,
    vmax / 2 and vmax (marked '>=', the colour saturates there), and a title."""
    width = max(min(canvas.width - left - 8, 320), 120)
    ramp = heat(torch.linspace(0, vmax, width).view(1, 1, 1, width).expand(1, 1, 10, width), vmax)
    strip = PIL.Image.fromarray(to_uint8(ramp)[0])
    out = PIL.Image.new("RGB", (max(canvas.width, left + width + 40), canvas.height + 44), (255, 255, 255))
    out.paste(canvas, (0, 0))
    draw = PIL.ImageDraw.Draw(out)
    y = canvas.height + 4
    draw.text((left, y), title, fill=(60, 60, 60))
    out.paste(strip, (left, y + 13))
    for frac, text in ((0.0, "0"), (0.5, f"{vmax / 2:g}"), (1.0, f">={vmax:g}")):
        x = left + round(frac * (width - 1))
        draw.line([(x, y + 23), (x, y + 26)], fill=(0, 0, 0))
        draw.text((min(x, left + width - 6 * len(text)) if frac else x, y + 27), text, fill=(0, 0, 0))
    return out


def save_grid(rows: list[torch.Tensor], path: str | Path, *, row_labels: list[str] | None = None,
              scale: int = 1, pad: int = 2, label_width: int = 90, colorbar: float | None = None) -> Path:
    """Rows of images [N, C, H, W] in [0, 1] side by side, nearest-upscaled by `scale`, with a label column;
    colorbar=vmax adds the heat maps' colour bar below (a row made by heat(..., vmax))."""
    arrays = [to_uint8(r) for r in rows]
    n = max(a.shape[0] for a in arrays)
    h, w = arrays[0].shape[1] * scale, arrays[0].shape[2] * scale
    lw = label_width if row_labels else 0
    canvas = PIL.Image.new("RGB", (lw + n * (w + pad) + pad, len(arrays) * (h + pad) + pad), (255, 255, 255))
    draw = PIL.ImageDraw.Draw(canvas)
    for r, arr in enumerate(arrays):
        y = pad + r * (h + pad)
        if row_labels:
            draw.text((4, y + h // 2 - 6), row_labels[r], fill=(0, 0, 0))
        for i in range(arr.shape[0]):
            tile = PIL.Image.fromarray(arr[i]).resize((w, h), PIL.Image.NEAREST)
            canvas.paste(tile, (lw + pad + i * (w + pad), y))
    if colorbar is not None:
        canvas = with_colorbar(canvas, colorbar, left=lw + pad)
    return atomic_write_with(path, canvas.save)


def save_video(frames: torch.Tensor, path: str | Path, fps: int = 8) -> Path:
    """Frames [F, C, H, W] in [0, 1] -> an animated GIF (or MP4 through diffusers' exporter when the suffix asks)."""
    path = Path(path)
    arr = to_uint8(frames)
    if path.suffix == ".mp4":
        from diffusers.utils import export_to_video

        return atomic_write_with(path, lambda tmp: export_to_video([a for a in arr], str(tmp), fps=fps))
    images = [PIL.Image.fromarray(a) for a in arr]
    return atomic_write_with(path, lambda tmp: images[0].save(tmp, save_all=True, append_images=images[1:],
                                                              duration=int(1000 / fps), loop=0))
