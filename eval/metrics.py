"""Quality metrics: against the uncached output of the same seed, over distributions, and over video frames.

Images everywhere: float tensors [N, C, H, W] in [0, 1]; videos are flattened to frames [N*F, C, H, W] with
`frames_per_sample` = F. Per-image functions return a float64 tensor [N] so that results split over processes
merge exactly (means of per-image values, concatenation of features).

Reference metrics (cached vs uncached, same seed):  psnr, ssim, lpips, max_abs, mean_abs
Video (per frame = the reference metrics on frames): + temporal (|d/dt cached - d/dt uncached|, flicker change)
Distribution metrics (over the whole prompt x seed set): fid (Frechet distance on a feature extractor's features,
    vs the uncached set and, where the model has one, vs real data), accuracy (a classifier's agreement with the
    requested class), clip_score (CLIP image-text cosine), image_reward (optional `image-reward` package)

Metrics with pretrained networks (lpips, clip_score, image_reward, InceptionV3 features for fid) live in
eval/networks.py: they load weights the normal way (torchvision / Hugging Face caches, first use downloads) or take
an injected network. The bundled tiny model uses its digit classifier instead (features for FID, predictions for
accuracy).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dcache.quality import check_image_pair, feature_stats, frechet_distance, psnr_per_image, ssim_per_image

# ------------------------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "reference" | "video" | "distribution"
    doc: str
    higher_is_better: bool
    requires: tuple[tuple[str, str], ...] = ()  # (import name, pip requirement)
    extra: str | None = None  # the dcache extra that installs `requires`: pip install 'dcache[<extra>]'
    text_only: bool = False  # needs text prompts (not the digit model)
    tiny_only: bool = False  # needs the bundled digit classifier


METRICS: dict[str, MetricSpec] = {m.name: m for m in [
    MetricSpec("psnr", "reference", "PSNR (dB) vs the uncached image of the same seed; inf when identical", True),
    MetricSpec("ssim", "reference", "SSIM (Gaussian 11x11) vs uncached", True),
    MetricSpec("lpips", "reference", "LPIPS (AlexNet, torchmetrics) vs uncached; lower is closer", False,
               requires=(("torchvision", "torchvision"),), extra="metrics"),
    MetricSpec("max_abs", "reference", "max |cached - uncached| per image", False),
    MetricSpec("mean_abs", "reference", "mean |cached - uncached| per image", False),
    MetricSpec("temporal", "video", "mean |(x[t+1]-x[t]) - (r[t+1]-r[t])| over frames: temporal error vs uncached",
               False),
    MetricSpec("fid", "distribution", "Frechet distance of feature statistics (vs uncached set; vs real data where "
                                      "available). Digit model: classifier features; others: InceptionV3 2048-d",
               False),
    MetricSpec("accuracy", "distribution", "fraction of images the digit classifier assigns the requested label",
               True, tiny_only=True),
    MetricSpec("clip_score", "distribution", "CLIP score 100 * max(cos(image, prompt), 0) (default model "
                                             "openai/clip-vit-base-patch16, --clip-model)", True,
               requires=(("transformers", "transformers"),), extra="metrics", text_only=True),
    MetricSpec("image_reward", "distribution", "ImageReward-v1.0 human-preference score (optional)", True,
               requires=(("ImageReward", "image-reward"),), extra="image-reward", text_only=True),
]}

AUTO = "auto"
TINY_AUTO = ("psnr", "ssim", "max_abs", "mean_abs", "fid", "accuracy")
TEXT_AUTO = ("psnr", "ssim", "lpips", "max_abs", "mean_abs", "fid", "clip_score")


class MetricError(ValueError):
    """An unknown metric, or one that does not apply to this model."""


class MissingExtraError(ImportError):
    """A metric needs a package that is not installed; the message says what to pip install."""


def resolve_metrics(spec: str | Sequence[str] | None, *, is_tiny: bool, is_video: bool = False) -> list[str]:
    """Validate a metric list ("auto", "psnr,ssim", or a list). Unknown names and metrics that do not fit the model
    raise MetricError listing the choices; "auto" picks the default set for the model (video adds temporal)."""
    names = _split(spec)
    if not names or names == [AUTO]:
        names = list(TINY_AUTO if is_tiny else TEXT_AUTO)
        if is_video:
            names.append("temporal")
        return names
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise MetricError(f"unknown metric(s) {unknown}; choose from {sorted(METRICS)} or 'auto'.")
    for n in names:
        spec_ = METRICS[n]
        if spec_.tiny_only and not is_tiny:
            raise MetricError(f"metric {n!r} needs the bundled digit classifier; it applies to the tiny model only.")
        if spec_.text_only and is_tiny:
            raise MetricError(f"metric {n!r} needs text prompts; the digit model is class-conditional (use accuracy).")
    return list(dict.fromkeys(names))


def check_available(names: Sequence[str]) -> None:
    """Raise MissingExtraError for the first metric whose packages are not installed, with the pip line."""
    for n in names:
        spec = METRICS[n]
        for module, requirement in spec.requires:
            if importlib.util.find_spec(module) is None:
                how = f"pip install 'dcache[{spec.extra}]' (or pip install {requirement})" if spec.extra else \
                    f"pip install {requirement}"
                raise MissingExtraError(f"metric {n!r} needs the `{module}` package: {how}, or leave {n!r} out of "
                                        f"--metrics.")


def _split(spec: str | Sequence[str] | None) -> list[str]:
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return [s.strip().lower() for s in items if s and s.strip()]


# ------------------------------------------------------------------------------------------------------------------
# Reference metrics: cached vs uncached (same seed), one value per image, float64 [N]
# ------------------------------------------------------------------------------------------------------------------

# psnr_per_image and ssim_per_image: dcache.quality (imported above)


def max_abs_per_image(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_image_pair(a, b)
    return (a.double() - b.double()).abs().flatten(1).amax(1)


def mean_abs_per_image(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_image_pair(a, b)
    return (a.double() - b.double()).abs().flatten(1).mean(1)


REFERENCE_FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "psnr": psnr_per_image, "ssim": ssim_per_image, "max_abs": max_abs_per_image, "mean_abs": mean_abs_per_image,
}


def reference_metrics(cached: torch.Tensor, reference: torch.Tensor, names: Sequence[str],
                      networks: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
                      ) -> dict[str, list[float]]:
    """{metric: per-image values} for the reference metrics among `names` (per frame for videos). `networks` holds
    the scorers of reference metrics with pretrained networks ({"lpips": LpipsScorer(...)}, eval/networks.py)."""
    functions = {**REFERENCE_FUNCTIONS, **(networks or {})}
    missing = [n for n in names if METRICS[n].kind == "reference" and n not in functions]
    if missing:
        raise MetricError(f"reference metric(s) {missing} need a scorer network (e.g. networks={{'lpips': "
                          f"LpipsScorer()}} from dcache.eval.networks).")
    return {n: functions[n](cached, reference).tolist() for n in names if n in functions}


def temporal_error(cached: torch.Tensor, reference: torch.Tensor, frames_per_sample: int) -> torch.Tensor:
    """Per video [N]: mean |(c[t+1] - c[t]) - (r[t+1] - r[t])| over frames and pixels. 0 = the same motion and
    flicker as the uncached video (a frame-constant offset does not count; new flicker does)."""
    check_image_pair(cached, reference)
    f = int(frames_per_sample)
    if f < 2 or cached.shape[0] % f:
        raise ValueError(f"temporal_error needs frames [N*F, C, H, W] with F >= 2 dividing {cached.shape[0]}, got "
                         f"F={f}.")
    c = cached.double().reshape(-1, f, *cached.shape[1:])
    r = reference.double().reshape(-1, f, *reference.shape[1:])
    return ((c[:, 1:] - c[:, :-1]) - (r[:, 1:] - r[:, :-1])).abs().flatten(1).mean(1)


def flicker(frames: torch.Tensor, frames_per_sample: int) -> torch.Tensor:
    """Per video [N]: mean |x[t+1] - x[t]|, the raw frame-to-frame change (compare cached with uncached)."""
    f = int(frames_per_sample)
    x = frames.double().reshape(-1, f, *frames.shape[1:])
    return (x[:, 1:] - x[:, :-1]).abs().flatten(1).mean(1)


# ------------------------------------------------------------------------------------------------------------------
# Distribution metrics
# ------------------------------------------------------------------------------------------------------------------

# feature_stats and frechet_distance: dcache.quality (imported above)


def classifier_accuracy(predicted: torch.Tensor | Sequence[int], requested: torch.Tensor | Sequence[int]) -> float:
    p, r = torch.as_tensor(predicted).reshape(-1), torch.as_tensor(requested).reshape(-1)
    if p.shape != r.shape or p.numel() == 0:
        raise ValueError(f"accuracy needs one prediction per requested label, got {p.numel()} and {r.numel()}.")
    return float((p == r).double().mean())


class FeatureExtractor:
    """images [N, C, H, W] in [0, 1] -> features [N, F] (float64 on the CPU), for Frechet distances.

    `DigitFeatures` (the bundled classifier, tiny model; also the test stand-in) or `InceptionFeatures` (FID proper).
    """

    name = "features"

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DigitFeatures(FeatureExtractor):
    """The bundled DigitClassifier: penultimate features [N, 128] and predicted labels."""

    name = "digit-classifier"

    def __init__(self, classifier: Any = None):
        if classifier is None:
            from dcache.pipelines.bundled import load_digit_classifier

            classifier = load_digit_classifier()
        self.classifier = classifier

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier.features(images.float()).double().cpu()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier.predict(images.float()).cpu()


def finite_mean(values: Sequence[float]) -> float:
    """Mean that keeps inf (identical images give PSNR inf: the mean is inf, honestly) and ignores NaN."""
    vals = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return float(sum(vals) / len(vals)) if vals else float("nan")


__all__ = ["METRICS", "MetricSpec", "MetricError", "MissingExtraError", "resolve_metrics", "check_available",
           "psnr_per_image", "ssim_per_image", "max_abs_per_image", "mean_abs_per_image",
           "reference_metrics", "temporal_error", "flicker", "frechet_distance", "feature_stats",
           "classifier_accuracy", "FeatureExtractor", "DigitFeatures", "finite_mean"]
