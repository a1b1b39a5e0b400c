"""Which metrics an eval computes, and the networks that compute them (built once per process, before generating).

    names, notes = resolve_eval_metrics("auto", is_tiny=False, is_video=True)
    judges = Judges(names, is_tiny=False, device="cpu", networks={"lpips": LpipsScorer(net=...)})
    judges.names, judges.notes        # "auto" drops (with a note) what cannot run here; explicit names must run

`networks` injects scorers for the metrics with pretrained networks (eval/networks.py): "lpips", "clip_score",
"image_reward", and "fid" (a FeatureExtractor). Tests pass small stand-ins; users get the default networks, or pass
`clip_model` / `image_reward_model` to load their own weights.
"""

from __future__ import annotations

from typing import Any, Callable

from .metrics import METRICS, DigitFeatures, FeatureExtractor, MissingExtraError, check_available, resolve_metrics
from .networks import (DEFAULT_CLIP, DEFAULT_IMAGE_REWARD, ClipScorer, ImageRewardScorer, InceptionFeatures,
                       LpipsScorer, MetricWeightsError)

NETWORK_METRICS = ("lpips", "clip_score", "image_reward", "fid")


def is_auto(metrics: str | list[str] | None) -> bool:
    return metrics is None or (isinstance(metrics, str) and metrics.strip().lower() in ("", "auto"))


def resolve_eval_metrics(metrics: str | list[str] | None, *, is_tiny: bool, is_video: bool,
                         classifier: str | None = None, injected: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(metrics to compute, notes). "auto" drops what cannot run here (with a note); explicit names must run.
    Metrics in `injected` have a network passed in, so their packages are not needed."""
    names = resolve_metrics(metrics, is_tiny=is_tiny, is_video=is_video)
    if not is_auto(metrics):
        check_available([n for n in names if n not in injected])
        return names, []
    from dcache.pipelines.bundled import DIGIT_CLASSIFIER_PATH

    keep, notes = [], []
    for n in names:
        try:
            if n not in injected:
                check_available([n])
        except MissingExtraError as exc:
            notes.append(f"skipped {n}: {exc}")
            continue
        if is_tiny and n in ("fid", "accuracy") and not classifier and not DIGIT_CLASSIFIER_PATH.is_file():
            notes.append(f"skipped {n}: the bundled digit classifier is not installed ({DIGIT_CLASSIFIER_PATH}).")
            continue
        keep.append(n)
    return keep, notes


class Judges:
    """The metric machinery of one process: feature extractor, digit classifier, network scorers."""

    def __init__(self, names: list[str], *, is_tiny: bool, device: str = "cpu", auto: bool = False,
                 classifier_path: str | None = None, classifier: Any = None, networks: dict[str, Any] | None = None,
                 clip_model: str = DEFAULT_CLIP, image_reward_model: str = DEFAULT_IMAGE_REWARD):
        self.names, self.notes = list(names), []
        self.features: FeatureExtractor | None = None
        self.digits: DigitFeatures | None = None
        networks = dict(networks or {})
        unknown = sorted(set(networks) - set(NETWORK_METRICS))
        if unknown:
            raise ValueError(f"networks {unknown} are not metrics with networks; inject one of {NETWORK_METRICS}.")
        builders: dict[str, Callable[[], Any]] = {
            "lpips": lambda: LpipsScorer(device=device),
            "clip_score": lambda: ClipScorer(clip_model, device=device),
            "image_reward": lambda: ImageRewardScorer(name=image_reward_model, device=device),
            "fid": lambda: InceptionFeatures(device=device),
        }
        if is_tiny and ("fid" in self.names or "accuracy" in self.names):
            if classifier is None and classifier_path:
                from dcache.pipelines.digit_classifier import DigitClassifier

                classifier = DigitClassifier.from_file(classifier_path)
            self.digits = DigitFeatures(classifier)
            self.features = self.digits
            builders.pop("fid")
        self.networks: dict[str, Any] = {}
        for n in [n for n in self.names if n in builders]:
            try:
                self.networks[n] = networks[n] if n in networks else builders[n]()
            except (MissingExtraError, MetricWeightsError) as exc:
                if not auto:
                    raise
                self.notes.append(f"skipped {n}: {exc}")
                self.names.remove(n)
        if "fid" in self.networks:
            self.features = self.networks.pop("fid")

    @property
    def reference_networks(self) -> dict[str, Any]:
        """Scorers of reference metrics (cached vs uncached), for metrics.reference_metrics."""
        return {n: s for n, s in self.networks.items() if METRICS[n].kind == "reference"}


__all__ = ["Judges", "resolve_eval_metrics", "is_auto", "NETWORK_METRICS"]
