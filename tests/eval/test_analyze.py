"""`dcache analyze`: statistics against dcache's own MagCache calibration and decision rule, mergeable sums."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dcache.eval.analyze import (AnalyzeConfig, STACK, merge_sums, run_analyze, simulate_magcache,
                                 statistics_from_sums, _Sums)

STEPS = 6


@pytest.fixture(scope="module")
def analysis(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze")
    # CFG: 2 branches
    cfg = AnalyzeConfig(model=str(tiny_dir), prompts="0,1,2", steps=STEPS, guidance=3.0, out=str(out))
    return run_analyze(cfg, progress=False)


def test_files_and_shapes(analysis):
    a = analysis.analysis
    out = analysis.out_dir
    for name in ("summary.md", "analysis.json", "magcache_curve.png", "stack_change.png", "change_cond.png",
                 "cosine_uncond.png", "magnitude_cond.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / "analysis.json").read_text())["format"] == "dcache.analysis"
    assert a["units"] == [f"b{i}" for i in range(8)] + [STACK]
    assert set(a["statistics"]) == {"cond", "uncond"}
    for stats in a["statistics"].values():
        change, cosine = torch.tensor(stats["change"]), torch.tensor(stats["cosine"])
        assert change.shape == (STEPS, 9) and torch.isnan(change[0]).all()  # no previous step at step 0
        assert (change[1:] >= 0).all() and (cosine[1:].abs() <= 1 + 1e-9).all()
    summary = (out / "summary.md").read_text()
    assert "## Suggested settings" in summary and "magcache:threshold=" in summary


def test_magnitude_curve_equals_dcache_magcache_calibration(analysis, tiny_dir):
    from dcache.pipelines.runner import GenerationJob, load_pipeline
    from dcache.schedules.tuning.calibrate import calibrate_magcache

    pipe, _ = load_pipeline(str(tiny_dir))
    pipe.set_progress_bar_config(disable=True)
    job = GenerationJob(pipe, True, prompts=["0", "1", "2"], steps=STEPS, guidance=3.0)
    table = calibrate_magcache(pipe, job, register=False)
    for branch in ("cond", "uncond"):
        assert analysis.analysis["magcache_curve"][branch] == pytest.approx(table[branch], abs=2e-5)


@pytest.mark.parametrize("threshold", [0.05, 0.3])
def test_simulated_magcache_decisions_equal_the_engine(analysis, tiny_dir, threshold):
    import dcache
    from dcache.pipelines.runner import GenerationJob, load_pipeline

    gamma = analysis.analysis["magcache_curve"]
    pipe, _ = load_pipeline(str(tiny_dir))
    pipe.set_progress_bar_config(disable=True)
    with dcache.apply(pipe, "magcache", ratios=gamma["cond"], ratios_uncond=gamma["uncond"], threshold=threshold,
                      retention_ratio=0.2) as handle:
        GenerationJob(pipe, True, prompts=["0"], steps=STEPS, guidance=3.0)()
        per_step = handle.stats().per_step
    for branch in ("cond", "uncond"):
        engine = "".join(step[branch] for step in per_step)
        assert engine == simulate_magcache(gamma[branch], threshold, retention_ratio=0.2)


def test_split_sums_merge_to_the_whole():
    g = torch.Generator().manual_seed(0)
    gens = [[torch.randn(2, 5, 3, generator=g, dtype=torch.float64) for _ in range(4)] for _ in range(3)]

    def sums_of(generations):
        s = _Sums()
        for steps in generations:
            s.new_generation()
            for i, r in enumerate(steps):
                s.add("cond", "b0", i, r)
        return s.plain()

    whole = statistics_from_sums(merge_sums([sums_of(gens)]), 4, ["b0"])
    split = statistics_from_sums(merge_sums([sums_of(gens[:1]), sums_of(gens[1:])]), 4, ["b0"])
    assert whole == split or all(math.isclose(a[0], b[0], rel_tol=1e-12) or (math.isnan(a[0]) and math.isnan(b[0]))
                                 for k in whole["cond"] for a, b in zip(whole["cond"][k], split["cond"][k]))
    # a residual that doubles: change 1, cosine 1, magnitude 2
    s = _Sums()
    r = torch.randn(1, 4, 3, generator=g, dtype=torch.float64)
    s.add("cond", "b0", 0, r)
    s.add("cond", "b0", 1, 2 * r)
    st = statistics_from_sums(merge_sums([s.plain()]), 2, ["b0"])["cond"]
    assert st["change"][1][0] == pytest.approx(1.0) and st["cosine"][1][0] == pytest.approx(1.0)
    assert st["magnitude"][1][0] == pytest.approx(2.0)
