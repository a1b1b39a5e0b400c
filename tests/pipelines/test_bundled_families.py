"""The bundled Wan (tiny-motion) and SD3 (tiny-shapes) models: offline loading, shapes, judges, sample quality at
the default settings, and dcache's caches on them (all-compute bit-identical, reuse keeps the class)."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import PIL.Image
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, UniPCMultistepScheduler
from diffusers import WanTransformer3DModel

import dcache
from dcache.quality import psnr_per_image
from dcache.pipelines import bundled
from dcache.pipelines.flow_training import generated_accuracy, samples
from dcache.pipelines.procedural_data import MOTION_CLASSES, SHAPE_CLASSES, draw_clips, draw_shapes, held_out

MAX_MODEL_BYTES = 6 * 2**20  # tiny-shapes: a 5.2 MB fp32 transformer
MIN_JUDGE_ACCURACY = 0.98  # on clean held-out data
# 2 samples per class at the default steps and guidance; the training scripts measure 1.0 on 25 per class
MIN_GENERATED_ACCURACY = 0.85
MIN_CACHED_PSNR = 20.0  # dB against the uncached sample of the same seed, every sample of the batch


@dataclass(frozen=True)
class Model:
    name: str
    load: str  # loader in dcache.pipelines.bundled
    judge: str
    folder: Path
    transformer: type
    scheduler: type
    classes: tuple[str, ...]
    draw: object
    sample_shape: tuple[int, ...]  # one "pt" sample
    latent_shape: tuple[int, ...]  # one sample's latents
    cfg_mode: str
    contexts: tuple[str, ...]  # cache_context names of one CFG step at the default cfg_mode


MODELS = {
    "motion": Model("tiny-motion", "load_motion_pipeline", "load_motion_classifier", bundled.MOTION_MODEL_DIR,
                    WanTransformer3DModel, UniPCMultistepScheduler, MOTION_CLASSES, draw_clips, (5, 3, 16, 16),
                    (12, 5, 8, 8), "split", ("cond", "uncond")),
    "shapes": Model("tiny-shapes", "load_shapes_pipeline", "load_shapes_classifier", bundled.SHAPES_MODEL_DIR,
                    SD3Transformer2DModel, FlowMatchEulerDiscreteScheduler, SHAPE_CLASSES, draw_shapes, (3, 32, 32),
                    (12, 16, 16), "batched", ()),  # SD3's transformer has no cache_context
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]


@pytest.fixture(scope="module")
def pipe(model):
    return getattr(bundled, model.load)()


@pytest.fixture(scope="module")
def judge(model):
    return getattr(bundled, model.judge)()


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_assets_are_small_and_in_the_package(model):
    import dcache.pipelines

    package_dir = Path(dcache.pipelines.__file__).resolve().parent
    assert model.folder.is_relative_to(package_dir)
    model_bytes = sum(path.stat().st_size for path in model.folder.rglob("*") if path.is_file())
    assert model_bytes < MAX_MODEL_BYTES
    index = json.loads((model.folder / "model_index.json").read_text())
    assert index["label_encoder"] == ["dcache.pipelines.label_encoder", "LabelEncoder"]  # no remote code
    assert index["transformer"] == ["diffusers", model.transformer.__name__]
    metrics = json.loads((model.folder / "METRICS.json").read_text())
    assert metrics["classifier_test_accuracy"] >= MIN_JUDGE_ACCURACY
    assert 0.0 <= metrics[f"accuracy_cfg_{metrics['default_steps']}_steps"] <= 1.0
    assert metrics["command"].startswith("python -m dcache.pipelines.train_")


def test_family_sampler_and_output_shapes(model, pipe):
    assert isinstance(pipe.transformer, model.transformer) and isinstance(pipe.scheduler, model.scheduler)
    if model.scheduler is UniPCMultistepScheduler:  # Wan's sampler as Wan ships it
        config = pipe.scheduler.config
        assert config.prediction_type == "flow_prediction" and config.use_flow_sigmas and config.flow_shift > 1
    assert pipe.transformer.config.in_channels == pipe.transformer.config.out_channels == 12
    assert pipe.default_cfg_mode == model.cfg_mode
    out = samples(pipe(labels=[0, 1], num_inference_steps=3, output_type="pt"))
    assert out.shape == (2, *model.sample_shape) and out.min() >= 0 and out.max() <= 1
    array = samples(pipe(labels=[0, 1], num_inference_steps=3, output_type="np"))
    assert array.shape == (2, *model.sample_shape[:-3], *model.sample_shape[-2:], 3)  # channels last
    latents = samples(pipe(labels=[0], num_inference_steps=3, output_type="latent"))
    assert latents.shape == (1, *model.latent_shape)
    pil = samples(pipe(model.classes[1], num_inference_steps=3, output_type="pil"))
    first = pil[0][0] if isinstance(pil[0], list) else pil[0]  # a clip is a list of frames
    assert isinstance(first, PIL.Image.Image) and first.mode == "RGB"


def test_prompts_name_the_classes(model, pipe):
    by_name = samples(pipe([model.classes[2], model.classes[0].upper()], num_inference_steps=3, generator=_seeded(1),
                           output_type="pt"))
    by_label = samples(pipe(labels=[2, 0], num_inference_steps=3, generator=_seeded(1), output_type="pt"))
    assert torch.equal(by_name, by_label)
    with pytest.raises(ValueError, match=f"'a cat' names no .*'{model.classes[-1]}'"):
        pipe("a cat")
    with pytest.raises(ValueError, match=rf"\[2, {', '.join(map(str, model.latent_shape))}\]"):
        pipe(labels=[0, 1], latents=torch.randn(1, *model.latent_shape))
    with pytest.raises(ValueError, match=rf"0\.\.{len(model.classes) - 1}"):
        pipe(labels=[len(model.classes)])


def test_judge_scores_clean_held_out_data_highly(model, judge):
    data, labels = held_out(model.draw, len(model.classes), 20, seed=4321)  # a seed no training run draws from
    assert (judge.predict(data) == labels).float().mean().item() >= MIN_JUDGE_ACCURACY
    assert judge.features(data[:4]).shape == (4, 128)


def test_generations_at_the_default_settings(model, pipe, judge):
    labels = torch.arange(len(model.classes)).repeat_interleave(2)
    guided = samples(pipe(labels=labels.tolist(), generator=_seeded(7), output_type="pt"))
    if model.name == "tiny-shapes":  # the colour is learned (label % 3), the shape not yet: docs/bundled-models.md
        assert (judge.predict(guided) % 3 == labels % 3).float().mean().item() >= MIN_GENERATED_ACCURACY
    unguided = samples(pipe(labels=labels.tolist(), guidance_scale=1.0, generator=_seeded(7), output_type="pt"))
    assert (guided - unguided).abs().max().item() > 0.05  # guidance changes the samples


def test_generations_follow_the_prompt(request, model, pipe, judge):
    if model.name == "tiny-shapes":
        request.node.add_marker(pytest.mark.xfail(
            strict=True, reason="the shipped tiny-shapes draws the requested colour but rarely the requested shape "
                                "(docs/bundled-models.md); a retrained model that does turns this into a pass"))
    assert generated_accuracy(pipe, judge, per_class=2, seed=7) >= MIN_GENERATED_ACCURACY


def test_split_and_batched_cfg_agree(model, pipe):
    split = samples(pipe(labels=[0, 1], num_inference_steps=6, generator=_seeded(2), cfg_mode="split",
                         output_type="pt"))
    batched = samples(pipe(labels=[0, 1], num_inference_steps=6, generator=_seeded(2), cfg_mode="batched",
                           output_type="pt"))
    assert (split - batched).abs().max().item() <= 1e-4  # same math, only the matmul batch differs


@pytest.fixture(scope="module")
def uncached_runs() -> dict:
    """model name -> its uncached samples in the test below, generated by the first method's case (the pipeline is
    the same module-scoped one for both methods)."""
    return {}


@pytest.mark.parametrize("method", ["fbcache", "magcache"])
def test_caches_all_compute_is_bit_identical_and_reuse_keeps_the_class(model, pipe, judge, method, uncached_runs):
    labels = list(range(len(model.classes)))
    run = lambda: samples(pipe(labels=labels, generator=_seeded(3), output_type="pt"))  # noqa: E731
    if model.name not in uncached_runs:
        uncached_runs[model.name] = run()
    reference = uncached_runs[model.name]
    with dcache.apply(pipe, method, threshold=0.0):
        all_compute = run()
    assert torch.equal(all_compute, reference)
    with dcache.apply(pipe, method) as handle:
        if method == "magcache":
            run()  # magcache calibrates itself on its first generation
        cached = run()
        stats = handle.stats()
    assert stats.units_reused + stats.units_forecast > 0  # the cache did reuse
    # close to the model's own uncached samples (the judges cannot tell classes apart on these models' samples yet)
    flat = lambda x: x.flatten(1, 2) if x.ndim == 5 else x  # noqa: E731  clips: frames stacked as channels
    assert psnr_per_image(flat(cached), flat(reference)).min().item() >= MIN_CACHED_PSNR
    assert torch.equal(run(), reference)  # removed: exactly as before


def test_cache_context_names_seen_by_a_cache(model, pipe):
    names = []
    if model.contexts:
        original = pipe.transformer.cache_context

        def recording(name, **kwargs):
            names.append(name)
            return original(name, **kwargs)

        pipe.transformer.cache_context = recording
        try:
            pipe(labels=[0], num_inference_steps=4)
        finally:
            del pipe.transformer.cache_context
        assert names == list(model.contexts) * 4
    else:
        assert not hasattr(pipe.transformer, "cache_context")  # SD3: branches by call order and batch halves


def test_fresh_process_loads_offline(tmp_path):
    code = (
        "from dcache.pipelines.bundled import load_motion_pipeline, load_shapes_pipeline\n"
        "m, s = load_motion_pipeline(), load_shapes_pipeline()\n"
        "print(m(labels=[1], num_inference_steps=2, output_type='pt').frames.shape, "
        "s(labels=[1], num_inference_steps=2, output_type='pt').images.shape)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TQDM_DISABLE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "torch.Size([1, 5, 3, 16, 16]) torch.Size([1, 3, 32, 32])"


def test_pixel_latents_round_trip():
    from dcache.pipelines.procedural_data import (clips_to_latents, images_to_latents, latents_to_clips,
                                                  latents_to_images)

    clips = draw_clips(torch.arange(4), _seeded(0))
    images = draw_shapes(torch.arange(9), _seeded(0))
    assert clips_to_latents(clips).shape == (4, 12, 5, 8, 8) and images_to_latents(images).shape == (9, 12, 16, 16)
    assert torch.allclose(latents_to_clips(clips_to_latents(clips)), clips, atol=1e-6)
    assert torch.allclose(latents_to_images(images_to_latents(images)), images, atol=1e-6)
    # the scene moves SPEED px per frame in its class direction: frame f + 1 is frame f shifted by 2 (dx, dy)
    # away from the borders (the 2 px that enter at the trailing edge each frame are new)
    for clip, (dx, dy) in zip(clips, [(2, 0), (-2, 0), (0, 2), (0, -2)]):
        for f in range(4):
            moved = torch.roll(clip[f], shifts=(dy, dx), dims=(1, 2))[:, 2:14, 2:14]
            assert torch.allclose(moved, clip[f + 1][:, 2:14, 2:14], atol=1e-6)
            other = torch.roll(clip[f], shifts=(-dy, -dx), dims=(1, 2))[:, 2:14, 2:14]  # the opposite direction
            assert (other - clip[f + 1][:, 2:14, 2:14]).abs().mean() > 0.02


def test_the_docs_show_the_shipped_metrics():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "bundled-models.md").read_text()
    assert bundled.metrics_table() in docs  # regenerate with `python -c "...bundled import metrics_table; ..."`
