"""What the bundled models' training scripts share (train_tiny, train_motion, train_shapes).

- `train_classifier`: the judge, AdamW + warmup/cosine, label smoothing 0.05, over the batches a script yields.
- `train_flow`: rectified flow with label dropout and an EMA of the weights:
      x_0 = data, noise ~ N(0, I), t ~ logit-normal(0, 1) (a fraction uniform), x_t = (1 - t) x_0 + t noise,
      loss = || velocity(model, x_t, y, t) - (noise - x_0) ||^2, y replaced by the null label with probability p.
- `evaluate`: class accuracy and judge-feature Frechet distance of generated samples at several (steps, guidance).
- `run_record`: the METRICS.json fields every script writes (command, seconds, threads, configs).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dcache import quality
from dcache.compat.torch import foreach_lerp_

from .digit_classifier import ConvClassifier


@dataclass(frozen=True)
class FlowConfig:
    """The settings every training script shares; each script's TrainConfig adds its classifier's schedule."""

    seed: int = 0
    threads: int = 2
    # classifier
    classifier_batch: int = 64
    classifier_lr: float = 2e-3
    # diffusion model
    steps: int = 800
    batch: int = 64
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema_decay: float = 0.998
    label_dropout: float = 0.1
    uniform_t_fraction: float = 0.2  # the rest of t is logit-normal(0, 1), as in SD3
    # evaluation
    eval_per_class: int = 20
    eval_seed: int = 1234


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup to 1, then cosine decay to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def sample_t(batch: int, uniform_fraction: float, generator: torch.Generator) -> torch.Tensor:
    """t [B] in (0, 1): logit-normal(0, 1) (mass in the middle, where the velocity is hardest), a fraction uniform."""
    t = torch.sigmoid(torch.randn(batch, generator=generator))
    uniform = torch.rand(batch, generator=generator)
    return torch.where(torch.rand(batch, generator=generator) < uniform_fraction, uniform, t)


def train_classifier(model: ConvClassifier, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], total: int,
                     lr: float, warmup: int) -> ConvClassifier:
    """AdamW + warmup/cosine, label smoothing 0.05, over `total` (inputs, labels) batches; returns the eval-mode
    classifier."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup))
    model.train()
    with tqdm(total=total, desc="classifier", mininterval=2) as bar:
        for inputs, labels in batches:
            loss = F.cross_entropy(model(inputs), labels, label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return model.eval()


def train_flow(
    model: nn.ModuleDict, cfg: FlowConfig, data: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    velocity: Callable[[nn.ModuleDict, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], null_label: int,
    on_step: Callable[[int, nn.ModuleDict], None] | None = None,
) -> nn.ModuleDict:
    """Rectified-flow training of `model` (its weights initialised by the caller); returns the EMA copy.

    data(generator) -> (x_0 [B, ...], labels [B]): one training batch, drawn with the generator.
    velocity(model, x_t, labels, t [B]) -> the model's prediction of noise - x_0, shaped as x_t.
    on_step(step, ema), if given, runs after every optimizer step (e.g. to evaluate checkpoints while tuning)."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)  # batches, t, noise, label dropout
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.steps, cfg.warmup))
    null = torch.tensor(null_label)
    model.train()
    with tqdm(total=cfg.steps, desc="transformer", mininterval=5) as bar:
        for step in range(cfg.steps):
            x0, labels = data(generator)
            noise = torch.randn(x0.shape, generator=generator)
            t = sample_t(cfg.batch, cfg.uniform_t_fraction, generator)  # [B]
            t_x = t.view(-1, *[1] * (x0.ndim - 1))  # [B, 1, ...]
            x_t = (1 - t_x) * x0 + t_x * noise
            y = torch.where(torch.rand(cfg.batch, generator=generator) < cfg.label_dropout, null, labels)
            loss = F.mse_loss(velocity(model, x_t, y, t), noise - x0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            decay = min(cfg.ema_decay, (1 + step) / (10 + step))  # EMA warmup
            foreach_lerp_(ema_params, [p.detach() for p in params], 1 - decay)  # ema += (1 - d) (p - ema)
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
            if on_step is not None:
                on_step(step + 1, ema)
    return ema


def eval_labels(num_classes: int, per_class: int) -> list[int]:
    """[0]*per_class + [1]*per_class + ... + [num_classes - 1]*per_class."""
    return [label for label in range(num_classes) for _ in range(per_class)]


def samples(output) -> torch.Tensor:
    """A pipeline output's samples: `.frames` of a video pipeline, else `.images`."""
    frames = getattr(output, "frames", None)
    return output.images if frames is None else frames


@torch.no_grad()
def generate_eval_set(pipe, per_class: int, num_inference_steps: int, guidance_scale: float,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One seeded batch, per_class samples of each class -> (samples [C * per_class, ...] in [0, 1], labels)."""
    labels = eval_labels(pipe.num_classes, per_class)
    out = pipe(labels=labels, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
               generator=torch.Generator().manual_seed(seed), output_type="pt")
    return samples(out), torch.tensor(labels)


def generated_accuracy(pipe, classifier: ConvClassifier, per_class: int = 20, num_inference_steps: int | None = None,
                       guidance_scale: float | None = None, seed: int = 1234) -> float:
    """Fraction of generated samples (per_class of each class, one seeded batch; the pipeline's default steps and
    guidance unless given) the classifier labels as requested."""
    steps = pipe.default_steps if num_inference_steps is None else num_inference_steps
    guidance = pipe.default_guidance if guidance_scale is None else guidance_scale
    images, labels = generate_eval_set(pipe, per_class, steps, guidance, seed)
    return (classifier.predict(images) == labels).float().mean().item()


@torch.no_grad()
def frechet_distance(features_a: torch.Tensor, features_b: torch.Tensor) -> float:
    """dcache.quality.frechet_distance with 1e-6 I added to both covariances: the classifier's dead ReLU features
    make them singular. Biased upward for small N: compare only at equal N."""
    return quality.frechet_distance(features_a, features_b, eps=1e-6)


def eval_settings(default_steps: int, default_guidance: float, guidances: Iterable[float] = ()) -> dict:
    """{name: (steps, guidance)}: default steps and 10 steps, with the default guidance and without CFG, plus
    the extra guidances at the default steps (a tuning sweep)."""
    settings = {
        f"cfg_{default_steps}_steps": (default_steps, default_guidance),
        f"no_cfg_{default_steps}_steps": (default_steps, 1.0),
        "cfg_10_steps": (10, default_guidance),
        "no_cfg_10_steps": (10, 1.0),
    }
    settings.update({f"guidance_{g}_{default_steps}_steps": (default_steps, g) for g in guidances
                     if g != default_guidance})
    return settings


def evaluate(pipe, classifier: ConvClassifier, settings: dict, per_class: int, seed: int,
             real: torch.Tensor) -> dict:
    """Class accuracy and classifier-feature Frechet distance to `real` samples (held out) of generated samples,
    per setting {name: (steps, guidance)} -> {"accuracy_<name>": ..., "frechet_<name>": ...}."""
    real_features = classifier.features(real)
    results = {}
    for name, (steps, guidance) in tqdm(settings.items(), desc="evaluate"):
        images, labels = generate_eval_set(pipe, per_class, steps, guidance, seed)
        results[f"accuracy_{name}"] = (classifier.predict(images) == labels).float().mean().item()
        results[f"frechet_{name}"] = frechet_distance(classifier.features(images), real_features)
    return results


def run_record(script: str, argv: list[str] | None, cfg: FlowConfig, seconds: dict, **configs) -> dict:
    """The METRICS.json fields every training script writes: the command, the seconds of each stage (rounded),
    the torch threads, the training config and the model configs (name_config=...)."""
    return {
        **{f"{name}_seconds": round(value, 1) for name, value in seconds.items()},
        "torch_threads": cfg.threads,
        "command": f"python -m dcache.pipelines.{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "train_config": asdict(cfg),
        **configs,
    }


def save_grid(images: torch.Tensor, path, scale: int = 4, pad: int = 1) -> None:
    """images [rows, cols, C, h, w] in [0, 1] (C = 1 or 3) -> one PNG: a grid with `pad` grey pixels between
    cells, nearest-neighbour upscaled by `scale`."""
    import PIL.Image

    rows, cols, c, h, w = images.shape
    canvas = torch.full((c, rows * (h + pad) + pad, cols * (w + pad) + pad), 0.5)
    for r in range(rows):
        for k in range(cols):
            top, left = pad + r * (h + pad), pad + k * (w + pad)
            canvas[:, top:top + h, left:left + w] = images[r, k]
    pixels = (canvas.permute(1, 2, 0).squeeze(-1) * 255).round().to(torch.uint8).numpy()  # [H, W(, 3)]
    pil = PIL.Image.fromarray(pixels)
    pil.resize((pil.width * scale, pil.height * scale), resample=PIL.Image.NEAREST).save(path)
