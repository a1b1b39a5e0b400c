"""DisCa learned forecaster on the tiny model: trains end to end, resumes exactly, replays deterministically, starts as
the Taylor forecast, and rejects damaged or mismatched predictors with a clear error."""

import base64
import copy
import json

import pytest
import torch

import dcache
from dcache.actions import Granularity
from dcache.plans.plan import Plan, PlanError
from dcache.schedules.tuning.search import make_template, run_plan
from dcache.schedules.tuning.search import disca as D

STEPS = 6  # the calibration of tests/search (labels 1, 7) at 6 steps
COMPUTED = (0, 1, 3, 5)


@pytest.fixture(scope="module")
def setup(tiny_pipe):
    import search_testkit

    calib = search_testkit.make_calibration(tiny_pipe, steps=STEPS)
    template = make_template(calib)
    base = template.plan(Granularity.STACK, ["C" if s in COMPUTED else "R" for s in range(STEPS)], method="test")
    runs = [calib.generate, search_testkit.make_calibration(tiny_pipe, steps=STEPS, seed=1).generate]
    recording, timesteps = D.record_units(tiny_pipe, runs, base)
    data = D.build_samples(recording, timesteps, [base], order=1)
    return calib, template, base, runs, data


def test_trains_end_to_end_and_beats_taylor_on_its_samples(setup, tmp_path):
    calib, template, base, runs, _ = setup
    before = {k: v.clone() for k, v in calib.pipe.transformer.state_dict().items()}
    cfg = D.DisCaConfig(iterations=60, hidden=32, online_iterations=0)
    pred, summary = D.train_disca(calib, [base], tmp_path, cfg, runs=runs, progress=False)
    # 2 segments x (image, label) streams, each trained to a lower forecast error than the Taylor start
    assert sorted(summary["rel_mse_disca"]) == ["seg0.0", "seg0.1", "seg1.0", "seg1.1"]
    for name, err in summary["rel_mse_disca"].items():
        assert err < 0.8 * summary["rel_mse_taylor"][name], (name, err, summary["rel_mse_taylor"][name])
    after = calib.pipe.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # backbone frozen
    assert all(p.requires_grad for p in calib.pipe.transformer.parameters())  # restored for the caller
    assert pred.num_params() < 0.1 * sum(p.numel() for p in calib.pipe.transformer.parameters())

    plan = D.disca_plan(base, pred, summary)
    twin = D.taylor_plan(base, 1)
    assert template.compute_ratio(plan) == template.compute_ratio(twin) == template.compute_ratio(base) < 0.7
    assert all("R" not in row and "F" in "".join(rows) for rows in plan.actions.values() for row in rows)
    images = run_plan(calib, plan)
    assert torch.isfinite(images).all()
    assert not torch.equal(images, run_plan(calib, twin))  # the F cells are served by the predictor
    assert calib.quality_fn(images, calib.reference()) > 20.0  # a forecast, not noise


def test_student_rollout_follows_the_cached_replay_and_records_the_truth(setup):
    calib, template, base, runs, _ = setup
    student = D.taylor_plan(base, 1)
    images = []
    teacher, _ = D.record_units(calib.pipe, [lambda: images.append(calib.generate())], base)
    rollout, _ = D.record_units(calib.pipe, [lambda: images.append(calib.generate())], base, student=student)
    assert torch.equal(images[0], calib.reference())  # the teacher run is the uncached one
    # the student run is the cached replay: the rollout forecasts each list's segment, the replay the merged run
    # (Schedule.segment_runs), the same sum r0 + r1 rounded in another order
    assert (images[1] - run_plan(calib, student)).abs().max() < 1e-5
    for branch, units in teacher[0].items():
        for key, steps in units.items():
            assert sorted(steps) == list(range(STEPS))  # true values at every step, skipped ones included
            assert torch.equal(steps[0][0], rollout[0][branch][key][0][0])  # same start ...
            assert not torch.equal(steps[STEPS - 1][0], rollout[0][branch][key][STEPS - 1][0])  # ... drifted later


def test_untrained_predictor_is_exactly_the_taylor_forecast(setup, tmp_path):
    calib, template, base, runs, data = setup
    cfg = D.DisCaConfig(iterations=0, hidden=16, online_iterations=0)
    pred, summary = D.train_predictor(data, tmp_path, cfg, progress=False)
    assert summary["rel_mse_disca"] == summary["rel_mse_taylor"]
    disca_images = run_plan(calib, D.disca_plan(base, pred, summary))
    # per-list segments (the predictor's units) vs the Taylor plan's merged run (Schedule.segment_runs): the same
    # forecasts summed in another order
    assert (disca_images - run_plan(calib, D.taylor_plan(base, 1))).abs().max() < 1e-5
    assert not torch.equal(disca_images, run_plan(calib, base))  # Taylor order 1 differs from reuse


def test_resume_gives_the_same_predictor_as_an_uninterrupted_run(setup, tmp_path):
    *_, data = setup
    cfg = D.DisCaConfig(iterations=12, hidden=16, checkpoint_every=5, seed=3, online_iterations=0)
    straight, s1 = D.train_predictor(data, tmp_path / "a", cfg, progress=False)
    _, partial = D.train_predictor(data, tmp_path / "b", cfg, progress=False, stop_after=7)
    assert partial["iterations"] == 7
    assert D._load(tmp_path / "b" / D.CHECKPOINT)["iteration"] == 7  # saved at the stop
    resumed, s2 = D.train_predictor(data, tmp_path / "b", cfg, progress=False, resume=True)
    assert s2["iterations"] == 12
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert s1["rel_mse_disca"] == s2["rel_mse_disca"]
    with pytest.raises(ValueError, match="other calibration data, plans or config"):
        D.train_predictor(data, tmp_path / "b", D.DisCaConfig(iterations=12, hidden=32, online_iterations=0),
                          progress=False, resume=True)


def test_closed_loop_finetuning_lowers_the_output_error_and_resumes_exactly(setup, tmp_path):
    calib, template, base, runs, _ = setup
    cfg = D.DisCaConfig(iterations=3, hidden=16, online_iterations=4, online_lr=3e-3, rollout=())
    pred, summary = D.train_disca(calib, [base], tmp_path / "a", cfg, runs=runs[:1], progress=False)
    losses = summary["online"]["losses"]
    assert len(losses) == 4 and losses[-1] < 0.9 * losses[0], losses  # same run each time: the loss must drop
    _, partial = D.train_disca(calib, [base], tmp_path / "b", cfg, runs=runs[:1], progress=False, stop_after=5)
    assert partial["online"]["iterations"] == 2  # 3 offline + 2 closed-loop iterations, then "interrupted"
    resumed, _ = D.train_disca(calib, [base], tmp_path / "b", cfg, runs=runs[:1], progress=False, resume=True)
    a, b = pred.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_forecasts_replay_deterministically_through_files_and_exported_plans(setup, tmp_path):
    calib, template, base, runs, data = setup
    cfg = D.DisCaConfig(iterations=10, hidden=16, online_iterations=0)
    pred, summary = D.train_predictor(data, tmp_path, cfg, progress=False)
    plan = D.disca_plan(base, pred, summary)
    path = plan.save(tmp_path / "p.plan.json")
    first = run_plan(calib, plan)
    assert torch.equal(first, run_plan(calib, plan))
    assert torch.equal(first, run_plan(calib, Plan.load(path)))
    handle = dcache.apply(calib.pipe, str(path), count_flops=False)
    try:
        with torch.no_grad():
            assert torch.equal(first, calib.generate().float())
        exported = handle.plan()  # the recorded run carries the predictor along
    finally:
        handle.remove()
    assert exported.extras["forecaster"]["sha256"] == plan.extras["forecaster"]["sha256"]
    assert torch.equal(first, run_plan(calib, exported))


def test_choose_predictor_keeps_taylor_unless_a_candidate_beats_it_on_validation(setup, tmp_path):
    calib, template, base, runs, data = setup
    cfg = D.DisCaConfig(iterations=0, hidden=16, online_iterations=0)
    zero, _ = D.train_predictor(data, tmp_path, cfg, progress=False)  # exactly Taylor: a tie goes to Taylor
    broken = copy.deepcopy(zero)
    with torch.no_grad():
        for net in broken.nets.values():
            net.out.weight.normal_(0.0, 5.0)  # a wild correction on every forecast
    name, scores = D.choose_predictor(calib, base, {"taylor": None, "zero": zero, "broken": broken})
    # zero == Taylor up to the order of the residual sums (per-list units vs the merged run, Schedule.segment_runs)
    assert name == "taylor" and abs(scores["zero"] - scores["taylor"]) < 1e-3
    assert scores["broken"] < scores["taylor"] - 3.0


def _damaged(plan: Plan, **spec_changes) -> dict:
    d = copy.deepcopy(plan.to_dict())
    d["extras"]["forecaster"].update(spec_changes)
    return d


def test_bad_or_mismatched_predictors_are_rejected(setup, tmp_path):
    calib, template, base, runs, data = setup
    cfg = D.DisCaConfig(iterations=2, hidden=16, online_iterations=0)
    pred, summary = D.train_predictor(data, tmp_path, cfg, progress=False)
    plan = D.disca_plan(base, pred, summary)
    weights = plan.extras["forecaster"]["weights"]
    flipped = weights[:100] + ("A" if weights[100] != "A" else "B") + weights[101:]
    other = base64.b64encode(b"not safetensors").decode()
    cases = [
        (_damaged(plan, weights=flipped), "damaged or was edited"),
        (_damaged(plan, weights="%%%"), "not valid base64"),
        (_damaged(plan, version=99), "format version 99"),
        (_damaged(plan, model_class="SD3Transformer2DModel"), "trained for model_class"),
        (_damaged(plan, units=["b0", "b1"]), "trained for units"),
        (_damaged(plan, name="dysca"), "not registered. Did you mean 'disca'"),
        (_damaged(plan, weights=other, sha256=__import__("hashlib").sha256(b"not safetensors").hexdigest()),
         "do not fit its own description"),
        (_damaged(plan, streams={"seg0.0": 64}), "do not fit its own description"),
    ]
    for i, (data_dict, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.plan.json"
        path.write_text(json.dumps(data_dict))
        with pytest.raises(PlanError, match=message):
            dcache.apply(calib.pipe, str(path))
        assert getattr(calib.pipe.transformer, "_dcache_engine", None) is None  # nothing left installed
    wrong_order = copy.deepcopy(plan.to_dict())
    wrong_order["forecast_order"] = 2
    wrong = Plan.from_dict(wrong_order)  # the plan itself is valid ...
    with pytest.raises(PlanError, match="forecast_order=2"):
        dcache.apply(calib.pipe, wrong)  # ... but its predictor reads order-1 tables
    with pytest.raises(ValueError, match="nothing to forecast"):
        D.build_samples([], [], [template.plan(Granularity.STACK, ["C"] * STEPS, method="all")], order=1)


def test_cli_search_disca_writes_plans_that_dcache_apply_uses(tiny_pipe, tmp_path):
    from dcache.pipelines.search_cli import run_search

    front = run_search("disca", tiny_pipe, True, budget="0.5", out=str(tmp_path), steps=STEPS, prompts="1,7",
                       iterations=8, online_iterations=2, progress=False, train_seeds=1)
    assert [p["plan"] for p in front["points"]] == ["plans/disca-dp-K3.plan.json"]
    assert front["points"][0]["compute_ratio"] == pytest.approx(0.5)
    assert front["evaluated"][0]["name"] == "taylor1-dp-K3"
    assert front["evaluated"][0]["compute_ratio"] == front["points"][0]["compute_ratio"]  # equal compute
    plan = Plan.load(tmp_path / "plans" / "disca-dp-K3.plan.json")
    assert plan.extras["forecaster"]["name"] == "disca" and plan.forecast_order == 1
    assert (tmp_path / D.CHECKPOINT).is_file() and "Taylor twins" in (tmp_path / "summary.md").read_text()
    with dcache.apply(tiny_pipe, plan, count_flops=False) as handle:
        tiny_pipe(labels=[2], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(5), output_type="pt")
        assert handle.stats() is not None
