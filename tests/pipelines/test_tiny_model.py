"""The bundled tiny model: offline loading, sample quality, CFG modes, determinism, input checks, call protocol."""

import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

from dcache.pipelines.bundled import DIGIT_CLASSIFIER_PATH, TINY_MODEL_DIR, load_digit_classifier, load_tiny_pipeline
from dcache.pipelines.digit_classifier import load_digits_16
from dcache.pipelines.tiny_pipeline import PIL_SCALE, image_ids, pack_images, parse_digit_prompt, unpack_tokens
from dcache.pipelines.train_tiny import generated_accuracy

MAX_MODEL_BYTES = 15 * 2**20
MIN_GENERATED_ACCURACY = 0.90
MIN_CLASSIFIER_ACCURACY = 0.95
CFG_MODE_ATOL = 1e-4  # split vs batched CFG: same math, only the matmul batch size differs
# Relative L1 change of the transformer output between consecutive steps (28 steps, no CFG). The trained model moves
# ~3 % per step in the middle and ~14 % at the last step; random weights move ~9 % per step, erratically.
MAX_MEDIAN_STEP_CHANGE = 0.06
MAX_STEP_CHANGE = 0.3
# Steps for the checks that compare two generations exactly (CFG modes, seeds): every step runs the same code, so a
# mismatch shows after a few steps as after 28 (measured: split vs batched differ by 0.0 at 8 and at 28 steps).
EXACT_CHECK_STEPS = 8


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


@pytest.fixture(scope="module")
def classifier():
    return load_digit_classifier()


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_assets_live_in_the_installed_package_and_are_small():
    import dcache.pipelines

    package_dir = Path(dcache.pipelines.__file__).resolve().parent
    assert TINY_MODEL_DIR.is_relative_to(package_dir) and DIGIT_CLASSIFIER_PATH.is_relative_to(package_dir)
    model_bytes = sum(path.stat().st_size for path in TINY_MODEL_DIR.rglob("*") if path.is_file())
    assert model_bytes < MAX_MODEL_BYTES
    index = json.loads((TINY_MODEL_DIR / "model_index.json").read_text())
    assert index["label_encoder"] == ["dcache.pipelines.label_encoder", "LabelEncoder"]  # importable, no remote code


@pytest.mark.slow  # a fresh interpreter
def test_fresh_process_loads_offline_and_reproduces_in_process_images(pipe, tmp_path):
    code = (
        "import torch\n"
        "from dcache.pipelines.bundled import load_tiny_pipeline\n"
        "images = load_tiny_pipeline()([0, 7], num_inference_steps=8, generator=torch.Generator().manual_seed(0),\n"
        "                              output_type='pt').images\n"
        "print(images.flatten().tolist())\n"
    )
    # Empty HF cache + offline mode + a cwd outside the repository: only the installed package can provide the model.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TQDM_DISABLE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    fresh = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1]))
    here = pipe([0, 7], num_inference_steps=8, generator=_seeded(0), output_type="pt").images.flatten()
    assert torch.allclose(fresh, here, atol=1e-5, rtol=0)


def test_model_is_a_flux_mmdit_with_a_flow_matching_scheduler(pipe):
    transformer = pipe.transformer
    assert isinstance(transformer, FluxTransformer2DModel)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert len(transformer.transformer_blocks) >= 1 and len(transformer.single_transformer_blocks) >= 1
    assert len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks) >= 8
    assert not transformer.config.guidance_embeds
    assert sum(transformer.config.axes_dims_rope) == transformer.config.attention_head_dim


def test_packing_round_trips_and_matches_the_token_grid():
    images = torch.randn(3, 1, 16, 16)
    tokens = pack_images(images)
    assert tokens.shape == (3, 64, 4)
    assert torch.equal(unpack_tokens(tokens), images)
    # token k covers pixels (2r..2r+1, 2c..2c+1) with (r, c) = img_ids[k, 1:]
    row, col = image_ids()[9, 1:].long().tolist()
    assert torch.equal(tokens[:, 9], images[:, 0, 2 * row : 2 * row + 2, 2 * col : 2 * col + 2].reshape(3, 4))


@pytest.mark.slow  # 20 samples at 28 steps
def test_generated_samples_are_the_requested_digits(pipe, classifier):
    # 20 samples, default steps and CFG: 18 must be right; measured 1.00 (and 1.00 on 50 samples)
    accuracy = generated_accuracy(pipe, classifier, per_class=2, seed=1234)
    assert accuracy >= MIN_GENERATED_ACCURACY


@pytest.mark.slow  # 3 x 10 samples at 8 steps
def test_split_and_batched_cfg_give_the_same_images(pipe):
    labels, steps = list(range(10)), EXACT_CHECK_STEPS
    split = pipe(labels, num_inference_steps=steps, generator=_seeded(3), cfg_mode="split", output_type="pt").images
    batched = pipe(labels, num_inference_steps=steps, generator=_seeded(3), cfg_mode="batched",
                   output_type="pt").images
    no_cfg = pipe(labels, num_inference_steps=steps, generator=_seeded(3), guidance_scale=1.0,
                  output_type="pt").images
    assert (split - batched).abs().max().item() <= CFG_MODE_ATOL
    assert (split - no_cfg).abs().max().item() > 100 * CFG_MODE_ATOL  # guidance does change the samples (by 0.56)


@pytest.mark.slow  # 4 x 2 samples at 8 steps
def test_same_seed_gives_identical_images_and_latents_replace_the_noise(pipe):
    steps = EXACT_CHECK_STEPS
    first = pipe([4, 2], num_inference_steps=steps, generator=_seeded(7), output_type="pt").images
    again = pipe([4, 2], num_inference_steps=steps, generator=_seeded(7), output_type="pt").images
    other = pipe([4, 2], num_inference_steps=steps, generator=_seeded(8), output_type="pt").images
    from_latents = pipe([4, 2], num_inference_steps=steps, latents=torch.randn(2, 1, 16, 16, generator=_seeded(7)),
                        output_type="pt").images
    assert torch.equal(first, again)
    assert torch.equal(first, from_latents)
    assert (first - other).abs().max().item() > 0.1  # measured 0.73


def test_output_types(pipe):
    pt = pipe([1, 5], num_inference_steps=4, output_type="pt").images
    assert pt.shape == (2, 1, 16, 16) and pt.dtype == torch.float32
    assert pt.min().item() >= 0.0 and pt.max().item() <= 1.0
    array = pipe([1, 5], num_inference_steps=4, output_type="np").images
    assert array.shape == (2, 16, 16, 1)
    pil = pipe(1, num_inference_steps=4, output_type="pil").images
    assert len(pil) == 1 and pil[0].size == (64, 64) and pil[0].mode == "L"
    (latent,) = pipe([1, 5], num_inference_steps=4, output_type="latent", return_dict=False)
    assert latent.shape == (2, 64, 4)


def test_prompts_work_as_in_a_diffusers_pipeline(pipe):
    """pipe(prompt).images[0] is a PIL image; a prompt names a digit ("3" or "three"), as labels do."""
    image = pipe("3", num_inference_steps=4, generator=_seeded(0)).images[0]  # output_type="pil" by default
    assert isinstance(image, PIL.Image.Image) and image.size == (64, 64) and image.mode == "L"
    by_label = pipe(labels=[3], num_inference_steps=4, generator=_seeded(0), output_type="pt").images  # [1, 1, 16, 16]
    pixels = torch.from_numpy(np.array(image))[::PIL_SCALE, ::PIL_SCALE]  # nearest-neighbour upscale undone
    assert torch.equal(pixels, (by_label[0, 0] * 255).round().to(torch.uint8))
    words = pipe(["3", " Seven "], num_inference_steps=4, generator=_seeded(1), output_type="pt").images
    labels = pipe(labels=[3, 7], num_inference_steps=4, generator=_seeded(1), output_type="pt").images
    assert torch.equal(words, labels)
    assert [parse_digit_prompt(w) for w in ("zero", "five", "9", "NINE")] == [0, 5, 9, 9]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(labels=10), r"0\.\.9"),
        (dict(labels=[1, -1]), r"position 1"),
        (dict(labels=[]), r"non-empty list"),
        (dict(labels=2.5), r"int or a non-empty list"),
        (dict(labels=True), r"int or a non-empty list"),
        (dict(labels=1, num_inference_steps=0), r">= 1"),
        (dict(labels=1, num_inference_steps=2.0), r">= 1"),
        (dict(labels=1, guidance_scale=float("nan")), r"finite number"),
        (dict(labels=1, cfg_mode="joint"), r"'split'.*'batched'"),
        (dict(labels=1, output_type="tensor"), r"output_type"),
        (dict(labels=[1, 2], latents=torch.randn(1, 1, 16, 16)), r"\[2, 1, 16, 16\]"),
        (dict(labels=[1, 2], generator=[torch.Generator()]), r"one per label"),
        (dict(prompt="a cat"), r"'a cat' names no digit.*'seven'"),
        (dict(prompt=["3", "eleven"]), r"position 1.*'0'\.\.'9'"),
        (dict(prompt="3", labels=[3]), r"not both"),
        (dict(), r"no digit requested"),
    ],
)
def test_bad_inputs_raise_value_errors_that_name_the_fix(pipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipe(**kwargs)


@contextmanager
def _recording(pipe):
    """Records what a cache engine observes: set_timesteps calls, cache_context names, transformer timesteps, steps."""
    log = {"set_timesteps": 0, "contexts": [], "timesteps": [], "steps": 0}
    transformer, scheduler = pipe.transformer, pipe.scheduler
    original_context, original_set, original_step = transformer.cache_context, scheduler.set_timesteps, scheduler.step

    @contextmanager
    def cache_context(name, **kwargs):
        log["contexts"].append(name)
        with original_context(name, **kwargs):
            yield

    def set_timesteps(*args, **kwargs):
        log["set_timesteps"] += 1
        return original_set(*args, **kwargs)

    def step(*args, **kwargs):
        log["steps"] += 1
        return original_step(*args, **kwargs)

    def pre_hook(module, args, kwargs):
        log["timesteps"].append(kwargs["timestep"].clone())

    handle = transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    transformer.cache_context, scheduler.set_timesteps, scheduler.step = cache_context, set_timesteps, step
    try:
        yield log
    finally:
        handle.remove()
        del transformer.cache_context, scheduler.set_timesteps, scheduler.step  # back to the class attributes


@pytest.mark.parametrize(
    "cfg_mode, guidance, per_step",
    [("split", 3.0, ["cond", "uncond"]), ("batched", 3.0, ["cond_uncond"]), ("split", 1.0, ["cond"]),
     ("batched", 0.5, ["cond"])],
)
def test_call_protocol_seen_by_cache_engines(pipe, cfg_mode, guidance, per_step):
    steps = 6
    with _recording(pipe) as log:
        pipe([2, 3], num_inference_steps=steps, guidance_scale=guidance, cfg_mode=cfg_mode)
    assert log["set_timesteps"] == 1
    assert log["steps"] == steps
    assert log["contexts"] == per_step * steps
    sigmas = torch.stack([t[0] for t in log["timesteps"]])  # transformer timestep = t / 1000 = sigma
    assert sigmas[0].item() == pytest.approx(1.0)
    assert torch.all(sigmas > 0) and torch.all(sigmas <= 1)
    assert torch.all(sigmas[len(per_step) :: len(per_step)] < sigmas[: -len(per_step) : len(per_step)])  # decreasing


@pytest.mark.slow  # 10 samples at 28 steps
def test_denoising_trajectory_is_smooth(pipe):
    """Consecutive transformer outputs change little and gradually, as in large flow models (what caching exploits)."""
    outputs = []
    handle = pipe.transformer.register_forward_hook(lambda module, args, output: outputs.append(output[0].clone()))
    try:
        pipe(list(range(10)), guidance_scale=1.0, generator=_seeded(5))  # 28 steps, one "cond" call each
    finally:
        handle.remove()
    v = torch.stack(outputs)  # [28, B, 64, 4]
    change = (v[1:] - v[:-1]).abs().mean(dim=(1, 2, 3)) / v[:-1].abs().mean(dim=(1, 2, 3))  # relative L1, [27]
    assert change.median().item() < MAX_MEDIAN_STEP_CHANGE
    assert change.max().item() < MAX_STEP_CHANGE
    assert change[-1].item() > 2 * change.median().item()  # the last, low-noise steps change most, as in large models
    assert math.isfinite(change.sum().item())


def test_classifier_is_accurate_on_held_out_real_digits(classifier):
    images, labels = load_digits_16("test")
    accuracy = (classifier.predict(images) == labels).float().mean().item()
    assert accuracy >= MIN_CLASSIFIER_ACCURACY
    features = classifier.features(images[:8])
    assert features.shape == (8, classifier.config["feature_dim"]) and torch.isfinite(features).all()
