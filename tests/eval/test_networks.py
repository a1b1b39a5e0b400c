"""Metrics with pretrained networks (LPIPS, CLIP score, ImageReward) wired to stand-in networks, and the errors a
user gets when a package or the weights are missing. Nothing is downloaded; no number here is a real LPIPS / CLIP /
ImageReward value."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from stand_ins import Brightness, SquaredError, tiny_clip

from dcache.eval.judges import Judges
from dcache.eval.metrics import MetricError, MissingExtraError, psnr_per_image, reference_metrics
from dcache.eval.networks import ClipScorer, ImageRewardScorer, LpipsScorer, MetricWeightsError

PROMPTS = ["a red fox", "a blue cat jumps", "the city at night", "snow", "a cat in the rain"]


def _images(n=5, channels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, channels, 16, 16, generator=g)


def test_lpips_feeds_the_network_rgb_in_minus_one_to_one_per_image():
    net = SquaredError()
    a = _images(5, channels=1)
    b = (a + 0.05 * torch.randn(a.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    values = LpipsScorer(net=net, batch=2)(a, b)  # 3 chunks: 2 + 2 + 1
    assert [s[0] for s in net.seen] == [(2, 3, 16, 16)] * 4 + [(1, 3, 16, 16)] * 2  # gray repeated to RGB
    assert min(s[1] for s in net.seen) >= -1.0 and max(s[2] for s in net.seen) <= 1.0
    assert min(s[1] for s in net.seen) < -0.9 and max(s[2] for s in net.seen) > 0.9  # [0, 1] was mapped to [-1, 1]
    expected = 4 * 10 ** (-psnr_per_image(a, b) / 10)  # mean (2a - 2b)^2 = 4 MSE
    assert values.dtype == torch.float64 and torch.allclose(values, expected, rtol=1e-5)
    assert LpipsScorer(net=SquaredError())(a, a).abs().max() == 0
    out = reference_metrics(b, a, ["psnr", "lpips"], {"lpips": LpipsScorer(net=SquaredError())})
    assert out["lpips"] == pytest.approx(values.tolist(), rel=1e-6)
    with pytest.raises(MetricError, match="need a scorer network"):
        reference_metrics(b, a, ["lpips"])


def test_clip_score_runs_a_transformers_clip_and_pairs_images_with_prompts(tmp_path):
    model, processor = tiny_clip(seed=2)
    scorer = ClipScorer(lambda: (model, processor), batch=2)
    images = _images()
    scores = scorer(images, PROMPTS)
    # the definition, computed here from the model's own embeddings
    px = processor(images=list((images * 255).round().to(torch.uint8)), return_tensors="pt")["pixel_values"]
    tx = processor(text=PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=px).pooler_output
        txt = model.get_text_features(input_ids=tx["input_ids"], attention_mask=tx["attention_mask"]).pooler_output
    expected = (100 * torch.nn.functional.cosine_similarity(img.double(), txt.double(), dim=-1)).clamp_min(0)
    assert torch.allclose(scores, expected, atol=1e-4)
    assert (scores > 0).sum() >= 3 and scores.max() <= 100  # not all clamped to 0: the test sees real values
    swapped = scorer(images[[1, 0]], [PROMPTS[1], PROMPTS[0]])
    assert torch.allclose(swapped, scores[[1, 0]], atol=1e-4)
    # user-provided weights: a local folder in save_pretrained layout
    model.save_pretrained(tmp_path / "clip")
    processor.save_pretrained(tmp_path / "clip")
    assert torch.allclose(ClipScorer(str(tmp_path / "clip"))(images, PROMPTS), scores, atol=1e-4)
    with pytest.raises(ValueError, match="one prompt per image"):
        scorer(images, PROMPTS[:2])


def test_image_reward_gets_rgb_pil_images_and_their_prompts():
    model = Brightness()
    images = _images(3, channels=1)
    values = ImageRewardScorer(model=model)(images, PROMPTS[:3])
    assert [s[0] for s in model.seen] == PROMPTS[:3] and {s[1:] for s in model.seen} == {("RGB", (16, 16))}
    expected = [float((images[i] * 255).round().double().mean() / 255) + len(PROMPTS[i].split()) for i in range(3)]
    assert values.tolist() == pytest.approx(expected, abs=1e-9)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_lpips_without_torchvision_names_the_extra():
    with pytest.raises(MissingExtraError, match=r"pip install 'dcache\[metrics\]'.*torchvision"):
        LpipsScorer()


@pytest.mark.skipif(importlib.util.find_spec("ImageReward") is not None, reason="image-reward is installed")
def test_image_reward_without_the_package_names_the_extra():
    with pytest.raises(MissingExtraError, match=r"pip install 'dcache\[image-reward\]' \(or pip install image-reward"):
        ImageRewardScorer()


def test_clip_weights_that_cannot_load_say_how_to_provide_them(tmp_path):
    with pytest.raises(MetricWeightsError, match="no such folder.*save_pretrained"):
        ClipScorer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MetricWeightsError, match=r"could not load.*HF_HUB_OFFLINE.*--clip-model DIR"):
        ClipScorer(str(tmp_path / "empty"))


def test_auto_metrics_skip_missing_weights_with_a_note_and_explicit_ones_fail(tmp_path):
    (tmp_path / "empty").mkdir()
    kw = dict(is_tiny=False, clip_model=str(tmp_path / "empty"), networks={"lpips": LpipsScorer(net=SquaredError())})
    judges = Judges(["psnr", "lpips", "clip_score"], auto=True, **kw)
    assert judges.names == ["psnr", "lpips"] and list(judges.networks) == ["lpips"]
    assert len(judges.notes) == 1 and judges.notes[0].startswith("skipped clip_score: CLIP score could not load")
    with pytest.raises(MetricWeightsError, match="--clip-model"):
        Judges(["psnr", "clip_score"], auto=False, **kw)
    with pytest.raises(ValueError, match="not metrics with networks"):
        Judges(["psnr"], is_tiny=False, networks={"psnr": object()})
