"""L2C / HarmoniCa routers on the tiny model: backbone frozen, training resumable, training uses the cache that the
exported plan uses at inference, thresholded plans replay."""

import pytest
import torch

from dcache.plans.plan import Plan
from dcache.schedules.tuning.search import make_template, run_plan
from dcache.schedules.tuning.search.router import (RouterConfig, _Router, _train_generation, hard_rows, router_search,
                                                   threshold_for, train_routers)


@pytest.mark.parametrize("objective", ["harmonica", "l2c"])
def test_router_resume_matches_uninterrupted_and_backbone_is_frozen(calib, tmp_path, objective):
    template = make_template(calib)
    before = {k: v.clone() for k, v in calib.pipe.transformer.state_dict().items()}
    cfg = RouterConfig(objective=objective, iterations=4, lambda_every=1, target_ratios=(0.8, 0.6))
    straight = train_routers(calib, tmp_path / "a", cfg, template=template, progress=False)
    for stop in (1, 3):  # inside the first target, then inside the second (warm-started from the first)
        train_routers(calib, tmp_path / "b", cfg, template=template, progress=False, stop_after=stop, resume=True)
    resumed = train_routers(calib, tmp_path / "b", cfg, template=template, progress=False, resume=True)
    assert straight.keys() == resumed.keys() == {0.8, 0.6}
    for target in straight:
        assert torch.equal(straight[target], resumed[target])
        assert not torch.equal(straight[target][1:], torch.full_like(straight[target][1:], cfg.init))  # it trained
        assert (straight[target][0] == 5.0).all()
    assert not torch.equal(straight[0.8], straight[0.6])  # one router per target
    after = calib.pipe.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.requires_grad for p in calib.pipe.transformer.parameters())  # restored for the caller
    with pytest.raises(ValueError, match="another config"):
        train_routers(calib, tmp_path / "b", RouterConfig(objective=objective, iterations=5), template=template,
                      progress=False, resume=True)


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_training_generation_is_the_exported_plan(calib, threshold):
    """The old trainer refreshed a unit's cache whenever its score passed a fixed 0.5 while the exported plan used
    another threshold (and L2C refreshed it at every step): training saw caches at most one step old where the
    plan reuses outputs many steps old (26 dB held-out at 0.5 where ECAD reaches 44 dB). With the hard forward
    (blend="ste") a HarmoniCa training generation must *be* the exported plan's generation."""
    template = make_template(calib)
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(template.num_steps, len(template.module_units), generator=g) * 2.0 - 0.5
    theta[0] = 5.0
    rows = hard_rows(theta, threshold, template)
    assert 0 < sum(r.count("R") for r in rows) < sum(len(r) for r in rows[1:])  # a real mix of reuse and compute
    cfg = RouterConfig(objective="harmonica", blend="ste", threshold=threshold)
    frozen = [p for p in calib.pipe.transformer.parameters()]
    for p in frozen:
        p.requires_grad_(False)
    router = _Router(calib.pipe, template, theta.clone().requires_grad_(True), cfg)
    try:
        calib.reference()
        _, images = _train_generation(calib, router, torch.ones(template.num_steps), 1e-3, cfg)
    finally:
        router.remove()
        for p in frozen:
            p.requires_grad_(True)
    planned = run_plan(calib, template.plan("module", rows, method="t"))
    assert (images - planned).abs().max().item() <= 1e-5
    assert (planned - calib.reference()).abs().max().item() > 1e-3  # the plan does reuse something visible
    assert router.theta.grad is not None and router.theta.grad[1:].abs().sum() > 0


def test_router_thresholds_meet_targets_and_plans_replay(calib, tmp_path):
    template = make_template(calib)
    theta = torch.linspace(-3, 3, template.num_steps * len(template.module_units)).reshape(template.num_steps, -1)
    for target in (0.9, 0.7, 0.6):
        plan = template.plan("module", hard_rows(theta, threshold_for(theta, template, target)), method="t")
        assert template.compute_ratio(plan) <= target + 1e-9
        assert plan.actions["cond"][0] == "C" * len(template.module_units)
    front = router_search(calib, tmp_path, RouterConfig(objective="l2c", iterations=1, target_ratios=(0.7,)),
                          template=template, progress=False)
    p = front["points"][0]
    plan = Plan.load(tmp_path / p["plan"])
    assert p["compute_ratio"] <= 0.7 + 1e-9
    assert torch.equal(run_plan(calib, plan), run_plan(calib, plan))
    assert calib.quality_fn(run_plan(calib, plan), calib.reference()) == pytest.approx(p["quality"])
