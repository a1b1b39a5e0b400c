"""dcache.apply's grouped options (dcache.Storage, dcache.Budget, dcache.Models) and dcache.tune: a group gives the
same outputs bit for bit as its flat shorthand, bad fields are refused naming the group, the field and the fix, a
tuned config applies as apply's own target does, and setup files hold the groups (version 1 files still load)."""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import dcache
from dcache.api.setup_file import Setup, load_setup
from dcache.pipelines.bundled import load_tiny_pipeline

STEPS = 8


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def generate(pipe, seed=0):
    return pipe(labels=[2, 5], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                output_type="pt").images


def run(pipe, method, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with dcache.apply(pipe, method, **kw) as handle:
            out = generate(pipe)
    return out, handle


@pytest.mark.parametrize("grouped, flat", [
    ({"storage": dcache.Storage(dtype="bfloat16")}, {"cache_dtype": "bfloat16"}),
    ({"storage": dcache.Storage(dtype="float8_e4m3fn", scale="token", device="cpu")},
     {"cache_dtype": "float8_e4m3fn", "cache_scale": "token", "cache_device": "cpu"}),
    ({"budget": dcache.Budget("1GiB")}, {"max_cache_memory": "1GiB"}),
    ({"budget": dcache.Budget(1 << 30, fit="auto"), "storage": dcache.Storage(dtype="float16")},
     {"max_cache_memory": 1 << 30, "fit": "auto", "cache_dtype": "float16"}),
    ({"models": dcache.Models()}, {"experts": None, "controlnet": None}),
])
def test_a_group_gives_the_outputs_of_its_flat_shorthand(pipe, grouped, flat):
    from_groups, handle = run(pipe, "taylorseer", **grouped)
    from_flat, flat_handle = run(pipe, "taylorseer", **flat)
    assert torch.equal(from_groups, from_flat)
    assert handle.stats().compute_ratio == flat_handle.stats().compute_ratio < 1.0
    assert handle.setup() == flat_handle.setup()


def test_the_budget_is_attached_through_the_handle_and_goes_with_it(pipe):
    handle = dcache.apply(pipe, "taylorseer", budget=dcache.Budget("1GiB"))
    with pytest.raises(RuntimeError, match="memory budget already"):
        handle.attach_budget(object())
    hooks = dict(pipe.transformer._forward_pre_hooks)
    handle.remove()
    assert len(pipe.transformer._forward_pre_hooks) == len(hooks) - 1


def test_the_experts_group_equals_its_shorthand_on_a_two_expert_pipeline():
    path = Path(__file__).parents[1] / "eval" / "tiny_video.py"
    spec = importlib.util.spec_from_file_location("dcache_tiny_video", path)
    module = sys.modules.get(spec.name)
    if module is None:
        sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    wan = module.tiny_wan_pipeline(boundary_ratio=0.875)

    def go(**kw):
        with dcache.apply(wan, "fixed_interval", interval=2, **kw) as handle:
            out = wan(prompt="a fox", num_frames=5, height=16, width=16, num_inference_steps=10, guidance_scale=3.0,
                      max_sequence_length=8, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
        return out, handle

    grouped, handle = go(models=dcache.Models(experts={"transformer_2": {"interval": 3}}))
    flat, _ = go(experts={"transformer_2": {"interval": 3}})
    assert torch.equal(grouped, flat) and handle.experts["transformer_2"].config["interval"] == 3
    uncached_expert, handle = go(models=dcache.Models(experts={"transformer_2": None}))
    assert set(handle.experts) == set()


BAD_GROUPS = {
    "dtype": (lambda: dcache.Storage(dtype="int3"), "dcache.Storage: dtype='int3'", "'bfloat16'"),
    "scale without fp8": (lambda: dcache.Storage(dtype="bfloat16", scale="token"), "scale='token'",
                          "float8_e4m3fn"),
    "scale": (lambda: dcache.Storage(dtype="float8_e4m3fn", scale="row"), "scale='row'", "'tensor', 'token'"),
    "device": (lambda: dcache.Storage(device="disk"), "device='disk'", "'cpu'"),
    "size": (lambda: dcache.Budget("lots"), "dcache.Budget: max_memory='lots'", "4GiB"),
    "fit": (lambda: dcache.Budget("1GiB", fit="best"), "fit='best' is not a fit mode", "fit='auto'"),
    "experts": (lambda: dcache.Models(experts=["transformer_2"]), "dcache.Models: experts=", "transformer_2"),
    "expert": (lambda: dcache.Models(experts={"transformer_2": 3}), "experts['transformer_2']=3", "None"),
}


@pytest.mark.parametrize("case", sorted(BAD_GROUPS))
def test_bad_group_fields_name_the_group_the_field_and_the_fix(case):
    build, field, fix = BAD_GROUPS[case]
    with pytest.raises(ValueError) as info:
        build()
    assert field in str(info.value) and fix in str(info.value), str(info.value)


def test_a_field_given_twice_or_a_wrong_group_object_is_refused(pipe):
    with pytest.raises(ValueError, match=r"cache_dtype= and storage=dcache.Storage\(dtype=...\) both set"):
        dcache.apply(pipe, "taylorseer", storage=dcache.Storage(dtype="float16"), cache_dtype="bfloat16")
    with pytest.raises(TypeError, match=r"budget=.* must be a dcache.Budget.*max_cache_memory, fit"):
        dcache.apply(pipe, "taylorseer", budget="4GiB")
    with pytest.raises(ValueError, match="give the budget too"):
        dcache.apply(pipe, "taylorseer", fit="auto")
    assert getattr(pipe.transformer, "_dcache_engine", None) is None  # nothing hooked


def test_tune_returns_the_config_apply_chooses_for_the_same_target(pipe):
    calibration = lambda: generate(pipe, seed=1)  # noqa: E731
    config = dcache.tune(pipe, "fixed_interval", speed="2x", calibration_run=calibration, progress=False)
    assert isinstance(config, dcache.MethodConfig) and getattr(pipe.transformer, "_dcache_engine", None) is None
    tuned, handle = run(pipe, config)
    targeted, target_handle = run(pipe, "fixed_interval", speed="2x", calibration_run=calibration)
    assert config.to_dict() == target_handle.config
    assert torch.equal(tuned, targeted) and handle.config == target_handle.config
    assert target_handle.target.met and target_handle.target.config == config  # the sweep, as before
    with pytest.raises(ValueError, match="calibration_run"):
        dcache.tune(pipe, "fixed_interval", quality="psnr>=30")


def test_setup_files_hold_the_groups_and_round_trip(pipe, tmp_path):
    first, handle = run(pipe, "taylorseer", storage=dcache.Storage(dtype="bfloat16"),
                        budget=dcache.Budget("1GiB", fit="auto"))
    setup = handle.setup()
    assert setup.storage == {"dtype": "bfloat16"} and setup.budget == {"max_memory": "1GiB", "fit": "auto"}
    path = setup.save(tmp_path / "setup.json")
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["budget"] == {"max_memory": "1GiB", "fit": "auto"}
    assert load_setup(path) == setup
    again, handle_again = run(pipe, path)
    assert torch.equal(again, first) and handle_again.setup() == setup
    smaller, handle_smaller = run(pipe, path, budget=dcache.Budget("2GiB"))  # a group beside the file replaces it
    assert handle_smaller.setup().budget == {"max_memory": "2GiB"} and torch.equal(smaller, first)


def test_a_version_1_setup_file_loads_into_the_groups(pipe, tmp_path):
    old = {"format": "dcache.setup", "version": 1, "method": "taylorseer", "experts": None, "controlnet": None,
           "storage": {"cache_dtype": "bfloat16", "max_cache_memory": "1GiB", "fit": "auto"}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    setup = load_setup(path)
    assert setup == Setup(method="taylorseer", storage={"dtype": "bfloat16"},
                          budget={"max_memory": "1GiB", "fit": "auto"})
    from_file, _ = run(pipe, path)
    direct, _ = run(pipe, "taylorseer", cache_dtype="bfloat16", max_cache_memory="1GiB", fit="auto")
    assert torch.equal(from_file, direct)


def test_apply_keywords_are_the_groups_the_shorthands_and_the_target():
    from dcache.api.apply_cache import apply_keywords

    assert {"storage", "budget", "models", "cache_dtype", "max_cache_memory", "experts", "controlnet", "speed",
            "calibration_run", "scope", "decisions"} <= apply_keywords()
    assert "threshold" not in apply_keywords()
