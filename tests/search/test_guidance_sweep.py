"""`dcache search --guidance 1.5,3`: the calibration set at several guidance scales, plans scored by their worst
scale, the scales recorded in every plan's provenance. Reference: each scale's own uncached images, and the plan
replayed at each scale on its own."""

import pytest
import torch
import typer
from search_testkit import STEPS

import dcache
from dcache.pipelines.search_cli import make_calibration, parse_guidance, quality_psnr, run_search
from dcache.plans.plan import Plan

SCALES = [1.5, 4.0]


def _images(pipe, guidance, plan=None):
    """The calibration images (labels 1, 7, seed 0) at one scale, uncached or with `plan` replayed."""
    handle = dcache.apply(pipe, plan) if plan is not None else None
    try:
        with torch.no_grad():
            return pipe(labels=[1, 7], num_inference_steps=STEPS, guidance_scale=guidance,
                        generator=torch.Generator().manual_seed(0), output_type="pt").images.float().cpu()
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("text, expected", [("", []), ("3", [3.0]), ("1.5, 3", [1.5, 3.0]), ("0,1", [0.0, 1.0])])
def test_parse_guidance(text, expected):
    assert parse_guidance(text) == expected


@pytest.mark.parametrize("text, words", [("3,3", "twice"), ("two", "guidance scales"), ("nan", "finite")])
def test_parse_guidance_refuses_with_the_fix(text, words):
    with pytest.raises(typer.BadParameter, match=words):
        parse_guidance(text)


def test_sweep_quality_is_the_worst_scale_against_each_scales_own_reference(tiny_pipe):
    calib = make_calibration(tiny_pipe, True, ["1", "7"], steps=STEPS, seed=0, guidance=SCALES)
    refs = [_images(tiny_pipe, g) for g in SCALES]
    assert torch.equal(calib.reference(), torch.cat(refs))  # one generation per scale, in the order given
    handle = dcache.apply(tiny_pipe, "fixed_interval", interval=2)
    try:
        with torch.no_grad():
            cached = calib.generate()
        plan = handle.plan()
    finally:
        handle.remove()
    per_scale = [quality_psnr(_images(tiny_pipe, g, plan), r) for g, r in zip(SCALES, refs)]
    assert per_scale[0] != per_scale[1]
    assert calib.quality_fn(cached, calib.reference()) == pytest.approx(min(per_scale), abs=1e-4)
    metrics = calib.metrics_fn(cached, calib.reference())
    assert metrics["psnr@g1.5"] == pytest.approx(per_scale[0], abs=1e-4)
    assert metrics["psnr@g4"] == pytest.approx(per_scale[1], abs=1e-4)
    assert metrics["psnr_worst_scale"] == pytest.approx(min(per_scale), abs=1e-4)
    with pytest.raises(ValueError, match="do not match the guidance sweep"):
        calib.quality_fn(cached[:3], calib.reference()[:3])


def test_search_over_scales_scores_replays_and_records_them(tiny_pipe, tmp_path):
    front = run_search("dp", tiny_pipe, True, budget="3", out=str(tmp_path), steps=STEPS, prompts="1,7",
                       guidance=SCALES, progress=False)
    (point,) = front["points"]
    plan = Plan.load(tmp_path / point["plan"])
    assert plan.provenance["calibration"]["guidance"] == SCALES
    assert set(plan.actions) == {"cond", "uncond"}
    worst = min(quality_psnr(_images(tiny_pipe, g, plan), _images(tiny_pipe, g)) for g in SCALES)
    assert point["quality"] == pytest.approx(worst, abs=1e-4)  # the front's number is the worst scale's replay
    assert point["metrics"]["psnr_worst_scale"] == pytest.approx(worst, abs=1e-4)


def test_one_scale_search_runs_at_that_scale(tiny_pipe, tmp_path):
    front = run_search("dp", tiny_pipe, True, budget="3", out=str(tmp_path), steps=STEPS, prompts="1,7",
                       guidance=[4.0], progress=False)
    (point,) = front["points"]
    plan = Plan.load(tmp_path / point["plan"])
    assert plan.provenance["calibration"]["guidance"] == 4.0
    at_4 = quality_psnr(_images(tiny_pipe, 4.0, plan), _images(tiny_pipe, 4.0))
    assert point["quality"] == pytest.approx(at_4, abs=1e-4)


def test_scales_that_run_different_branches_are_refused_before_the_search(tiny_pipe, tmp_path):
    out = tmp_path / "search"
    with pytest.raises(typer.BadParameter, match=r"different branches \(guidance 1: \['cond'\], guidance 3: "
                                                 r"\['cond', 'uncond'\]\)"):
        run_search("dp", tiny_pipe, True, budget="3", out=str(out), steps=STEPS, prompts="1,7", guidance=[1.0, 3.0],
                   progress=False)
    assert not out.exists()  # nothing written


def test_cli_refuses_a_repeated_scale_before_loading_anything(tmp_path):
    from typer.testing import CliRunner

    from dcache.pipelines.cli import app

    result = CliRunner().invoke(app, ["search", "--method", "dp", "--guidance", "3,3", "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert "twice" in result.output
    assert not any(tmp_path.iterdir())


def _replay_quality(pipe, plan, scope, guidance):
    scoped = dict(plan.to_dict())
    scoped["extras"] = {**plan.extras, "scope": scope}
    return quality_psnr(_images(pipe, guidance, Plan.from_dict(scoped)), _images(pipe, guidance))


@pytest.mark.parametrize("scope", ["auto", "call"])
def test_scope_choice_keeps_the_better_replay_on_the_calibration_set(tiny_pipe, tmp_path, scope):
    front = run_search("lemica", tiny_pipe, True, budget="2", out=str(tmp_path), steps=STEPS, prompts="1,7",
                       max_span=4, forecast_order=1, guidance=[4.0], scope=scope, progress=False)
    (point,) = front["points"]
    plan = Plan.load(tmp_path / point["plan"])
    by_scope = {s: _replay_quality(tiny_pipe, plan, s, 4.0) for s in ("blocks", "call")}
    assert by_scope["blocks"] != pytest.approx(by_scope["call"], abs=1e-3)  # the choice matters on this model
    chosen = max(by_scope, key=by_scope.get) if scope == "auto" else "call"
    assert plan.extras["scope"] == chosen
    assert point["quality"] == pytest.approx(by_scope[chosen], abs=1e-4)  # the front's number is the chosen replay
    assert point["metrics"]["quality_call_scope"] == pytest.approx(by_scope["call"], abs=1e-4)
    with dcache.apply(tiny_pipe, plan) as handle:  # the plan file alone replays in the chosen scope
        assert handle.engine.scope == chosen


def test_scope_choice_refuses_unknown_scopes(tiny_pipe, tmp_path):
    from dcache.schedules.tuning.search import choose_scope

    with pytest.raises(ValueError, match="subset of"):
        choose_scope(None, None, tmp_path, ("everywhere",))
    with pytest.raises(ValueError, match="scope 'everywhere' must be one of"):
        run_search("dp", tiny_pipe, True, budget="3", out=str(tmp_path), steps=STEPS, prompts="1,7",
                   scope="everywhere", progress=False)
