"""Fuzzing the user surface (hypothesis): plan files, config values and `dcache generate` arguments.

Whatever the input, the outcome is one of:
  * dcache's own error (PlanError, or the config's ValueError / TypeError) whose message names the field or the file,
    with the model left clean (no dcache hook, no wrapped forward, the scheduler untouched) and nothing written;
  * a correct run: finite output within a relative error of 1.0 of the uncached output (plans, configs), or for the
    command line exit code 0 with complete stats.json / plan.json;
and the command line never prints a traceback: exit code 0, or 2 with one `error:` line. No temporary file is left.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from compat_kit import dcache_hook_count, make_pipeline, rel_error, scheduler_is_pristine, seeded
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import dcache
from dcache import Plan, PlanError
from dcache.methods import methods
from dcache.pipelines.cli import app

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=6)


def generate(pipe) -> torch.Tensor:
    return pipe([1, 7], num_inference_steps=3, guidance_scale=2.0, generator=seeded(0))


def assert_clean(pipe) -> None:
    assert dcache_hook_count(pipe.transformer) == 0 and scheduler_is_pristine(pipe.scheduler)
    assert getattr(pipe.transformer, "_dcache_engine", None) is None


def run_or_refuse(pipe, uncached, method, overrides: dict, names: re.Pattern) -> None:
    """apply + generate: a refusal must be a dcache error naming the field / file (model clean after), a run must
    be correct."""
    handle = None
    try:
        handle = dcache.apply(pipe, method, **overrides)
        out = generate(pipe)
    except (PlanError, ValueError, TypeError) as exc:
        assert names.search(str(exc)), f"{type(exc).__name__} does not name the field or file: {exc}"
        return
    finally:
        if handle is not None:
            handle.remove()
        assert_clean(pipe)
    assert torch.isfinite(out).all() and rel_error(out, uncached) < 1.0


@pytest.fixture(scope="module")
def setup():
    pipe = make_pipeline()
    uncached = generate(pipe)
    with dcache.apply(pipe, "fbcache", threshold=0.5) as handle:
        generate(pipe)
        plan = handle.plan().to_dict()
    return pipe, uncached, plan


PLAN_FIELDS = sorted(["format", *Plan.__dataclass_fields__])


@SETTINGS
@given(field=st.sampled_from(PLAN_FIELDS), value=JSON, delete=st.booleans())
@example(field="probe_blocks", value=7, delete=False)  # more probe blocks than the model has
@example(field="forecast_order", value=10**12, delete=False)  # Taylor tables of 10**12 + 1 tensors
def test_plan_files(setup, tmp_path, field, value, delete):
    pipe, uncached, valid = setup
    plan = copy.deepcopy(valid)
    if delete:
        del plan[field]
    else:
        plan[field] = value
    file = tmp_path / "plan.json"
    text = json.dumps(plan)
    file.write_text(text)
    run_or_refuse(pipe, uncached, str(file), {}, re.compile(r"plan"))
    assert file.read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@SETTINGS
@given(data=st.data())
def test_config_values(setup, data):
    pipe, uncached, _ = setup
    method = data.draw(st.sampled_from(sorted(methods())), label="method")
    config = dcache.config_for(method)
    fields = sorted(config.to_dict()) + ["not_a_field"]
    field = data.draw(st.sampled_from([f for f in fields if f not in ("method", "version")]), label="field")
    value = data.draw(JSON, label="value")
    names = re.compile(rf"{re.escape(field)}|calibrat|registered|plan|num_steps")  # the field, or what it needs
    run_or_refuse(pipe, uncached, method, {field: value}, names)


CLI_VALUES = {
    "--steps": st.integers(-3, 3).map(str),
    "--seed": st.one_of(st.integers(-5, 2**40).map(str), st.just("x")),
    "--guidance": st.sampled_from(["1.0", "2", "nan", "-1", "x"]),
    "--cache": st.sampled_from(["fbcache", "magcache", "nope", "plan.json", "", "fora"]),
    "--scope": st.sampled_from(["blocks", "call", "nope"]),
    "--set": st.sampled_from(["threshold=0.2", "threshold=nan", "threshold=-1", "nope=1", "threshold", "="]),
    "--repeats": st.sampled_from(["1", "0", "-2"]),
    "--out": st.sampled_from(["folder", "a file", "under a file"]),
}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(chosen=st.fixed_dictionaries({}, optional=CLI_VALUES))
@example(chosen={"--out": "a file"})
def test_generate_arguments(tmp_path_factory, chosen):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "taken").write_text("x")
    where = chosen.pop("--out", "folder")
    out = {"folder": folder / "out", "a file": folder / "taken", "under a file": folder / "taken" / "out"}[where]
    args = ["generate", "--out", str(out), "--no-progress"]
    chosen.setdefault("--steps", "2")
    chosen.setdefault("--repeats", "1")
    for flag, value in chosen.items():
        args += [flag, value]
    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 2), (args, result.output, result.exception)
    if result.exit_code == 0:
        assert where == "folder"
        assert json.loads((out / "stats.json").read_text()) and json.loads((out / "plan.json").read_text())
    else:
        assert "Error" in result.output or "error" in result.output
    assert not [p for p in folder.rglob("*") if ".tmp" in p.name]
    assert (folder / "taken").read_text() == "x"
