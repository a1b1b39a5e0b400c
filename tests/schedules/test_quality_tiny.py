"""Quality of every method on the bundled tiny trained model (FLUX-class, class-conditional digits, split CFG).

One fixed batch: digits 0..9 once (10 images), seed 0, 28 steps, guidance 3.0 (two transformer calls per step).
For each method at a stated setting:
  * compute ratio (block FLOPs computed / uncached, over the whole generation) at most the stated value;
  * PSNR of the images vs the uncached images at least the stated floor;
  * the digit classifier recognises at least 85% of the requested digits.
MagCache and TeaCache use the tables dcache ships for this model (pipelines/assets/calibration.json), which a test
checks against a fresh calibration.
Floors come from measurements (`python tests/schedules/test_quality_tiny.py` prints them) with a margin; each
case's comment gives the measured values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from schedule_testkit import true_compute_ratio

import dcache
from dcache import quality
from dcache.schedules import calibration_file
from dcache.schedules.tuning import calibrate
from dcache.schedules.tables import lookup_table

bundled = pytest.importorskip("dcache.pipelines.bundled")
# DCACHE_TINY_ASSETS=<folder> measures another build of the assets (e.g. a fresh train_tiny --out <folder>).
ASSETS = Path(os.environ.get("DCACHE_TINY_ASSETS", bundled.ASSETS_DIR))
if not (ASSETS / "tiny-digits" / "model_index.json").is_file() or not (
        ASSETS / "digit-classifier.safetensors").is_file():
    pytest.skip("the bundled tiny model assets are not built yet (python -m dcache.pipelines.train_tiny --out "
                "pipelines/assets)", allow_module_level=True)

LABELS = list(range(10))  # one sample per digit: every class is judged, at half the cost of two per digit
SEED, STEPS = 0, 28
MIN_ACCURACY = 0.85  # uncached: 1.00 on this batch; every case below measured 1.00


@dataclass(frozen=True)
class QualityCase:
    id: str
    method: str
    overrides: dict[str, Any]
    max_ratio: float
    min_psnr: float


# Measured on the bundled model (commit 4a35cca weights): compute ratio, PSNR vs uncached, classifier accuracy.
# Floors: PSNR 6 dB below the measurement (rounded down to 0.5 dB), compute ratio +0.07.
CASES = [
    # 0.518, 42.6 dB, 1.00 (the shipped ratios; E0.12 K4 as MagCache's Wan "fast" setting)
    QualityCase("magcache", "magcache", dict(threshold=0.12, max_skip_steps=4), 0.59, 36.5),
    # 0.607, 45.0 dB, 1.00 (defaults E0.06 K3 R0.2: what `dcache generate` runs)
    QualityCase("magcache-default", "magcache", {}, 0.68, 39.0),
    # 0.500, 55.5 dB, 1.00 (skipped steps forecast linearly, no retention, the last step computed)
    QualityCase("magcache-forecast", "magcache", dict(threshold=0.1, max_skip_steps=4, retention_ratio=0.0, order=1,
                                                    cutoff_steps=1), 0.57, 49.0),
    # 0.322, 36.8 dB, 1.00 (the shipped coefficients, threshold 0.2)
    QualityCase("teacache", "teacache", dict(threshold=0.2), 0.39, 30.5),
    # 0.688, 48.0 dB, 1.00
    QualityCase("fbcache", "fbcache", dict(threshold=0.12), 0.76, 41.5),
    # 0.840, 52.5 dB, 1.00 (F4B0 W4 MC4 R0.12: 4 probe blocks of 8)
    QualityCase("dbcache-fast", "dbcache-fast", {}, 0.91, 46.5),
    # 0.607, 44.1 dB, 1.00 (tau 0.1; the reference's 0.05 reuses nothing on this model)
    QualityCase("easycache", "easycache", dict(threshold=0.1), 0.68, 38.0),
    # 0.397, 48.8 dB, 1.00 (module outputs, N=3, order 1; 0.585 before a single block's proj_out was a unit)
    QualityCase("taylorseer", "taylorseer", dict(interval=3), 0.47, 42.5),
    # 0.393, 48.3 dB, 1.00 (stack residual forecast, N=3)
    QualityCase("taylorseer-stack", "taylorseer", dict(granularity="stack", interval=3), 0.46, 42.0),
    # 0.361, 40.7 dB, 1.00 (N=3; 0.561 before a single block's proj_out was a unit)
    QualityCase("fora", "fora", {}, 0.43, 34.5),
    # 0.536, 44.3 dB, 1.00 (every 2nd step)
    QualityCase("fixed_interval", "fixed_interval", {}, 0.61, 38.0),
    # 0.679, 40.5 dB, 1.00 (N=3, half the blocks)
    QualityCase("delta_dit", "delta_dit", {}, 0.75, 34.0),
    # 0.904, 47.7 dB, 1.00 (self-attention every 2nd step in the window; no cross-attention in FLUX)
    QualityCase("pab", "pab", {}, 0.95, 41.5),
    # 0.501, 45.8 dB, 1.00 (gate 0.2; FLUX's 0.03 forecasts nothing on this model; 42.1 dB without the run cap)
    QualityCase("cg_taylor", "cg_taylor", dict(threshold=0.2), 0.58, 39.5),
    # 0.469, 44.4 dB, 1.00 (gate always open: the run cap alone decides; uncapped it fell to ~17 dB)
    QualityCase("cg_taylor-open-gate", "cg_taylor", dict(threshold=100.0), 0.54, 38.0),
    # 0.464, 47.0 dB, 1.00 (SeaCache defaults: SEA gate 0.25, at most 2 linear forecasts in a row)
    QualityCase("seacache", "seacache", {}, 0.54, 41.0),
    # 0.357, 49.9 dB, 1.00 (open gate: 1 compute + 2 linear forecasts, the last step computed)
    QualityCase("seacache-cadence", "seacache-cadence", {}, 0.43, 43.5),
    # 0.357, 50.8 dB, 1.00 (the same with a quadratic forecast)
    QualityCase("seacache-order2", "seacache-cadence", dict(order=2), 0.43, 44.5),
    # Call scope (dcache.runtime.call_scope): a reused call is x + Delta of the whole transformer, embedders and head
    # included, so batch-1 speed-ups reach the ideal; measured in the same way:
    # 0.304, 46.3 dB, 1.00 (48.9 dB in block scope)
    QualityCase("magcache-forecast-call", "magcache", dict(threshold=0.3, max_skip_steps=4, retention_ratio=0.0,
                                                         order=1, cutoff_steps=1, scope="call"), 0.37, 40.0),
    # 0.357, 51.4 dB, 1.00 (49.9 dB in block scope)
    QualityCase("seacache-cadence-call", "seacache-cadence", dict(scope="call"), 0.43, 45.0),
    # 0.393, 33.9 dB, 1.00 (EasyCache's own formulation; tau 0.1 computes 0.607 of the blocks in block scope)
    QualityCase("easycache-call", "easycache", dict(threshold=0.1, scope="call"), 0.46, 27.5),
    # 0.393, 48.7 dB, 1.00 (48.3 dB in block scope)
    QualityCase("taylorseer-stack-call", "taylorseer", dict(granularity="stack", interval=3, scope="call"), 0.46,
                42.5),
]


def load_pipe():
    if ASSETS == bundled.ASSETS_DIR:
        return bundled.load_tiny_pipeline()
    from dcache.pipelines.tiny_pipeline import DigitFlowPipeline

    pipe = DigitFlowPipeline.from_pretrained(ASSETS / "tiny-digits", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_classifier():
    if ASSETS == bundled.ASSETS_DIR:
        return bundled.load_digit_classifier()
    from dcache.pipelines.digit_classifier import DigitClassifier

    return DigitClassifier.from_file(ASSETS / "digit-classifier.safetensors")


@pytest.fixture(scope="module")
def pipe():
    return load_pipe()


@pytest.fixture(scope="module")
def classifier():
    return load_classifier()


def generate(pipe, labels=LABELS, seed=SEED) -> torch.Tensor:
    return pipe(labels, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                output_type="pt").images


def accuracy(classifier, images) -> float:
    return float((classifier.predict(images) == torch.tensor(LABELS)).float().mean())


@pytest.fixture(scope="module")
def reference(pipe):
    return generate(pipe)


def calibrated_tables(pipe) -> dict[str, Any]:
    """MagCache ratios (one uncached run) and TeaCache coefficients (one run on another seed) of this model, made
    the way the tables registered in dcache.schedules.tuning.calibrate were made."""
    magcache = calibrate.calibrate_magcache(pipe, lambda: generate(pipe), register=False)
    # one run (54 points) fits within ~3% of the shipped fit; three runs came within ~1% at three times the cost
    teacache = calibrate.calibrate_teacache(pipe, [lambda: generate(pipe, seed=11)], register=False)
    return {"magcache": magcache, "teacache": teacache}


def measure(pipe, classifier, reference, method, overrides):
    # the floors were measured with one decision for the batch of labels (per-sample decisions, the default, take
    # each label's own: e.g. easycache-call computes 0.379 of the blocks at 33.9 dB; tests/core/test_per_sample.py)
    with dcache.apply(pipe, method, **{"decisions": "batch", **overrides}) as handle:
        images = generate(pipe)
        ratio = true_compute_ratio(handle)
    psnr = quality.psnr(images, reference, data_range=None, dtype=torch.float32)  # as the target sweeps measure
    return ratio, psnr, accuracy(classifier, images), images


def test_uncached_reference_is_recognised(classifier, reference):
    assert accuracy(classifier, reference) >= MIN_ACCURACY


def test_shipped_calibration_matches_a_fresh_calibration(pipe):
    """The tables dcache ships for this model (pipelines/assets/calibration.json, registered when dcache.pipelines
    is imported) are what calibration gives today; else the model was retrained and the file must be rewritten
    (`dcache calibrate`, or `python tests/schedules/test_quality_tiny.py --tables` prints fresh tables)."""
    presets = pytest.importorskip("dcache.pipelines.presets")
    if not presets.BUNDLED_CALIBRATION.is_file():
        pytest.skip("no calibration shipped for the bundled model yet")
    shipped = calibration_file.load_calibration(presets.BUNDLED_CALIBRATION)
    magcache = shipped.find("magcache", model=pipe.transformer, num_steps=STEPS)
    teacache = shipped.find("teacache", model=pipe.transformer, num_steps=STEPS)
    assert magcache is not None and teacache is not None
    assert lookup_table("magcache", pipe.transformer) == magcache.table  # registered on import
    fresh = calibrated_tables(pipe)
    for branch in ("cond", "uncond"):
        # another batch of labels / seeds than the shipped file's: ratios agree to ~8e-4
        assert fresh["magcache"][branch] == pytest.approx(magcache.table[branch], abs=5e-3)
    x = np.linspace(*teacache.table["x_range"], 9)
    # the fitted output-change estimates agree to ~3% (one calibration run: calibrated_tables)
    assert np.polyval(fresh["teacache"]["coefficients"], x) == pytest.approx(
        np.polyval(teacache.table["coefficients"], x), rel=0.12)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_quality_floor(case, pipe, classifier, reference):
    ratio, psnr, acc, images = measure(pipe, classifier, reference, case.method, case.overrides)
    assert torch.isfinite(images).all()
    assert ratio <= case.max_ratio, ratio
    assert psnr >= case.min_psnr, psnr
    assert acc >= MIN_ACCURACY, acc


if __name__ == "__main__":  # print the measurements the floors come from (--tables: fresh calibration tables)
    import json
    import sys

    torch.set_num_threads(1)
    p, c = load_pipe(), load_classifier()
    if "--tables" in sys.argv:
        print(json.dumps(calibrated_tables(p), indent=1))
        sys.exit()
    ref = generate(p)
    print(f"uncached accuracy {accuracy(c, ref):.3f}")
    for case in CASES:
        r, q, a, _ = measure(p, c, ref, case.method, case.overrides)
        print(f"{case.id:16s} compute ratio {r:.3f}  PSNR {q:6.2f} dB  accuracy {a:.3f}")
