"""The bundled tiny model and its digit classifier, loaded from inside the installed package (offline, < 2 s).

    from dcache.pipelines.bundled import load_tiny_pipeline, load_digit_classifier
    pipe = load_tiny_pipeline()
    pipe("3").images[0]                                                            # a PIL image of a 3 (64x64)
    images = pipe(["3", "one", "4"], generator=torch.Generator().manual_seed(0), output_type="pt").images
    load_digit_classifier().predict(images)                    # images: [3, 1, 16, 16] in [0, 1] -> tensor([3, 1, 4])

The assets are written by `python -m dcache.pipelines.train_tiny --out pipelines/assets`; their quality numbers are
in `assets/tiny-digits/METRICS.json`.
"""

from pathlib import Path

import torch
from diffusers.utils import logging as diffusers_logging

from .digit_classifier import DigitClassifier
from .tiny_pipeline import DigitFlowPipeline

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TINY_MODEL_DIR = ASSETS_DIR / "tiny-digits"  # DigitFlowPipeline.save_pretrained layout
DIGIT_CLASSIFIER_PATH = ASSETS_DIR / "digit-classifier.safetensors"
_RETRAIN = "python -m dcache.pipelines.train_tiny --out pipelines/assets"


def load_tiny_pipeline(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, progress_bar: bool = False
) -> DigitFlowPipeline:
    """The bundled `DigitFlowPipeline` (FluxTransformer2DModel, 2 double + 6 single blocks) on `device` in `dtype`.

    progress_bar: show diffusers' progress bars while loading and generating (off by default: a call takes ~0.3 s).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32 or torch.bfloat16, "
                         f"got {dtype!r}.")
    if not (TINY_MODEL_DIR / "model_index.json").is_file():
        raise FileNotFoundError(f"The bundled tiny model is missing from {TINY_MODEL_DIR}; reinstall dcache or run "
                                f"`{_RETRAIN}`.")
    bar_was_enabled = diffusers_logging.is_progress_bar_enabled()
    if not progress_bar:
        diffusers_logging.disable_progress_bar()  # the "Loading pipeline components" bar
    try:
        pipe = DigitFlowPipeline.from_pretrained(TINY_MODEL_DIR, dtype=dtype, local_files_only=True)
    finally:
        if bar_was_enabled:
            diffusers_logging.enable_progress_bar()
    pipe.to(device)
    pipe.set_progress_bar_config(disable=not progress_bar)
    return pipe


def load_digit_classifier(device: str | torch.device = "cpu") -> DigitClassifier:
    """The bundled eval-mode `DigitClassifier`: `.predict(images)` -> labels, `.features(images)` -> [B, 128]."""
    if not DIGIT_CLASSIFIER_PATH.is_file():
        raise FileNotFoundError(f"The bundled digit classifier is missing at {DIGIT_CLASSIFIER_PATH}; "
                                f"run `{_RETRAIN}`.")
    return DigitClassifier.from_file(DIGIT_CLASSIFIER_PATH, device=device)
