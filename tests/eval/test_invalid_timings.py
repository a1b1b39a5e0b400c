"""A measured speed-up above its ideal (beyond IDEAL_TOLERANCE) is an invalid timing: flagged in the table, the plot
and the console, never ranked; `dcache eval` uses one torch thread for the bundled model on the CPU, as generate.

Fixture: the committed `dcache eval` results of benchmarks/results/eval_tiny, with one method's measured speed-up
set to what a busy 2-core machine produced at 2 threads (42.46x for an ideal 2.00x)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dcache.eval import plots, report
from dcache.pipelines.cli import app

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "eval_tiny" / "results.json"


@pytest.fixture()
def results() -> dict:
    out = json.loads(RESULTS.read_text())
    label = next(k for k in out["order"] if k != "uncached")
    row = out["variants"][label]
    row["ideal_speedup"], row["measured_speedup"], row["cpu_speedup"] = 2.0, 42.46, 2.1
    out["invalid_label"] = label
    return out


def test_the_tolerance_separates_noise_from_impossible(results):
    assert report.invalid_timings({"ideal_speedup": 2.0, "measured_speedup": 2.0 * (1 + report.IDEAL_TOLERANCE)}) \
        == []
    assert report.invalid_timings({"ideal_speedup": 2.0, "measured_speedup": 2.21, "cpu_speedup": 1.9}) == \
        ["measured_speedup"]
    assert report.invalid_timings({"ideal_speedup": math.inf, "measured_speedup": 50.0}) == []
    # the spread of the timed calls widens the bound: 2.21x is noise when the latencies spread by 10% each
    spread = {"latency": {"median_s": 1.0, "iqr_s": 0.1}}
    assert report.invalid_timings({"ideal_speedup": 2.0, "measured_speedup": 2.21, **spread}, spread) == []
    # the committed run (one thread, busy machine) has no invalid timing: its rows stay ranked
    committed = json.loads(RESULTS.read_text())
    assert not [k for k, row in committed["variants"].items()
                if report.invalid_timings(row, committed["variants"]["uncached"])]


def test_an_impossible_speedup_is_flagged_in_the_table_and_never_highlighted(results):
    label = results["invalid_label"]
    header, body = report.table_rows(results)
    column = header.index("measured speed-up")
    row = next(i for i, cells in enumerate(body) if cells[0] == label)
    assert body[row][column] == "42.46x" + report.INVALID
    assert (row, column) not in report._best_cells(header, body, results)
    assert any(c == column for _, c in report._best_cells(header, body, results))  # the others are still ranked
    (caveat,) = [c for c in report.caveats(results) if c.startswith("Invalid timings")]
    assert f"{label} (measured 42.46x, ideal 2.00x, at most " in caveat and "10%" in caveat
    assert caveat in report.render_markdown(results, {})
    html = report.render_html(results, {})
    assert "Invalid timings, not ranked" in html and "42.46x (invalid: above ideal)" in html


def test_the_plot_draws_an_invalid_point_at_its_ideal_only(monkeypatch, tmp_path, results):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi=110: figures.append(fig) or Path(path))
    rows = results["variants"]
    points = [plots.ParetoPoint(k, rows[k]["measured_speedup"], rows[k]["ideal_speedup"], rows[k].get("psnr"),
                                timing_valid=not report.invalid_timings(rows[k])) for k in results["order"]]
    plots.pareto_plot(points, tmp_path / "p.png")
    (ax,) = figures[0].axes
    xs = [x for collection in ax.collections for x, _ in collection.get_offsets()]
    assert 42.46 not in xs and max(xs) < 10  # the axis is not stretched to a speed-up it cannot have
    labels = ax.get_legend_handles_labels()[1]
    assert f"{results['invalid_label']} (measured timing invalid)" in labels


def test_eval_prints_the_invalid_timing_and_runs_at_one_thread(monkeypatch, tmp_path):
    from dcache.eval import runner as eval_runner

    real = eval_runner.run_eval

    def inflated(cfg, **kw):  # the reference timed as if starved of cores: every cached variant reads 40x
        result = real(cfg, **kw)
        for label, row in result.results["variants"].items():
            if label != "uncached":
                row["measured_speedup"] = 40.0 * row["ideal_speedup"]
        return result

    monkeypatch.setattr(eval_runner, "run_eval", inflated)
    torch.set_num_threads(2)
    try:
        result = CliRunner().invoke(app, ["eval", "--methods", "fora", "--prompts", "0,1", "--seeds", "1", "--steps",
                                          "4", "--repeats", "1", "--warmup", "0", "--no-flops", "--metrics", "psnr",
                                          "--no-progress", "--out", str(tmp_path / "e")])
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 1  # the bundled model on the CPU: one thread, as dcache generate
    finally:
        torch.set_num_threads(1)
    assert "(invalid: above ideal)" in result.output and "warning: Invalid timings, not ranked: fora" in result.output
    saved = json.loads((tmp_path / "e" / "results.json").read_text())
    assert saved["environment"]["torch_threads"] == 1
