"""Trains the bundled tiny model and its judge, on CPU, from scikit-learn's digits; writes the package assets.

    python -m dcache.pipelines.train_tiny --out pipelines/assets

1. `DigitClassifier` on the train split (augmented: small affine jitter, contrast and pixel noise), scored on the
   held-out test split.
2. A `FluxTransformer2DModel` + `LabelEncoder` by rectified flow on the train split:
       x_0 in [-1, 1] (packed [B, 64, 4]), noise ~ N(0, I), t ~ logit-normal(0, 1) (a fraction uniform),
       x_t = (1 - t) x_0 + t noise,  loss = || transformer(x_t, label, t) - (noise - x_0) ||^2,
   labels replaced by the null label with probability `label_dropout` (so classifier-free guidance works),
   AdamW with warmup + cosine decay, an EMA of the weights is what ships.
3. Class accuracy of generated samples (judged by the classifier) with/without CFG at 28 and 10 steps.
4. Writes <out>/tiny-digits/ (DigitFlowPipeline.save_pretrained + METRICS.json + samples.png) and
   <out>/digit-classifier.safetensors.

Deterministic for a given seed and thread count; about 8 minutes on 2 idle CPU cores.
"""

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from torch import nn

from . import flow_training
from .digit_classifier import NUM_CLASSES, DigitClassifier, load_digits_16
from .flow_training import FlowConfig, eval_labels, frechet_distance, generated_accuracy  # noqa: F401  (re-exported)
from .label_encoder import LabelEncoder
from .tiny_pipeline import DEFAULT_GUIDANCE, DEFAULT_STEPS, DigitFlowPipeline, image_ids, pack_images, text_ids, to_pil

# 2 double-stream + 6 single-stream blocks, 4 heads x 32 = 128 wide; RoPE axes (8, 12, 12) sum to the head dim 32.
TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=4,  # 2x2 packed 1-channel pixels
    num_layers=2,
    num_single_layers=6,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=64,
    pooled_projection_dim=64,
    guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)
LABEL_ENCODER_CONFIG = dict(num_classes=NUM_CLASSES, num_tokens=4, joint_attention_dim=64, pooled_projection_dim=64)
# Static shift of the sampling sigmas, sigma' = s * sigma / (1 + (s - 1) * sigma); 64 tokens need little shift.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


@dataclass(frozen=True)
class TrainConfig(FlowConfig):
    classifier_epochs: int = 25  # over the train split, augmented


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Classifier augmentation, [B, 1, 16, 16] in [0, 1] -> same: rotation +-12 deg, scale +-10 %, shift +-1.5 px,
    contrast x[0.75, 1.1], Gaussian pixel noise with sigma ~ U(0, 0.1)."""
    b = images.shape[0]

    def uniform(*shape, low, high):
        return low + (high - low) * torch.rand(*shape, generator=generator)

    angle = uniform(b, low=-math.radians(12), high=math.radians(12))
    scale = uniform(b, low=0.9, high=1.1)
    shift = uniform(b, 2, low=-0.1875, high=0.1875)  # affine_grid units: 1 px = 2 / 16
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1),
                         torch.stack([sin, cos, shift[:, 1]], 1)], 1)  # [B, 2, 3]
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, padding_mode="zeros", align_corners=False)
    out = out * uniform(b, 1, 1, 1, low=0.75, high=1.1)
    out = out + uniform(b, 1, 1, 1, low=0.0, high=0.1) * torch.randn(out.shape, generator=generator)
    return out.clamp(0, 1)


def train_classifier(cfg: TrainConfig, images: torch.Tensor, labels: torch.Tensor) -> DigitClassifier:
    """`flow_training.train_classifier` over epochs of augmented, shuffled batches; returns the eval-mode
    classifier."""
    generator = torch.Generator().manual_seed(cfg.seed)
    model = DigitClassifier()
    per_epoch = math.ceil(len(labels) / cfg.classifier_batch)

    def batches():
        for _ in range(cfg.classifier_epochs):
            for idx in torch.randperm(len(labels), generator=generator).split(cfg.classifier_batch):
                yield augment(images[idx], generator), labels[idx]

    return flow_training.train_classifier(model, batches(), cfg.classifier_epochs * per_epoch, cfg.classifier_lr,
                                          warmup=per_epoch)


def train_transformer(
    cfg: TrainConfig, images: torch.Tensor, labels: torch.Tensor,
    on_step: Callable[[int, nn.ModuleDict], None] | None = None,
) -> nn.ModuleDict:
    """Rectified-flow training (`flow_training.train_flow`); returns the EMA ModuleDict(transformer=...,
    label_encoder=...).

    on_step(step, ema), if given, runs after every optimizer step (e.g. to evaluate checkpoints while tuning)."""
    torch.manual_seed(cfg.seed)  # weight init
    model = nn.ModuleDict(
        {"transformer": FluxTransformer2DModel(**TRANSFORMER_CONFIG),
         "label_encoder": LabelEncoder(**LABEL_ENCODER_CONFIG)}
    )
    x0_all = pack_images(images * 2 - 1)  # [N, 64, 4] in [-1, 1]
    img_ids, txt_ids = image_ids(), text_ids(LABEL_ENCODER_CONFIG["num_tokens"])

    def data(generator):
        idx = torch.randint(len(labels), (cfg.batch,), generator=generator)
        return x0_all[idx], labels[idx]  # [B, 64, 4], [B]

    def velocity(model, x_t, y, t):
        encoder_hidden_states, pooled = model["label_encoder"](y)
        return model["transformer"](
            hidden_states=x_t,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled,
            timestep=t,  # the pipeline passes t / 1000 = sigma: same convention
            img_ids=img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )[0]

    return flow_training.train_flow(model, cfg, data, velocity, NUM_CLASSES, on_step)


def build_pipeline(trained: nn.ModuleDict) -> DigitFlowPipeline:
    return DigitFlowPipeline(
        transformer=trained["transformer"],
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        label_encoder=trained["label_encoder"],
    )


def evaluate(pipe: DigitFlowPipeline, classifier: DigitClassifier, cfg: TrainConfig, real: torch.Tensor) -> dict:
    """Class accuracy and classifier-feature Frechet distance to `real` images (the held-out split) of generated
    samples: (steps, guidance) in {28, 10} x {default, none}, plus guidance 2 and 3 at 28 steps (the tuning sweep)."""
    settings = flow_training.eval_settings(DEFAULT_STEPS, DEFAULT_GUIDANCE, (2.0, 3.0))
    return flow_training.evaluate(pipe, classifier, settings, cfg.eval_per_class, cfg.eval_seed, real)


def save_sample_grid(pipe: DigitFlowPipeline, path: Path, seed: int) -> None:
    """10 x 10 grid (row = digit) at the default steps and guidance, as a PNG."""
    images = pipe(eval_labels(NUM_CLASSES, 10), generator=torch.Generator().manual_seed(seed), output_type="pt").images
    # images: [100, 1, 16, 16]
    grid = images.view(NUM_CLASSES, 10, 16, 16).permute(0, 2, 1, 3).reshape(NUM_CLASSES * 16, 10 * 16)
    to_pil(grid[None], scale=2).save(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="folder for tiny-digits/ and digit-classifier.safetensors")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps, help="diffusion training steps")
    parser.add_argument("--classifier-epochs", type=int, default=TrainConfig.classifier_epochs)
    parser.add_argument(
        "--threads", type=int, default=TrainConfig.threads,
        help="torch CPU threads; use 1 on a machine busy with other jobs"
    )
    args = parser.parse_args(argv)
    cfg = TrainConfig(seed=args.seed, steps=args.steps, classifier_epochs=args.classifier_epochs, threads=args.threads)
    torch.set_num_threads(cfg.threads)
    start = time.time()

    train_x, train_y = load_digits_16("train")
    test_x, test_y = load_digits_16("test")
    classifier = train_classifier(cfg, train_x, train_y)
    classifier_accuracy = (classifier.predict(test_x) == test_y).float().mean().item()
    print(f"classifier held-out accuracy: {classifier_accuracy:.4f} ({len(test_y)} test digits)", flush=True)
    classifier_seconds = time.time() - start

    trained = train_transformer(cfg, train_x, train_y)
    pipe = build_pipeline(trained)
    pipe.set_progress_bar_config(disable=True)
    train_seconds = time.time() - start

    metrics = evaluate(pipe, classifier, cfg, test_x)
    # the same statistic between real digits (train split, as many as generated) and the held-out split: its floor
    n_eval = cfg.eval_per_class * NUM_CLASSES
    metrics["frechet_real_train_vs_test"] = frechet_distance(classifier.features(train_x[:n_eval]),
                                                             classifier.features(test_x))
    tick = time.time()
    pipe([0], generator=torch.Generator().manual_seed(0), output_type="pt")  # 28 steps, split CFG: 56 calls
    metrics["sample_seconds_1_image_28_steps_split_cfg"] = round(time.time() - tick, 3)
    metrics.update(
        classifier_test_accuracy=classifier_accuracy,
        eval_samples=cfg.eval_per_class * NUM_CLASSES,
        default_steps=DEFAULT_STEPS,
        default_guidance_scale=DEFAULT_GUIDANCE,
        **flow_training.run_record(
            "train_tiny", argv, cfg,
            dict(classifier=classifier_seconds, train=train_seconds, total=time.time() - start),
            transformer_config=TRANSFORMER_CONFIG, scheduler_config=SCHEDULER_CONFIG,
            label_encoder_config=LABEL_ENCODER_CONFIG,
        ),
    )

    model_dir = args.out / "tiny-digits"
    pipe.save_pretrained(model_dir, safe_serialization=True)
    classifier.save(args.out / "digit-classifier.safetensors")
    save_sample_grid(pipe, model_dir / "samples.png", cfg.eval_seed)
    (model_dir / "METRICS.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if not k.endswith("config")}, indent=2))
    return metrics


if __name__ == "__main__":
    main()
