"""`dcache estimate`: offline on the bundled model and the shipped configs; teaching errors for bad models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dcache.memory.estimate import meta_model
from dcache.pipelines.cli import app
from dcache.pipelines.estimate import resolve_model, shipped_models

runner = CliRunner()


def test_estimate_prints_memory_flops_and_ratio_range_for_the_bundled_model():
    result = runner.invoke(app, ["estimate", "--cache", "fixed_interval", "--steps", "5", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    # 2 branches x (64 image + 4 label tokens) x 128 channels x 4 bytes = 68 KiB
    assert "fixed_interval: peak cache 68.00 KiB (stack 68.00 KiB)" in result.output
    assert "compute ratio 0.400 - 1.000" in result.output  # intervals 2..6 over 5 steps: steps 0 and 4 at best


def test_estimate_json_sums_by_branch_to_the_peak():
    result = runner.invoke(app, ["estimate", "--cache", "taylorseer", "--steps", "4", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    m = row["memory"]
    assert sum(sum(k.values()) for k in m["by_branch"].values()) == m["peak_bytes"] > 0


# Published transformer configs (diffusers config.json): the fields that set the cache shapes.
PUBLISHED = {
    "flux.1-dev": ("FluxTransformer2DModel", dict(num_layers=19, num_single_layers=38, num_attention_heads=24,
                                                  attention_head_dim=128, in_channels=64)),
    "qwen-image": ("QwenImageTransformer2DModel", dict(num_layers=60, num_attention_heads=24, attention_head_dim=128)),
    "wan2.1-t2v-14b": ("WanTransformer3DModel", dict(num_layers=40, num_attention_heads=40, ffn_dim=13824)),
    "wan2.2-t2v-a14b": ("WanTransformer3DModel", dict(num_layers=40, num_attention_heads=40, ffn_dim=13824)),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", dict(num_layers=20, num_single_layers=40,
                                                            num_attention_heads=24, attention_head_dim=128)),
    "sd3.5-large": ("SD3Transformer2DModel", dict(num_layers=38, num_attention_heads=38, attention_head_dim=64)),
    "ltx-video": ("LTXVideoTransformer3DModel", dict(num_layers=28, num_attention_heads=32, attention_head_dim=64)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_build_on_the_meta_device(name):
    import diffusers

    spec = resolve_model(name)
    cls_name, fields = PUBLISHED[name]
    assert name in shipped_models()
    assert len(spec.experts) == (2 if name == "wan2.2-t2v-a14b" else 1)
    for _, config in spec.experts:
        assert config["_class_name"] == cls_name
        model = meta_model(getattr(diffusers, cls_name), config, torch.bfloat16)
        assert all(p.device.type == "meta" for p in model.parameters())
        assert {k: model.config[k] for k in fields} == fields


def test_bad_models_get_teaching_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = runner.invoke(app, ["estimate", "--model", str(tmp_path / "config.json")])
    assert result.exit_code == 2 and "_class_name" in result.output
    result = runner.invoke(app, ["estimate", "--model", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "shipped config" in result.output


@pytest.mark.slow
def test_the_memory_page_table_is_the_commands_output(monkeypatch):
    """docs/memory.md's cache-memory table is `dcache estimate --table`: its rows name every shipped config, and the
    command, run with the shipped configs cut to one (SD3.5-large: the quickest to estimate), prints that row and
    the same header."""
    import dcache.pipelines.estimate as est

    page = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    block = page.split("<!-- begin: dcache estimate --table -->\n")[1].split("<!-- end: dcache estimate --table")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in block.strip().splitlines()[2:]}
    assert list(rows) == list(shipped_models())
    one = {"sd3.5-large": shipped_models()["sd3.5-large"]}
    monkeypatch.setattr(est, "shipped_models", lambda: one)
    result = runner.invoke(app, ["estimate", "--table", "--no-progress"])
    assert result.exit_code == 0, result.output
    fresh = result.output.strip().splitlines()
    assert fresh[0] == block.strip().splitlines()[0]  # the same methods, in the same order
    assert fresh[2:] == [rows["sd3.5-large"]]


def test_experts_of_one_architecture_are_estimated_once(monkeypatch):
    """Wan2.2-A14B's two experts share a config: the second gets the first's estimates (equal by construction: same
    meta model, same inputs) instead of a second meta run, which doubled `--table` and `--cache all` there."""
    import dcache.pipelines.estimate as est

    calls = []
    real = est.estimate
    monkeypatch.setattr(est, "estimate", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    spec = resolve_model("wan2.2-t2v-a14b")
    assert [e for e, _ in spec.experts] == ["transformer", "transformer_2"]
    steps = []
    rows = est.estimate_spec(spec, ["fbcache"], memory_only=True, on_row=steps.append)
    assert calls == ["fbcache"] and len(steps) == 2
    assert [r.expert for r in rows] == ["transformer", "transformer_2"]
    assert rows[0].estimate.memory.peak_bytes == rows[1].estimate.memory.peak_bytes > 0
