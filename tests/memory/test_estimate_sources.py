"""`dcache estimate --model`: a shipped model's hub id uses its shipped config (no network), an unreachable hub says
"offline", and a pipeline folder is estimated at its own defaults (the bundled model's folder = `--model tiny`)."""

from __future__ import annotations

import json
import shutil

import huggingface_hub
import pytest
from huggingface_hub.utils import LocalEntryNotFoundError
from typer.testing import CliRunner

from dcache.pipelines import estimate as est
from dcache.pipelines.bundled import TINY_MODEL_DIR
from dcache.pipelines.cli import app


@pytest.fixture()
def offline(monkeypatch):
    calls = []

    def unreachable(repo, filename, **kwargs):
        calls.append((repo, filename))
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache and outgoing traffic has "
                                      "been disabled.")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    return calls


@pytest.mark.parametrize("name", sorted(est.shipped_models()))
def test_a_shipped_models_hub_id_uses_the_shipped_config_without_network(offline, name):
    hub_id = est.shipped_models()[name]["hub_id"]
    spec, shipped = est.resolve_model(hub_id), est.resolve_model(name)
    assert offline == []  # nothing asked of the hub
    assert spec.experts == shipped.experts and spec.setting == shipped.setting


def test_an_unknown_hub_id_offline_says_offline(offline):
    result = CliRunner().invoke(app, ["estimate", "--model", "someone/unknown-model", "--no-progress"])
    assert result.exit_code != 0 and offline
    assert "offline" in result.output and "dcache estimate" in result.output and "flux.1-dev" in result.output
    assert "has no transformer/config.json" not in result.output


def test_the_bundled_folder_is_estimated_at_its_own_defaults():
    folder, tiny = est.resolve_model(str(TINY_MODEL_DIR)), est.resolve_model("tiny")
    assert folder.setting == tiny.setting
    assert (folder.setting.height, folder.setting.steps, folder.setting.cfg) == (16, 28, "split")


def test_a_folder_of_a_shipped_model_takes_its_usual_setting(tmp_path):
    (tmp_path / "transformer").mkdir()
    shutil.copy(est.CONFIGS / "qwen-image" / "transformer" / "config.json", tmp_path / "transformer" / "config.json")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    assert est.resolve_model(str(tmp_path)).setting == est.resolve_model("qwen-image").setting


def test_estimate_shows_a_bar_over_its_estimates():
    result = CliRunner().invoke(app, ["estimate", "--cache", "fora"])
    assert result.exit_code == 0, result.output
    assert "estimate: 100%" in result.output and "1/1" in result.output
