"""Image grids and video files for humans to look at (PIL only; no extra dependency)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageDraw
import torch

from dcache.io import atomic_write_with


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[N, C, H, W] in [0, 1] -> [N, H, W, 3] uint8."""
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return np.repeat(arr, 3, axis=-1) if arr.shape[-1] == 1 else arr[..., :3]


def heat(diff: torch.Tensor, vmax: float | None = None) -> torch.Tensor:
    """|a - b| per pixel as a black-red-yellow heat map [N, 3, H, W] in [0, 1] (vmax = max of the batch)."""
    d = diff.abs().mean(dim=1, keepdim=True)
    d = d / max(float(vmax if vmax is not None else d.max()), 1e-8)
    return torch.cat([d.mul(2).clamp(0, 1), (d * 2 - 1).clamp(0, 1), torch.zeros_like(d)], dim=1)


def save_grid(rows: list[torch.Tensor], path: str | Path, *, row_labels: list[str] | None = None,
              scale: int = 1, pad: int = 2, label_width: int = 90) -> Path:
    """Rows of images [N, C, H, W] in [0, 1] side by side, nearest-upscaled by `scale`, with a label column."""
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
