"""L2C / HarmoniCa routers on the tiny model: backbone frozen, training resumable, thresholded plans replay."""

import pytest
import torch

from dcache.plan import Plan
from dcache.schedules.search import make_template, run_plan
from dcache.schedules.search.router import RouterConfig, router_search, threshold_for, router_rows, train_router


@pytest.mark.parametrize("objective", ["harmonica", "l2c"])
def test_router_resume_matches_uninterrupted_and_backbone_is_frozen(calib, tmp_path, objective):
    template = make_template(calib)
    before = {k: v.clone() for k, v in calib.pipe.transformer.state_dict().items()}
    cfg = RouterConfig(objective=objective, iterations=2, lambda_every=1)
    straight = train_router(calib, tmp_path / "a", cfg, template=template, progress=False)
    train_router(calib, tmp_path / "b", cfg, template=template, progress=False, stop_after=1)
    resumed = train_router(calib, tmp_path / "b", cfg, template=template, progress=False, resume=True)
    assert torch.equal(straight, resumed)
    assert not torch.equal(straight[1:], torch.full_like(straight[1:], cfg.init))  # it trained
    assert (straight[0] == 5.0).all()
    after = calib.pipe.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.requires_grad for p in calib.pipe.transformer.parameters())  # restored for the caller


def test_router_thresholds_meet_targets_and_plans_replay(calib, tmp_path):
    template = make_template(calib)
    theta = torch.linspace(-3, 3, template.num_steps * len(template.module_units)).reshape(template.num_steps, -1)
    for target in (0.9, 0.7, 0.6):
        plan = template.plan("module", router_rows(theta, threshold_for(theta, template, target)), method="t")
        assert template.compute_ratio(plan) <= target + 1e-9
        assert plan.actions["cond"][0] == "C" * len(template.module_units)
    front = router_search(calib, tmp_path, RouterConfig(objective="l2c", iterations=1, target_ratios=(0.7,)),
                          template=template, progress=False)
    p = front["points"][0]
    plan = Plan.load(tmp_path / p["plan"])
    assert p["compute_ratio"] <= 0.7 + 1e-9
    assert torch.equal(run_plan(calib, plan), run_plan(calib, plan))
    assert calib.quality_fn(run_plan(calib, plan), calib.reference()) == pytest.approx(p["quality"])
