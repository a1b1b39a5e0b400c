"""Bad input beyond configs and plans: unsupported models, a removed handle, an interrupted calibration."""

import json

import pytest
import torch
from diffusers import UNet2DConditionModel

import dcache
from dcache.model.adapters import UnsupportedModelError
from dcache.schedules.tuning.calibrate import calibrate_magcache

from .compat_kit import make_pipeline, seeded


def generate(pipe, steps: int = 8) -> torch.Tensor:
    return pipe([1, 7], num_inference_steps=steps, guidance_scale=2.0, generator=seeded(0))


def tiny_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, norm_num_groups=8)


def test_a_unet_is_refused_not_cached_wrongly():
    """Its down/up blocks take `hidden_states`, so generic discovery used to accept them (and cache across a
    resolution change); now the error says why and what to do, and nothing is hooked."""
    unet = tiny_unet()
    forwards = {name: m.forward for name, m in unet.named_modules()}
    with pytest.raises(UnsupportedModelError, match=r"it is a UNet.*pipe\.transformer"):
        dcache.apply(unet, "fbcache", num_steps=4)
    assert not hasattr(unet, "_dcache_engine")
    assert all(m.forward == forwards[name] for name, m in unet.named_modules())


def test_a_pipeline_without_a_transformer_and_a_blockless_module_are_refused():
    class UNetPipe:
        unet, scheduler = tiny_unet(), object()

    with pytest.raises(TypeError, match="UNet pipelines are not supported"):
        dcache.apply(UNetPipe(), "fbcache")
    with pytest.raises(UnsupportedModelError, match="register_adapter"):
        dcache.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)), "fbcache", num_steps=4)


def test_a_removed_handle_keeps_its_numbers_and_refuses_a_second_remove():
    pipe = make_pipeline()
    handle = dcache.apply(pipe, "fbcache", threshold=0.5)
    generate(pipe)
    stats, plan = handle.stats(), handle.plan()
    handle.remove()
    assert handle.removed
    assert handle.stats().compute_ratio == pytest.approx(stats.compute_ratio)  # still readable after remove
    assert handle.plan().to_dict() == plan.to_dict()
    with pytest.raises(RuntimeError, match=r"already removed.*dcache\.apply"):
        handle.remove()
    again = dcache.apply(pipe, "fbcache", threshold=0.5)  # the pipeline accepts a new handle
    generate(pipe)
    assert again.stats().compute_ratio == pytest.approx(stats.compute_ratio)
    again.remove()


def test_an_interrupted_calibration_leaves_the_file_as_it_was(tmp_path):
    """A calibration that dies mid-run writes nothing: the old file is byte-identical and no temp file is left."""
    pipe = make_pipeline()
    path = tmp_path / "calibration.json"
    calibrate_magcache(pipe, lambda: generate(pipe), path=path)
    before = path.read_bytes()
    calls = {"n": 0}

    def dies_in_the_second_run():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # what Ctrl-C raises
        generate(pipe, steps=6)

    with pytest.raises(KeyboardInterrupt):
        calibrate_magcache(pipe, dies_in_the_second_run, runs=2, path=path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json"]
    assert json.loads(before)  # and it was a complete file to begin with
    assert not hasattr(pipe.transformer, "_dcache_engine")  # the recording hooks came off


def test_a_plan_exported_twice_from_one_generation_is_the_same_file(monkeypatch):
    """`created` is when the recorded generation started, not when plan() was called: exporting the same
    generation a second later gives the same file (CI once failed on a removed handle's plan crossing a second)."""
    import dcache.generations.records as records

    pipe = make_pipeline()
    handle = dcache.apply(pipe, "fbcache", threshold=0.5)
    clock = iter(f"2026-01-01T00:00:{s:02d}" for s in range(60))
    monkeypatch.setattr(records.time, "strftime", lambda fmt, *a: next(clock))
    generate(pipe)
    first = handle.plan().to_dict()
    assert handle.plan().to_dict() == first
    assert first["provenance"]["created"].startswith("2026-01-01T00:00:")
    handle.remove()
