"""Bad arguments of generate / calibrate / eval / search are refused before the model loads, naming the fix.

The model loader is replaced by one that fails the test, so a check that still runs after loading is caught."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dcache.pipelines import generate as generate_module
from dcache.pipelines import runner as runner_module
from dcache.pipelines.cli import app

CORRUPT = '{"format": "dcache.plan", "version": 1, "actions": '  # a truncated plan file


@pytest.fixture()
def no_loading(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(runner_module, "load_pipeline", refuse)
    monkeypatch.setattr(generate_module, "load_pipeline", refuse)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corrupt.plan.json").write_text(CORRUPT)
    (tmp_path / "list.json").write_text("[1, 2]")


CASES = [
    (["generate", "--cache", "magcach"], "Did you mean 'magcache'"),
    (["generate", "--set", "treshold=0.1"], "threshold"),
    (["generate", "--set", "threshold=-1"], "threshold=-1 is invalid"),
    (["generate", "--steps", "-5"], "--steps -5 must be >= 1"),
    (["generate", "--cache", "corrupt.plan.json"], "not valid JSON"),
    (["generate", "--cache", "list.json"], "neither a dcache plan"),
    (["generate", "--cache", "missing.json"], "does not exist"),
    (["generate", "--threads", "0"], "--threads 0 must be >= 1"),
    (["generate", "--scope", "everything"], "--scope 'everything'"),
    (["generate", "--speed", "fast"], "must look like '2x'"),
    (["generate", "--model", "not a model"], "neither an existing folder nor a hub id"),
    (["calibrate", "--steps", "-5"], "--steps -5 must be >= 1"),
    (["calibrate", "--method", "bac", "--set", "treshold=0.1"], "treshold"),
    (["calibrate", "--model", "org/a..b"], "neither an existing folder nor a hub id"),
    (["eval", "--methods", "magcach"], "Did you mean 'magcache'"),
    (["eval", "--methods", "fbcache:treshold=0.1"], "threshold"),
    (["eval", "--methods", "corrupt.plan.json"], "not valid JSON"),
    (["eval", "--steps", "-5"], "--steps -5 must be >= 1"),
    (["eval", "--threads", "0"], "--threads 0 must be >= 1"),
    (["search", "--method", "dp", "--steps", "-5"], "--steps -5 must be >= 1"),
    (["search", "--method", "ecad", "--granularity", "cell"], "granularity='cell'"),
    (["search", "--method", "lemica", "--budget", "fast"], "--budget 'fast'"),
    (["search", "--method", "disca", "--base-plans", "corrupt.plan.json"], "not valid JSON"),
    (["search", "--method", "dp", "--threads", "0"], "--threads 0 must be >= 1"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused_before_the_model_loads(no_loading, args, message):
    result = CliRunner().invoke(app, [*args, "--no-progress"] if args[0] != "calibrate" else args)
    assert result.exit_code != 0
    assert "the model was loaded" not in str(result.exception or "") + result.output
    assert message in result.output, result.output
