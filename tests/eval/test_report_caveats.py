"""The eval report does not mislead: FID on few images carries a caveat, the "identical" line is a labelled threshold.

Fixture: the committed `dcache eval` results of benchmarks/results/eval_tiny (40 images per method, FID columns),
with the image count changed where a test needs another sample size.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from dcache.eval import plots, report
from dcache.eval.plots import ParetoPoint

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "eval_tiny" / "results.json"


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(RESULTS.read_text())


def _with_images(results: dict, n: int) -> dict:
    out = copy.deepcopy(results)
    for row in out["variants"].values():
        row["num_images"] = n
    return out


def _fid_cells(results: dict) -> list[str]:
    header, body = report.table_rows(results)
    columns = [i for i, h in enumerate(header) if h.startswith("FID")]
    assert columns, header  # the fixture has FID columns
    return [row[c] for row in body for c in columns if row[c] != "—"]


def test_fid_on_few_images_is_marked_and_explained_in_markdown_and_html(results):
    few = _with_images(results, 3)
    assert all(cell.endswith(report.SMALL_SAMPLE) for cell in _fid_cells(few))
    (caveat,) = [c for c in report.caveats(few) if "FID" in c]
    assert "3 images" in caveat and str(report.FID_MIN_IMAGES) in caveat
    assert caveat in report.render_markdown(few, {})
    assert "FID on 3 images per method" in report.render_html(few, {})
    # a marked value is never highlighted as the best of its column
    header, body = report.table_rows(few)
    fid = {c for c, h in enumerate(header) if h.startswith("FID")}
    assert not any(c in fid for _, c in report._best_cells(header, body, few))


def test_fid_on_enough_images_has_no_caveat(results):
    enough = _with_images(results, report.FID_MIN_IMAGES)
    assert not any(cell.endswith(report.SMALL_SAMPLE) for cell in _fid_cells(enough))
    assert not [c for c in report.caveats(enough) if "FID" in c]
    assert "Frechet distance is mostly" not in report.render_markdown(enough, {})


def test_latencies_that_disagree_are_named_and_steady_ones_are_not(results):
    # the committed run was timed on a busy shared CPU: IQR 21-36% of the median
    (noisy,) = [c for c in report.caveats(results) if c.startswith("Latency IQR")]
    lat = results["variants"]["fbcache"]["latency"]
    assert f"fbcache ({lat['iqr_s'] / lat['median_s']:.0%})" in noisy
    steady = _with_images(results, report.FID_MIN_IMAGES)
    for row in steady["variants"].values():
        row["latency"] = {**row["latency"], "iqr_s": 0.05 * row["latency"]["median_s"]}
    assert report.caveats(steady) == []


def test_the_identical_line_is_a_labelled_threshold_above_every_tick(monkeypatch, tmp_path):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi=110: figures.append(fig) or Path(path))
    points = [ParetoPoint("uncached", 1.0, 1.0, math.inf), ParetoPoint("a", 1.5, 2.0, 37.1),
              ParetoPoint("b", 1.2, 1.4, 30.0), ParetoPoint("exact", 1.1, 1.2, math.inf)]
    label = "PSNR ≥ 99.9 dB: treated as identical (drawn above the scale, not at a value)"
    plots.pareto_plot(points, tmp_path / "p.png", identical_label=label)
    (ax,) = [a for a in figures[0].axes]
    texts = [t.get_text().strip() for t in ax.texts]
    assert label in texts
    line_y = next(line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == "--")
    assert line_y > 37.1 + 0.25 * (37.1 - 30.0)  # clear of the best finite point, not "just above" it
    assert all(t < line_y for t in ax.get_yticks())  # no tick reads as the line's value
