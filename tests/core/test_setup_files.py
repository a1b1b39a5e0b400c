"""Cache setups as files (dcache.api.setup_file): a setup applies exactly as the arguments it holds, round-trips
through JSON and YAML and through handle.setup(), takes per-request overrides, and refuses bad fields naming the file,
the field and the fix before anything is hooked."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import dcache
from dcache.pipelines.bundled import load_tiny_pipeline
from dcache.pipelines.cli import app
from dcache.api.setup_file import Setup, SetupError, load_setup

LABELS = [0, 3]
STEPS = 10


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def generate(pipe, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return pipe(labels=LABELS, num_inference_steps=STEPS, generator=gen, output_type="pt").images


def run(pipe, method, **kw):
    with dcache.apply(pipe, method, **kw) as handle:
        out = generate(pipe)
    return out, handle


def write(tmp_path, data, name="setup.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def setup_dict(**fields):
    return {"format": "dcache.setup", "version": 1, **fields}


def test_a_setup_file_applies_exactly_as_its_arguments(pipe, tmp_path):
    direct, direct_handle = run(pipe, "fixed_interval", interval=3, scope="call", cache_dtype="bfloat16")
    path = write(tmp_path, setup_dict(method="fixed_interval", knobs={"interval": 3}, scope="call",
                                      storage={"cache_dtype": "bfloat16"}))
    from_file, handle = run(pipe, str(path))
    assert torch.equal(from_file, direct)
    assert handle.stats().compute_ratio == direct_handle.stats().compute_ratio < 0.5
    assert handle.engine.scope == "call"


def test_arguments_beside_the_file_override_it_per_request(pipe, tmp_path):
    path = write(tmp_path, setup_dict(method="fixed_interval", knobs={"interval": 3}))
    direct, _ = run(pipe, "fixed_interval", interval=2)
    overridden, handle = run(pipe, path, interval=2)
    assert torch.equal(overridden, direct)
    assert handle.setup().knobs == {"interval": 2}
    assert load_setup(path).knobs == {"interval": 3}  # the file is left as it was


@pytest.mark.parametrize("name", ["setup.json", "setup.yaml"])
def test_handle_setup_round_trips_through_a_file(pipe, tmp_path, name):
    first, handle = run(pipe, "magcache", threshold=0.08, max_cache_memory="1GiB", cache_dtype="float16")
    setup = handle.setup()
    assert setup.knobs == {"threshold": 0.08} and setup.storage == {"dtype": "float16"}
    assert setup.budget == {"max_memory": "1GiB"}
    path = setup.save(tmp_path / name)
    assert load_setup(path) == setup
    again, handle_again = run(pipe, path)
    assert torch.equal(again, first) and handle_again.setup() == setup


def test_a_config_object_or_a_speed_target_saves_as_the_knobs_it_stands_for(pipe, tmp_path):
    config = dcache.config_for("fixed_interval", interval=4)
    _, handle = run(pipe, config)
    assert handle.setup().method == "fixed_interval" and handle.setup().knobs == {"interval": 4}
    with dcache.apply(pipe, Setup(method="fixed_interval").method, speed="2x",
                      calibration_run=lambda: generate(pipe, seed=1)) as targeted:
        generate(pipe)
    chosen = targeted.setup()
    assert chosen.method == "fixed_interval" and chosen.knobs == {"interval": targeted.config["interval"]}


def test_a_plan_named_relative_to_the_setup_file_replays(pipe, tmp_path):
    first, handle = run(pipe, "fixed_interval")
    handle.plan().save(tmp_path / "plans" / "p.json")
    path = write(tmp_path, setup_dict(method="plans/p.json"))
    replay, _ = run(pipe, path)
    assert torch.equal(replay, first)


def test_a_plan_object_has_no_setup_form_and_says_how_to_get_one(pipe):
    _, handle = run(pipe, "fixed_interval")
    _, replayed = run(pipe, handle.plan())
    with pytest.raises(SetupError, match="JSON object"):
        Setup.from_dict([1, 2], source="setup file 'x.json'")
    with pytest.raises(SetupError, match=r"handle\.plan\(\)\.save"):
        replayed.setup()


BAD = {
    "wrong format": (setup_dict(method="magcache") | {"format": "dcache.plan"}, "format", "dcache.setup"),
    "future version": (setup_dict(method="magcache") | {"version": 3}, "version", "reads version 1"),
    "bool version": (setup_dict(method="magcache") | {"version": True}, "version", "reads version 1"),
    "no method": (setup_dict(), "method", "is missing"),
    "unknown field": (setup_dict(method="magcache", treshold=0.1), "treshold", "the fields are"),
    "unknown method": (setup_dict(method="magcach"), "method", "Did you mean 'magcache'"),
    "bad knob": (setup_dict(method="magcache", knobs={"threshold": -1}), "knobs", "threshold"),
    "unknown knob": (setup_dict(method="magcache", knobs={"treshold": 0.1}), "knobs", "Did you mean"),
    "bad scope": (setup_dict(method="magcache", scope="everything"), "scope", "'blocks', 'call'"),
    "bad steps": (setup_dict(method="magcache", num_steps=0), "num_steps", "int >= 1"),
    "bad dtype": (setup_dict(method="magcache", storage={"cache_dtype": "int3"}), "storage", "cache_dtype"),
    "bad budget": (setup_dict(method="magcache", storage={"max_cache_memory": "lots"}), "storage.max_cache_memory",
                   "4GiB"),
    "fit alone": (setup_dict(method="magcache", storage={"fit": "auto"}), "storage.fit", "max_cache_memory"),
    "bad expert": (setup_dict(method="magcache", experts={"transformer_2": 3}), "experts.transformer_2", "null"),
    "bad decisions": (setup_dict(method="magcache", decisions="each"), "decisions", '"batch"'),
    "missing plan": (setup_dict(method="nowhere/plan.json"), "method", "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fields_name_the_file_the_field_and_the_fix(pipe, tmp_path, case):
    data, field, fix = BAD[case]
    path = write(tmp_path, data, "setup.yaml")  # JSON is YAML; a *.json file is a setup only by its format
    with pytest.raises(SetupError) as info:
        dcache.apply(pipe, path)
    message = str(info.value)
    assert str(path) in message and fix in message, message
    assert f"field {field!r}" in message, message
    assert getattr(pipe.transformer, "_dcache_engine", None) is None  # nothing hooked


def test_decisions_travel_in_the_setup_and_beside_it(pipe, tmp_path):
    path = write(tmp_path, setup_dict(method="fixed_interval", decisions="batch"))
    _, handle = run(pipe, path)
    assert handle.setup().decisions == "batch" and handle.setup().knobs == {}
    _, handle = run(pipe, path, decisions="sample")
    assert handle.setup().decisions == "sample" and handle.setup().knobs == {}


def test_a_json_file_of_another_kind_names_the_setup_format_too(pipe, tmp_path):
    path = write(tmp_path, {"format": "dcache.setups", "method": "magcache"})
    with pytest.raises(ValueError, match='"format": "dcache.setup"'):
        dcache.apply(pipe, path)


def test_broken_yaml_and_oversized_files_are_refused_naming_the_file(pipe, tmp_path):
    broken = tmp_path / "s.yaml"
    broken.write_text("method: [magcache\n")
    with pytest.raises(SetupError, match="not valid YAML"):
        dcache.apply(pipe, broken)
    huge = tmp_path / "s.yml"
    huge.write_text("#" * (2 << 20))
    with pytest.raises(SetupError, match="more than"):
        dcache.apply(pipe, huge)
    assert getattr(pipe.transformer, "_dcache_engine", None) is None


def test_generate_takes_a_setup_file_and_checks_it_before_loading(pipe, tmp_path):
    runner = CliRunner()
    good = write(tmp_path, setup_dict(method="fixed_interval", knobs={"interval": 2}))
    result = runner.invoke(app, ["generate", "--prompt", "3", "--steps", "6", "--repeats", "0", "--cache", str(good),
                                 "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    with dcache.apply(pipe, "fixed_interval", interval=2) as direct:
        pipe(labels=[3], num_inference_steps=6, output_type="pt")
    assert stats["compute_ratio"] == direct.stats().compute_ratio < 1.0
    bad = write(tmp_path, setup_dict(method="fixed_interval", knobs={"interval": 0}), "bad.json")
    result = runner.invoke(app, ["generate", "--model", "org/never-loaded", "--cache", str(bad)])
    assert result.exit_code != 0 and "knobs" in result.output and "loading" not in result.output.lower()
