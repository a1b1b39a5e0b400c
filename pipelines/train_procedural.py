"""Training of a bundled model on procedurally drawn data (`procedural_data`): the recipe train_motion and
train_shapes fill in.

1. A `ConvClassifier` judge on fresh batches of the generator (pixel noise added, sigma ~ U(0, 0.05)), scored on
   a held-out set drawn from another seed.
2. The transformer + `LabelEncoder` by rectified flow (`flow_training.train_flow`) on fresh batches, in latent
   space (pixels folded 2x2 into channels); the EMA of the weights ships.
3. Class accuracy and judge-feature Frechet distance of generated samples (default / 10 steps, with / without CFG,
   a guidance sweep), and the Frechet distance of two real sets (its floor at this sample count).
4. <out>/<name>/ (save_pretrained + METRICS.json + samples.png) and <out>/<classifier file>.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from . import flow_training
from .digit_classifier import ConvClassifier
from .flow_training import FlowConfig
from .label_encoder import LabelEncoder
from .procedural_data import class_batch, held_out


@dataclass(frozen=True)
class TrainConfig(FlowConfig):
    classifier_steps: int = 400  # fresh batches of the generator
    steps: int = 1500
    eval_per_class: int = 25
    held_out_per_class: int = 100  # real samples the judge is scored on and generated samples are compared to


@dataclass(frozen=True)
class Recipe:
    """What differs between the procedurally trained models."""

    name: str  # asset folder, e.g. "tiny-motion"
    script: str  # module name, e.g. "train_motion"
    classifier_file: str  # e.g. "motion-classifier.safetensors"
    class_names: tuple[str, ...]
    draw: Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # labels [B] -> samples [B, ...] in [0, 1]
    to_latents: Callable[[torch.Tensor], torch.Tensor]  # samples -> the transformer's x_0
    sample_shape: tuple[int, ...]  # one sample, what the classifier takes
    transformer: type  # a diffusers transformer class, built from transformer_config
    transformer_config: dict
    label_encoder_config: dict
    scheduler: type
    scheduler_config: dict
    pipeline: type  # a ClassConditionalPipeline subclass
    defaults: TrainConfig
    guidances: tuple[float, ...] = ()  # extra guidance scales evaluated at the default steps

    def build_model(self) -> nn.ModuleDict:
        """ModuleDict(transformer=..., label_encoder=...) with fresh weights (torch's global RNG)."""
        return nn.ModuleDict({"transformer": self.transformer(**self.transformer_config),
                              "label_encoder": LabelEncoder(**self.label_encoder_config)})

    def build_pipeline(self, trained: nn.ModuleDict):
        return self.pipeline(transformer=trained["transformer"], scheduler=self.scheduler(**self.scheduler_config),
                             label_encoder=trained["label_encoder"])

    def configs(self) -> dict:
        """The model configs METRICS.json records."""
        return dict(transformer_config=self.transformer_config, scheduler_config=self.scheduler_config,
                    label_encoder_config=self.label_encoder_config)


def velocity(model: nn.ModuleDict, x_t: torch.Tensor, labels: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t [B, C, ...], labels [B], t [B] in (0, 1) -> the transformer's prediction of noise - x_0, shaped as x_t.
    The timestep is 1000 t, as the Wan and SD3 samplers pass it; the pooled vector goes in where the family has one
    (SD3's pooled_projections; Wan has none)."""
    encoder_hidden_states, pooled = model["label_encoder"](labels)
    pooled_kwargs = {} if pooled is None else {"pooled_projections": pooled}
    return model["transformer"](hidden_states=x_t, timestep=1000 * t, encoder_hidden_states=encoder_hidden_states,
                                **pooled_kwargs, return_dict=False)[0]


def train_classifier(recipe: Recipe, cfg: TrainConfig) -> ConvClassifier:
    """`flow_training.train_classifier` on cfg.classifier_steps fresh batches with pixel noise."""
    generator = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # weight init, dropout
    model = ConvClassifier(num_classes=len(recipe.class_names), input_shape=recipe.sample_shape)

    def batches():
        for _ in range(cfg.classifier_steps):
            inputs, labels = class_batch(recipe.draw, len(recipe.class_names), cfg.classifier_batch, generator)
            sigma = 0.05 * torch.rand(cfg.classifier_batch, *[1] * (inputs.ndim - 1), generator=generator)
            yield (inputs + sigma * torch.randn(inputs.shape, generator=generator)).clamp(0, 1), labels

    return flow_training.train_classifier(model, batches(), cfg.classifier_steps, cfg.classifier_lr,
                                          warmup=cfg.classifier_steps // 10)


def train_transformer(recipe: Recipe, cfg: TrainConfig, on_step=None, init: Path | None = None) -> nn.ModuleDict:
    """Rectified flow on fresh batches of the generator, in latent space; returns the EMA ModuleDict. init: a
    folder this script wrote, whose weights the run continues from (a second learning-rate cycle)."""
    torch.manual_seed(cfg.seed)  # weight init
    model = recipe.build_model()
    if init is not None:
        trained = recipe.pipeline.from_pretrained(init, local_files_only=True)
        model["transformer"].load_state_dict(trained.transformer.state_dict())
        model["label_encoder"].load_state_dict(trained.label_encoder.state_dict())

    def data(generator):
        samples, labels = class_batch(recipe.draw, len(recipe.class_names), cfg.batch, generator)
        return recipe.to_latents(samples), labels

    return flow_training.train_flow(model, cfg, data, velocity, len(recipe.class_names), on_step)


def save_sample_grid(recipe: Recipe, pipe, path: Path, seed: int, per_class: int = 8) -> None:
    """Images: a row per class, per_class samples. Clips: a row per sample (two per class), a column per frame."""
    out = pipe(labels=flow_training.eval_labels(len(recipe.class_names), per_class),
               generator=torch.Generator().manual_seed(seed), output_type="pt")
    samples = flow_training.samples(out)
    if samples.ndim == 5:  # [C * per_class, F, 3, H, W]
        grid = samples.view(len(recipe.class_names), per_class, *samples.shape[1:])[:, :2].flatten(0, 1)
    else:  # [C * per_class, 3, H, W]
        grid = samples.view(len(recipe.class_names), per_class, *samples.shape[1:])
    flow_training.save_grid(grid, path)


def main(recipe: Recipe, argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=f"Trains the bundled {recipe.name} model and its judge on CPU.")
    parser.add_argument("--out", required=True, type=Path,
                        help=f"folder for {recipe.name}/ and {recipe.classifier_file}")
    parser.add_argument("--seed", type=int, default=recipe.defaults.seed)
    parser.add_argument("--steps", type=int, default=recipe.defaults.steps, help="diffusion training steps")
    parser.add_argument("--classifier-steps", type=int, default=recipe.defaults.classifier_steps)
    parser.add_argument("--threads", type=int, default=recipe.defaults.threads,
                        help="torch CPU threads; use 1 on a machine busy with other jobs")
    parser.add_argument("--init", type=Path, default=None,
                        help=f"continue from the weights of a {recipe.name} folder this script wrote (another "
                             f"--steps with a fresh learning-rate cycle)")
    parser.add_argument("--classifier-from", type=Path, default=None,
                        help=f"reuse this {recipe.classifier_file} instead of training the judge again")
    args = parser.parse_args(argv)
    cfg = replace(recipe.defaults, seed=args.seed, steps=args.steps, classifier_steps=args.classifier_steps,
                  threads=args.threads)
    torch.set_num_threads(cfg.threads)
    start = time.time()
    num_classes = len(recipe.class_names)

    test_x, test_y = held_out(recipe.draw, num_classes, cfg.held_out_per_class, cfg.seed + 100)
    classifier = (train_classifier(recipe, cfg) if args.classifier_from is None
                  else ConvClassifier.from_file(args.classifier_from))
    classifier_accuracy = (classifier.predict(test_x) == test_y).float().mean().item()
    print(f"classifier held-out accuracy: {classifier_accuracy:.4f} ({len(test_y)} samples)", flush=True)
    classifier_seconds = time.time() - start

    pipe = recipe.build_pipeline(train_transformer(recipe, cfg, init=args.init))
    pipe.set_progress_bar_config(disable=True)
    train_seconds = time.time() - start

    settings = flow_training.eval_settings(pipe.default_steps, pipe.default_guidance, recipe.guidances)
    metrics = flow_training.evaluate(pipe, classifier, settings, cfg.eval_per_class, cfg.eval_seed, test_x)
    # the same statistic between two real sets (as many as generated, and the held-out set): its floor
    real_x, _ = held_out(recipe.draw, num_classes, cfg.eval_per_class, cfg.seed + 200)
    metrics["frechet_real_vs_held_out"] = flow_training.frechet_distance(classifier.features(real_x),
                                                                         classifier.features(test_x))
    tick = time.time()
    pipe(labels=[0], generator=torch.Generator().manual_seed(0), output_type="pt")
    metrics["sample_seconds_1_sample_default_settings"] = round(time.time() - tick, 3)
    metrics.update(
        classifier_test_accuracy=classifier_accuracy,
        eval_samples=cfg.eval_per_class * num_classes,
        default_steps=pipe.default_steps,
        default_guidance_scale=pipe.default_guidance,
        default_cfg_mode=pipe.default_cfg_mode,
        scheduler=type(pipe.scheduler).__name__,
        class_names=list(recipe.class_names),
        **flow_training.run_record(
            recipe.script, argv, cfg,
            dict(classifier=classifier_seconds, train=train_seconds, total=time.time() - start),
            **recipe.configs(),
        ),
    )

    if args.init is not None:  # the run this one continues: its command and training seconds
        first = json.loads((args.init / "METRICS.json").read_text())
        metrics["continued_from"] = {k: first.get(k) for k in ("command", "train_seconds", "train_config")}
    model_dir = args.out / recipe.name
    pipe.save_pretrained(model_dir, safe_serialization=True)
    classifier.save(args.out / recipe.classifier_file)
    save_sample_grid(recipe, pipe, model_dir / "samples.png", cfg.eval_seed)
    (model_dir / "METRICS.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if not k.endswith("config")}, indent=2))
    return metrics


