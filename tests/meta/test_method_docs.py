"""Every method documents itself: a docstring with the paper, when to use it and an example that runs on the bundled
model, and an Args section generated from the knobs (so its ranges are the validated ones); `dcache methods` lists
one line per method and preset and `dcache methods NAME` prints the full text."""

from __future__ import annotations

import dataclasses
import doctest

import pytest
import torch
from typer.testing import CliRunner

import dcache
from dcache.method_docs import describe, summary
from dcache.pipelines.cli import app

METHODS = dcache.methods()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_docstring_has_paper_use_example_and_the_validated_ranges(name):
    cls = METHODS[name]
    doc = cls.__doc__
    assert "Paper:" in doc and "Use it" in doc and "Example" in doc and ">>> " in doc, f"{cls.__name__}: {doc}"
    args = doc.split("\nArgs:\n", 1)[1]
    for field in dataclasses.fields(cls):
        line = next((line for line in args.splitlines() if line.strip().startswith(field.name + " (")), None)
        assert line is not None, f"{cls.__name__}.{field.name} is missing from Args"
        low, high = field.metadata.get("low"), field.metadata.get("high")
        if low is not None and high is not None:
            assert f"{low:g} to {high:g}" in line, line


@pytest.fixture(scope="module")
def tiny_pipeline():
    from dcache.pipelines import bundled

    pipe = bundled.load_tiny_pipeline()
    yield pipe


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_example_runs_and_reuses_work(name, tiny_pipeline, monkeypatch):
    # The example loads the bundled pipeline itself; hand it the one already loaded (same weights) to save time.
    from dcache.pipelines import bundled

    monkeypatch.setattr(bundled, "load_tiny_pipeline", lambda *a, **k: tiny_pipeline)
    test = doctest.DocTestParser().get_doctest(METHODS[name].__doc__, {}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    torch.manual_seed(0)
    result = runner.run(test, clear_globs=False)
    assert result.failed == 0 and result.attempted >= 4
    stats = test.globs["handle"].stats()
    assert stats.compute_ratio < 1.0, f"{name}: the example's setting reused nothing"
    assert test.globs["image"].size[0] > 0


def test_dcache_methods_lists_one_line_per_method_and_preset_and_documents_one():
    listing = CliRunner().invoke(app, ["methods"])
    assert listing.exit_code == 0, listing.output
    lines = listing.output.strip().splitlines()
    names = sorted(METHODS) + sorted(dcache.presets())
    assert [line.split()[0] for line in lines] == names
    assert lines[sorted(METHODS).index("magcache")].split(None, 1)[1] == summary(METHODS["magcache"])
    full = CliRunner().invoke(app, ["methods", "magcache"])
    assert full.exit_code == 0 and full.output.strip() == describe(METHODS["magcache"], dcache.presets()).strip()
    preset = CliRunner().invoke(app, ["methods", "dbcache"])
    assert preset.exit_code == 0 and "preset of fbcache" in preset.output and "probe_blocks (default 1" in \
        preset.output
    unknown = CliRunner().invoke(app, ["methods", "magcach"])
    assert unknown.exit_code == 2 and "Did you mean 'magcache'" in unknown.output


def test_docs_methods_md_is_generated_from_the_current_code():
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("dcache_methods_page", root / "benchmarks" / "methods_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.page(json.loads(module.RESULTS.read_text()))
    assert (root / "docs" / "methods.md").read_text() == expected, \
        "docs/methods.md is out of date: run `python benchmarks/methods_page.py`"
