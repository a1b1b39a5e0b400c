"""Procedurally drawn data for the bundled motion (Wan) and shapes (SD3) models, and their pixel latents.

Every sample is drawn from a torch.Generator, so a seed fixes a data set exactly (train, held-out and evaluation
sets are disjoint seeds). Shapes are rasterised at 4x resolution and average-pooled (anti-aliased edges).

- Motion clips: [B, F=5, 3, 16, 16] in [0, 1]: a camera pan over a smooth random colour field, the content moving
  2 px per frame in one direction; class = direction (`MOTION_CLASSES`).
- Shapes: [B, 3, 32, 32] in [0, 1]: one filled shape of random size and position on a dark background; class =
  shape x colour (`SHAPE_CLASSES`, 3 x 3 = 9).

Latents: the models learn on pixels folded 2x2 into channels (pixel-unshuffle, exact and invertible, no VAE to
train): images [B, 3, H, W] in [0, 1] -> latents [B, 12, H/2, W/2] in [-1, 1]; clips [B, F, 3, H, W] ->
[B, 12, F, H/2, W/2] (Wan's [B, C, F, H, W] layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPERSAMPLE = 4

# ---------------------------------------------------------------------------------------------------------------
# latents
# ---------------------------------------------------------------------------------------------------------------


def images_to_latents(images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] in [0, 1] -> [B, 4C, H/2, W/2] in [-1, 1] (channel c*4 + dy*2 + dx holds pixel (2i+dy, 2j+dx))."""
    return F.pixel_unshuffle(images * 2 - 1, 2)


def latents_to_images(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of `images_to_latents`, clamped: [B, 4C, h, w] -> [B, C, 2h, 2w] in [0, 1]."""
    return (F.pixel_shuffle(latents, 2) / 2 + 0.5).clamp(0, 1)


def clips_to_latents(clips: torch.Tensor) -> torch.Tensor:
    """[B, F, C, H, W] in [0, 1] -> [B, 4C, F, H/2, W/2] in [-1, 1]."""
    b, f = clips.shape[:2]
    latents = images_to_latents(clips.flatten(0, 1))  # [B*F, 4C, h, w]
    return latents.view(b, f, *latents.shape[1:]).transpose(1, 2)


def latents_to_clips(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of `clips_to_latents`, clamped: [B, 4C, F, h, w] -> [B, F, C, 2h, 2w] in [0, 1]."""
    b, _, f = latents.shape[:3]
    images = latents_to_images(latents.transpose(1, 2).flatten(0, 1))  # [B*F, C, H, W]
    return images.view(b, f, *images.shape[1:])


# ---------------------------------------------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------------------------------------------


def _grid(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel-centre coordinates of a supersampled size x size canvas, in output pixels: (y [S, 1], x [1, S])."""
    coords = (torch.arange(size * SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    return coords[:, None], coords[None, :]


def _compose(masks: torch.Tensor, colours: torch.Tensor, backgrounds: torch.Tensor) -> torch.Tensor:
    """masks [N, S, S] in {0, 1} (supersampled), colours [N, 3], backgrounds [N] -> images [N, 3, S/4, S/4]: the
    shape's colour over a grey background, edges anti-aliased by the 4x4 average."""
    coverage = F.avg_pool2d(masks[:, None].float(), SUPERSAMPLE)  # [N, 1, s, s] in [0, 1]
    return coverage * colours[:, :, None, None] + (1 - coverage) * backgrounds[:, None, None, None]


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=generator)


# ---------------------------------------------------------------------------------------------------------------
# motion clips
# ---------------------------------------------------------------------------------------------------------------

MOTION_CLASSES = ("right", "left", "down", "up")
MOTION_STEPS = torch.tensor([[1, 0], [-1, 0], [0, 1], [0, -1]])  # (dx, dy) per class: where the scene moves
CLIP_FRAMES = 5
CLIP_SIZE = 16
SPEED = 2  # pixels per frame
TEXTURE_GRID = 7  # the scene: random colours on a 7x7 grid, bicubically interpolated to the canvas
TRAVEL = SPEED * (CLIP_FRAMES - 1)  # 8 px: how far the window moves over the clip
CANVAS = CLIP_SIZE + TRAVEL  # 24


def draw_clips(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """labels [B] in 0..3 -> clips [B, 5, 3, 16, 16] in [0, 1]: a camera pan over a smooth colour field.

    Scene: random RGB colours on a 7x7 grid, bicubically interpolated to a 24x24 canvas. Frame f is the 16x16
    window at offset o_f = o_0 - f * SPEED * (dx, dy), so the scene's content moves SPEED px per frame in the class
    direction (x_f(p) = x_0(p - 2 f (dx, dy))); along the motion the window starts at the canvas edge that leaves
    room for the 8 px travel, across it at a random whole-pixel offset.

    Why a pan and not a small moving object: every pixel then carries the motion, so the label decides much of
    what a noisy clip becomes (a 4x4 square on a dark background is 6 % of the pixels, and a tiny Wan learnt to
    ignore its label there), and content shifts by a fixed offset between frames, which the relative positions of
    Wan's rotary attention express directly."""
    b = labels.shape[0]
    coarse = torch.rand(b, 3, TEXTURE_GRID, TEXTURE_GRID, generator=generator)
    scene = F.interpolate(coarse, size=(CANVAS, CANVAS), mode="bicubic", align_corners=True).clamp(0, 1)
    step = MOTION_STEPS[labels] * SPEED  # [B, 2] = (dx, dy) of the content per frame
    across = torch.randint(0, TRAVEL + 1, (b, 2), generator=generator)
    # the window moves against the content: content moving right = window starting at the right (offset TRAVEL)
    start = torch.where(step > 0, torch.full_like(step, TRAVEL), torch.where(step < 0, 0, across))  # [B, 2] (x, y)
    frames = []
    for f in range(CLIP_FRAMES):
        corner = start - f * step  # [B, 2] in [0, TRAVEL]
        frames.append(torch.stack([scene[i, :, y:y + CLIP_SIZE, x:x + CLIP_SIZE]
                                   for i, (x, y) in enumerate(corner.tolist())]))
    return torch.stack(frames, 1)  # [B, F, 3, 16, 16]


# ---------------------------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------------------------

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (0.9, 0.15, 0.15), "green": (0.15, 0.8, 0.2), "blue": (0.2, 0.3, 0.95)}
SHAPE_CLASSES = tuple(f"{colour} {shape}" for shape in SHAPES for colour in COLOURS)  # label = shape * 3 + colour
SHAPE_SIZE = 32


def draw_shapes(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """labels [B] in 0..8 -> images [B, 3, 32, 32] in [0, 1].

    Radius r ~ U(5, 10) px, centre uniform where the shape fits; circle: |p - c| <= r; square: half side 0.85 r;
    triangle: apex up at c - (0, r), base at c + (0, 0.8 r), half-width r at the base. Colour: the class colour
    +- 0.08 per channel; background: a grey in [0, 0.15]."""
    b = labels.shape[0]
    shape, colour = labels // len(COLOURS), labels % len(COLOURS)
    radius = _uniform(b, 5.0, 10.0, generator)[:, None, None]
    cx = (radius[:, 0, 0] + _uniform(b, 0, 1, generator) * (SHAPE_SIZE - 2 * radius[:, 0, 0]))[:, None, None]
    cy = (radius[:, 0, 0] + _uniform(b, 0, 1, generator) * (SHAPE_SIZE - 2 * radius[:, 0, 0]))[:, None, None]
    palette = torch.tensor(list(COLOURS.values()))  # [3, 3]
    colours = (palette[colour] + 0.08 * (2 * torch.rand(b, 3, generator=generator) - 1)).clamp(0, 1)
    backgrounds = _uniform(b, 0.0, 0.15, generator)
    y, x = _grid(SHAPE_SIZE)
    dx, dy = x - cx, y - cy  # [B, S, S]
    circle = dx**2 + dy**2 <= radius**2
    square = (dx.abs() <= 0.85 * radius) & (dy.abs() <= 0.85 * radius)
    depth = (dy + radius) / (1.8 * radius)  # 0 at the apex, 1 at the base
    triangle = (depth >= 0) & (depth <= 1) & (dx.abs() <= depth * radius)
    masks = torch.stack([circle, square, triangle], 1)[torch.arange(b), shape]  # [B, S, S]
    return _compose(masks, colours, backgrounds)


def class_batch(draw, num_classes: int, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, labels [batch]) with uniformly drawn labels: one training batch from `draw_clips` / `draw_shapes`."""
    labels = torch.randint(num_classes, (batch,), generator=generator)
    return draw(labels, generator), labels


def held_out(draw, num_classes: int, per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """per_class samples of each class, drawn from `seed`: (samples, labels [num_classes * per_class])."""
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    return draw(labels, torch.Generator().manual_seed(seed)), labels
