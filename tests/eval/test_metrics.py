"""Metric values on inputs with known answers, and the registry's errors."""

import importlib.util
import math

import pytest
import torch

from dcache.eval.metrics import (MetricError, MissingExtraError, check_available, classifier_accuracy, flicker,
                                 frechet_distance, max_abs_per_image, mean_abs_per_image, psnr_per_image,
                                 reference_metrics, resolve_metrics, ssim_per_image, temporal_error)


def test_psnr_known_values_and_identical_images():
    a = torch.zeros(3, 1, 8, 8, dtype=torch.float64)
    b = a.clone()
    b[0] += 0.1  # mse 0.01 -> 20 dB
    b[1, :, :4] += 0.5  # half the pixels off by 0.5: mse 0.125 -> 9.0309 dB
    values = psnr_per_image(b, a)
    assert values[0].item() == pytest.approx(20.0, abs=1e-9)
    assert values[1].item() == pytest.approx(10 * math.log10(1 / 0.125), abs=1e-9)
    assert math.isinf(values[2].item())


def test_abs_errors_known_values():
    a = torch.zeros(2, 3, 4, 4)
    b = a.clone()
    b[0, 0, 0, 0] = 0.5
    b[1] = 0.25
    assert max_abs_per_image(a, b).tolist() == [0.5, 0.25]
    assert mean_abs_per_image(a, b).tolist() == pytest.approx([0.5 / 48, 0.25])


def test_ssim_is_one_for_identical_and_matches_torchmetrics():
    from torchmetrics.functional.image import structural_similarity_index_measure

    g = torch.Generator().manual_seed(0)
    a = torch.rand(4, 3, 32, 32, generator=g)
    b = (a + 0.05 * torch.randn(4, 3, 32, 32, generator=g)).clamp(0, 1)
    assert ssim_per_image(a, a).tolist() == pytest.approx([1.0] * 4, abs=1e-9)
    ours = ssim_per_image(a, b)
    ref = structural_similarity_index_measure(a.double(), b.double(), data_range=1.0, reduction="none")
    assert torch.equal(ours, ref.double())  # the same definition, bit for bit (dcache/quality.py, plain torch)
    assert (ours < 0.99).all()
    # 16x16 digits and smaller images work (kernel shrinks to fit)
    small = torch.rand(2, 1, 8, 8, generator=g)
    assert ssim_per_image(small, small).tolist() == pytest.approx([1.0, 1.0])


def test_reference_metrics_picks_requested_names_per_image():
    a, b = torch.zeros(2, 1, 4, 4), torch.full((2, 1, 4, 4), 0.1)
    out = reference_metrics(b, a, ["psnr", "max_abs", "fid"])
    assert set(out) == {"psnr", "max_abs"} and len(out["psnr"]) == 2
    assert out["psnr"][0] == pytest.approx(20.0)


def test_frechet_distance_closed_forms():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 6, generator=g, dtype=torch.float64)
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-8)
    mu = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.0, 3.0], dtype=torch.float64)
    # same covariance, shifted mean: FD = |mu|^2 exactly
    assert frechet_distance(x + mu, x) == pytest.approx(float((mu ** 2).sum()), rel=1e-9)
    # scaled copy: S_b = s^2 S_a -> FD = tr(S_a) (1 - s)^2 (means equal)
    s = 3.0
    xc = x - x.mean(0)
    expected = float(torch.cov(xc.T).trace()) * (1 - s) ** 2
    assert frechet_distance(xc * s, xc) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_matches_scipy_sqrtm_and_torchmetrics():
    import numpy as np
    import scipy.linalg
    from torchmetrics.image.fid import FrechetInceptionDistance

    g = torch.Generator().manual_seed(1)
    a = torch.rand(50, 1, 2, 2, generator=g)
    b = torch.rand(60, 1, 2, 2, generator=g) * 0.8 + 0.1
    fa, fb = a.flatten(1).double(), b.flatten(1).double()
    sa, sb = np.cov(fa.numpy(), rowvar=False), np.cov(fb.numpy(), rowvar=False)
    covmean = scipy.linalg.sqrtm(sa @ sb).real
    expected = float(((fa.mean(0) - fb.mean(0)) ** 2).sum()) + np.trace(sa) + np.trace(sb) - 2 * np.trace(covmean)
    assert frechet_distance(fb, fa) == pytest.approx(expected, rel=1e-6)

    class Flat(torch.nn.Module):  # torchmetrics FID with a custom feature extractor (the brief's alternative)
        def forward(self, x):
            return x.flatten(1).float()

    fid = FrechetInceptionDistance(feature=Flat(), normalize=True, input_img_size=(1, 2, 2))
    fid.update(a, real=True)
    fid.update(b, real=False)
    assert frechet_distance(fb, fa) == pytest.approx(float(fid.compute()), rel=1e-4)


def test_frechet_distance_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        frechet_distance(torch.zeros(1, 3), torch.zeros(5, 3))


def test_digit_classifier_features_as_fid_extractor(classifier_path):
    from dcache.eval.metrics import DigitFeatures
    from dcache.pipelines.digit_classifier import DigitClassifier

    feats = DigitFeatures(DigitClassifier.from_file(classifier_path))
    images = torch.rand(5, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    f = feats(images)
    assert f.shape == (5, 128) and f.dtype == torch.float64
    assert frechet_distance(f, f) == pytest.approx(0.0, abs=1e-6)
    assert feats.predict(images).shape == (5,)


def test_classifier_accuracy():
    assert classifier_accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    with pytest.raises(ValueError):
        classifier_accuracy([1, 2], [1])


def test_temporal_error_ignores_constant_offset_and_sees_flicker():
    f = 4
    # one video, a linear fade
    ref = torch.linspace(0, 1, f, dtype=torch.float64).reshape(f, 1, 1, 1).expand(f, 1, 2, 2).clone()
    assert temporal_error(ref + 0.1, ref, f).tolist() == pytest.approx([0.0], abs=1e-12)
    flick = ref.clone()
    flick[1] += 0.2  # one frame brighter: diffs +0.2 then -0.2 vs the reference
    assert temporal_error(flick, ref, f).item() == pytest.approx(0.4 / 3)
    assert flicker(ref, f).item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="F >= 2"):
        temporal_error(ref, ref, 1)


def test_resolve_metrics_errors_and_defaults():
    assert resolve_metrics("auto", is_tiny=True) == ["psnr", "ssim", "max_abs", "mean_abs", "fid", "accuracy"]
    assert "temporal" in resolve_metrics(None, is_tiny=False, is_video=True)
    assert resolve_metrics("PSNR, ssim,psnr", is_tiny=True) == ["psnr", "ssim"]
    with pytest.raises(MetricError, match="unknown metric.*'nope'.*choose from"):
        resolve_metrics("psnr,nope", is_tiny=True)
    with pytest.raises(MetricError, match="text prompts"):
        resolve_metrics("clip_score", is_tiny=True)
    with pytest.raises(MetricError, match="tiny model only"):
        resolve_metrics("accuracy", is_tiny=False)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_missing_extra_names_the_package():
    with pytest.raises(MissingExtraError, match="pip install torchvision"):
        check_available(["lpips"])
