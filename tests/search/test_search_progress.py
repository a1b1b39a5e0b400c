"""`dcache search` shows progress from its first calibration generation (every method spends its time in them), and
LeMiCa saves every measured edge as it goes, so an interrupted search resumes without measuring it again."""

from __future__ import annotations

import json

import pytest
from search_testkit import STEPS, make_calibration, tiny_pipe
from typer.testing import CliRunner

from dcache.pipelines.cli import app
from dcache.schedules.tuning.search import lemica
from dcache.schedules.tuning.search.core import make_template


@pytest.mark.parametrize("method", ["dp", "lemica"])
def test_search_counts_its_generations_from_the_first(tmp_path, method):
    result = CliRunner().invoke(app, ["search", "--method", method, "--steps", "6", "--prompts", "1",
                                      "--out", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    text = result.output.replace("\r", "\n")
    # the first generation (the template) already moves the counter; dp runs template, reference, residual
    # recording and one generation per budget
    assert f"{method} search: 1 generations" in text, text
    assert f"{method} search: 5 generations" in text


def test_lemica_saves_every_edge_and_resumes_after_an_interruption(tmp_path):
    calib = make_calibration(tiny_pipe())
    template = make_template(calib)
    cache = tmp_path / "edges.json"
    measured = []

    def stop_after_three(images, reference):
        if len(measured) == 3:
            raise KeyboardInterrupt
        measured.append(1)
        return lemica.l1_error(images, reference)

    with pytest.raises(KeyboardInterrupt):
        lemica.edge_weights(calib, template, 4, stop_after_three, cache, progress=False)
    saved = json.loads(cache.read_text())["edges"]
    assert len(saved) == 3  # each measured edge was written as soon as it was measured

    again = []

    def count(images, reference):
        again.append(1)
        return lemica.l1_error(images, reference)

    weights = lemica.edge_weights(calib, template, 4, count, cache, progress=False)
    spans = [(i, j) for i in range(STEPS) for j in range(i + 2, min(STEPS, i + 4) + 1)]
    assert len(again) == len(spans) - 3  # only the edges not saved before the interruption
    assert all(weights[f] == saved[f"{f[0]}-{f[1]}"] for f in map(lambda k: tuple(map(int, k.split("-"))), saved))
