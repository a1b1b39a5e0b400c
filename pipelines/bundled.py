"""The bundled models and their judges, loaded from inside the installed package (offline, < 2 s each).

    from dcache.pipelines.bundled import load_tiny_pipeline, load_digit_classifier
    pipe = load_tiny_pipeline()
    pipe("3").images[0]                                                            # a PIL image of a 3 (64x64)
    images = pipe(["3", "one", "4"], generator=torch.Generator().manual_seed(0), output_type="pt").images
    load_digit_classifier().predict(images)                    # images: [3, 1, 16, 16] in [0, 1] -> tensor([3, 1, 4])

    load_motion_pipeline()("right").frames[0]     # Wan family: 5 frames [5, 16, 16, 3] of a scene moving right
    load_shapes_pipeline()("red circle").images[0]           # SD3 family: a PIL image of a red circle (128x128)

| model | loader | judge | written by |
|---|---|---|---|
| tiny-digits (Flux) | `load_tiny_pipeline` | `load_digit_classifier` | `python -m dcache.pipelines.train_tiny` |
| tiny-motion (Wan) | `load_motion_pipeline` | `load_motion_classifier` | `python -m dcache.pipelines.train_motion` |
| tiny-shapes (SD3) | `load_shapes_pipeline` | `load_shapes_classifier` | `python -m dcache.pipelines.train_shapes` |

Each script takes `--out pipelines/assets`; the quality numbers are in `assets/<model>/METRICS.json`.
"""

import json
from pathlib import Path

import torch
from diffusers.utils import logging as diffusers_logging

from .class_pipeline import ClassConditionalPipeline
from .digit_classifier import ConvClassifier, DigitClassifier
from .motion_pipeline import MotionClipPipeline
from .shapes_pipeline import ShapesPipeline
from .tiny_pipeline import DigitFlowPipeline

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TINY_MODEL_DIR = ASSETS_DIR / "tiny-digits"  # DigitFlowPipeline.save_pretrained layout
DIGIT_CLASSIFIER_PATH = ASSETS_DIR / "digit-classifier.safetensors"
MOTION_MODEL_DIR = ASSETS_DIR / "tiny-motion"  # MotionClipPipeline.save_pretrained layout
MOTION_CLASSIFIER_PATH = ASSETS_DIR / "motion-classifier.safetensors"
SHAPES_MODEL_DIR = ASSETS_DIR / "tiny-shapes"  # ShapesPipeline.save_pretrained layout
SHAPES_CLASSIFIER_PATH = ASSETS_DIR / "shapes-classifier.safetensors"


def _retrain(script: str) -> str:
    return f"python -m dcache.pipelines.{script} --out pipelines/assets"


def _load(cls: type[ClassConditionalPipeline], folder: Path, script: str, device, dtype, progress_bar: bool):
    """`cls.from_pretrained(folder)` offline, on `device` in `dtype`, diffusers' bars on only with progress_bar."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32 or torch.bfloat16, "
                         f"got {dtype!r}.")
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"The bundled model {folder.name} is missing from {folder}; reinstall dcache or run "
                                f"`{_retrain(script)}`.")
    bar_was_enabled = diffusers_logging.is_progress_bar_enabled()
    if not progress_bar:
        diffusers_logging.disable_progress_bar()  # the "Loading pipeline components" bar
    try:
        pipe = cls.from_pretrained(folder, dtype=dtype, local_files_only=True)
    finally:
        if bar_was_enabled:
            diffusers_logging.enable_progress_bar()
    pipe.to(device)
    pipe.set_progress_bar_config(disable=not progress_bar)
    return pipe


def _load_classifier(path: Path, script: str, device, cls: type[ConvClassifier] = ConvClassifier):
    if not path.is_file():
        raise FileNotFoundError(f"The bundled classifier is missing at {path}; run `{_retrain(script)}`.")
    return cls.from_file(path, device=device)


def load_tiny_pipeline(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, progress_bar: bool = False
) -> DigitFlowPipeline:
    """The bundled `DigitFlowPipeline` (FluxTransformer2DModel, 2 double + 6 single blocks) on `device` in `dtype`.

    progress_bar: show diffusers' progress bars while loading and generating (off by default: a call takes ~0.3 s).
    """
    return _load(DigitFlowPipeline, TINY_MODEL_DIR, "train_tiny", device, dtype, progress_bar)


def load_digit_classifier(device: str | torch.device = "cpu") -> DigitClassifier:
    """The bundled eval-mode `DigitClassifier`: `.predict(images)` -> labels, `.features(images)` -> [B, 128]."""
    return _load_classifier(DIGIT_CLASSIFIER_PATH, "train_tiny", device, DigitClassifier)


def load_motion_pipeline(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, progress_bar: bool = False
) -> MotionClipPipeline:
    """The bundled `MotionClipPipeline` (WanTransformer3DModel, 4 blocks; UniPC flow sampler, split CFG at 5) on
    `device` in `dtype`. progress_bar: show diffusers' progress bars while loading and generating."""
    return _load(MotionClipPipeline, MOTION_MODEL_DIR, "train_motion", device, dtype, progress_bar)


def load_motion_classifier(device: str | torch.device = "cpu") -> ConvClassifier:
    """The motion judge: `.predict(frames)` with frames [B, 5, 3, 16, 16] in [0, 1] (the pipeline's
    output_type="pt" `.frames`) -> directions [B]; `.features(frames)` -> [B, 128]."""
    return _load_classifier(MOTION_CLASSIFIER_PATH, "train_motion", device)


def load_shapes_pipeline(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, progress_bar: bool = False
) -> ShapesPipeline:
    """The bundled `ShapesPipeline` (SD3Transformer2DModel, 4 joint blocks; flow-matching Euler, batched CFG at 4)
    on `device` in `dtype`. progress_bar: show diffusers' progress bars while loading and generating."""
    return _load(ShapesPipeline, SHAPES_MODEL_DIR, "train_shapes", device, dtype, progress_bar)


def load_shapes_classifier(device: str | torch.device = "cpu") -> ConvClassifier:
    """The shapes judge: `.predict(images)` with images [B, 3, 32, 32] in [0, 1] -> classes [B] (index into
    `procedural_data.SHAPE_CLASSES`); `.features(images)` -> [B, 128]."""
    return _load_classifier(SHAPES_CLASSIFIER_PATH, "train_shapes", device)


BUNDLED = {"tiny-digits": TINY_MODEL_DIR, "tiny-motion": MOTION_MODEL_DIR, "tiny-shapes": SHAPES_MODEL_DIR}


def metrics_table() -> str:
    """The bundled models' quality as a markdown table, from each model's METRICS.json (docs/bundled-models.md shows
    it; a test keeps the two equal)."""
    metrics = {name: json.loads((folder / "METRICS.json").read_text()) for name, folder in BUNDLED.items()}

    def row(label: str, value) -> str:
        return f"| {label} | " + " | ".join(value(m) for m in metrics.values()) + " |"

    def at_default(m: dict, what: str, cfg: str = "cfg") -> float:
        return m[f"{what}_{cfg}_{m['default_steps']}_steps"]

    def floor(m: dict) -> float:  # the digits script names the real-vs-real statistic after its data split
        return m.get("frechet_real_vs_held_out", m.get("frechet_real_train_vs_test"))

    def train_seconds(m: dict) -> float:  # a continued run adds the run it continued
        return m["train_seconds"] + (m.get("continued_from") or {}).get("train_seconds", 0)

    return "\n".join([
        "| | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|",
        row("samples judged per setting", lambda m: str(m["eval_samples"])),
        row("judge accuracy on clean held-out data", lambda m: f"{m['classifier_test_accuracy']:.1%}"),
        row("accuracy, default steps and guidance", lambda m: f"{at_default(m, 'accuracy'):.1%}"),
        row("accuracy, default steps, no CFG", lambda m: f"{at_default(m, 'accuracy', 'no_cfg'):.1%}"),
        row("accuracy, 10 steps, CFG", lambda m: f"{m['accuracy_cfg_10_steps']:.1%}"),
        row("Fréchet distance, default settings", lambda m: f"{at_default(m, 'frechet'):.2f}"),
        row("Fréchet distance, two real sets (floor)", lambda m: f"{floor(m):.2f}"),
        row("training, seconds (torch CPU threads)", lambda m: f"{train_seconds(m):,.0f} ({m['torch_threads']})"),
    ])
