"""`--model` names: every hub id the README and docs use is accepted, checked before anything loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcache.pipelines.cli import app
from dcache.pipelines.runner import check_model

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `--model org/name` in commands and `from_pretrained("org/name"` in Python; a path with more than one '/' is a folder
HUB_ID = re.compile(r'(?:--model\s+|from_pretrained\(")([A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9])(?=[\s"`)]|$)')


def documented_hub_ids() -> list[str]:
    ids = {m.group(1) for doc in DOCUMENTS for m in HUB_ID.finditer(doc.read_text())}
    return sorted(ids)


def test_the_docs_name_hub_ids_with_dots():
    ids = documented_hub_ids()
    # the README's own model and the video docs' model: both have a '.' in the name, which used to be refused
    assert {"black-forest-labs/FLUX.1-dev", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"} <= set(ids), ids


@pytest.mark.parametrize("hub_id", documented_hub_ids())
def test_every_documented_hub_id_is_accepted(hub_id):
    assert check_model(hub_id) == "hub"


@pytest.mark.parametrize("name", ["org/na me", "org/-name", "org/name.", "org/a..b", "org/a--b", "a/b/c", "name",
                                  "flux.1-dev", "org/" + "x" * 97])
def test_invalid_names_are_refused_with_the_rule(name):
    with pytest.raises(ValueError, match="neither an existing folder nor a hub id like 'org/name'"):
        check_model(name)


def test_a_folder_without_model_index_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without model_index.json"):
        check_model(str(tmp_path))
    assert check_model(None) == check_model("tiny") == "tiny"


@pytest.mark.parametrize("command", [
    ["generate", "--repeats", "0"],
    ["calibrate", "--prompt", "a cat"],
    ["eval", "--seeds", "1", "--no-progress"],
    ["search", "--method", "dp", "--no-progress"],
])
def test_commands_hand_a_dotted_hub_id_to_diffusers(tmp_path, monkeypatch, command):
    """The README's model reaches DiffusionPipeline.from_pretrained (offline here: it raises, and the error names
    the network), instead of being refused as a name."""
    import diffusers

    asked = []

    def offline(name, **kwargs):
        asked.append(name)
        raise OSError("offline (test)")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", offline)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*command, "--model", "black-forest-labs/FLUX.1-dev"])
    assert result.exit_code != 0
    assert asked == ["black-forest-labs/FLUX.1-dev"], result.output
    assert "neither an existing folder" not in result.output
