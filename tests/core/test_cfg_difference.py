"""Forecasting the CFG difference (dcache.runtime.cfg_difference) against an analytic toy in call scope.

The toy's output is v = x + t^3 + e t with e = mean(encoder_hidden_states): the cond branch (e = 1) and the uncond
branch (e = 0) share x, so Delta = v - x = t^3 + e t and the CFG difference D = Delta_c - Delta_u = t is linear in
the step (t = 1 - step / N). A first-order forecast of D is therefore exact, while a first-order forecast of the
uncond branch's own Delta (cubic in t) is not.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.cache_utils import CacheMixin
from torch import nn

import dcache
from dcache import Plan
from dcache.model.adapters import HIDDEN, Adapter, BlockList, register_adapter
from dcache.generations.health import DCacheHealthWarning

N = 8


class CfgToyBlock(nn.Module):
    def forward(self, hidden_states, encoder_hidden_states, temb):
        e = encoder_hidden_states.mean(dim=(1, 2))[:, None, None]
        t = temb[:, None, None]
        return hidden_states + t ** 3 + e * t


class CfgToy(nn.Module, CacheMixin):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CfgToyBlock()])

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        temb = timestep.to(hidden_states.dtype).expand(hidden_states.shape[0])
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, temb)
        return hidden_states


register_adapter(Adapter(model_class="CfgToy", block_lists=(BlockList("blocks", encoder=None, outputs=(HIDDEN,)),),
                         modules=()), overwrite=True)


def run(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """N steps of split CFG: (v_cond, v_uncond) per step, the latent moving as a sampler would move it."""
    x = torch.randn(1, 4, 3, generator=torch.Generator().manual_seed(0))
    cond, uncond = torch.ones(1, 2, 3), torch.zeros(1, 2, 3)
    outs = []
    for i in range(N):
        t = torch.tensor([1.0 - i / N])
        with model.cache_context("cond"):
            vc = model(hidden_states=x, encoder_hidden_states=cond, timestep=t)
        with model.cache_context("uncond"):
            vu = model(hidden_states=x, encoder_hidden_states=uncond, timestep=t)
        outs.append((vc.clone(), vu.clone()))
        x = x - 0.1 * (vu + 2.0 * (vc - vu))  # guidance 2
    return outs


def fractions(steps):
    return tuple(s / (N - 1) for s in steps)


COND_STEPS, UNCOND_STEPS = (0, 2, 4, 6, 7), (0, 2, 4, 6)  # the uncond branch one keyframe short, as keyframe-5x


def keyframes(**kw):
    return dict(keyframes=fractions(COND_STEPS), uncond_keyframes=fractions(UNCOND_STEPS), order=1, scope="call",
                num_steps=N, **kw)


def test_all_compute_is_bit_identical_with_cfg_difference():
    model = CfgToy()
    reference = run(model)
    every = fractions(range(N))
    with dcache.apply(model, "keyframe", keyframes=every, order=1, scope="call", num_steps=N, cfg_difference=True):
        cached = run(model)
    for (rc, ru), (cc, cu) in zip(reference, cached):
        assert torch.equal(rc, cc) and torch.equal(ru, cu)


def test_the_uncond_call_between_its_keyframes_is_exact_when_the_difference_is_linear():
    model = CfgToy()
    with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True)) as handle:
        coupled = run(model)
        plan = handle.plan()
    with dcache.apply(model, "keyframe", **keyframes()):
        separate = run(model)
    # Step 7: cond computes, uncond does not. Its exact value on the cached run's own latent x_7:
    # v_u = x_7 + t^3 (e = 0), and v_c = x_7 + t^3 + t is computed exactly.
    t = 1.0 - 7 / N
    vc, vu = coupled[7]
    x7 = vc - (t ** 3 + t)
    torch.testing.assert_close(vu, x7 + t ** 3, rtol=0, atol=1e-6)
    vc_sep, vu_sep = separate[7]
    x7_sep = vc_sep - (t ** 3 + t)
    assert float((vu_sep - (x7_sep + t ** 3)).abs().max()) > 1e-3  # its own first-order forecast is not exact
    # The plan records the coupling and replays it call for call.
    assert plan.extras.get("cfg_difference") is True
    with dcache.apply(model, Plan.from_dict(plan.to_dict()), num_steps=N):
        replayed = run(model)
    for (a, b), (c, d) in zip(coupled, replayed):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_the_cond_branch_is_served_the_same_with_and_without_the_coupling():
    model = CfgToy()
    with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True)):
        coupled = run(model)
    with dcache.apply(model, "keyframe", **keyframes()):
        separate = run(model)
    # Up to step 1 the trajectories agree (uncond at step 1 differs, and moves x from step 2 on).
    assert torch.equal(coupled[0][0], separate[0][0]) and torch.equal(coupled[1][0], separate[1][0])


def test_block_scope_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="needs scope='call'"):
        dcache.apply(CfgToy(), "keyframe", keyframes=(0.0, 1.0), order=1, num_steps=N, cfg_difference=True)


class CurvedDifferenceBlock(nn.Module):
    """Delta_u = t (a first-order forecast of the uncond branch is exact), Delta_c = t + e * 8 (t - 1/2)^2: the CFG
    difference bends, so its first-order forecast is not exact while the uncond branch's own one is."""

    def forward(self, hidden_states, encoder_hidden_states, temb):
        e = encoder_hidden_states.mean(dim=(1, 2))[:, None, None]
        t = temb[:, None, None]
        return hidden_states + t + e * 8 * (t - 0.5) ** 2


def test_a_difference_measured_worse_than_the_own_caches_is_not_served_and_is_said():
    model = CfgToy()
    model.blocks = nn.ModuleList([CurvedDifferenceBlock()])
    with dcache.apply(model, "keyframe", **keyframes()):
        separate = run(model)
    with pytest.warns(DCacheHealthWarning, match="cfg_difference measured worse"):
        with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True)) as handle:
            coupled = run(model)
    assert "cfg_difference_fallback" in handle.stats().health["notes"]
    for (a, b), (c, d) in zip(separate, coupled):  # served from the own caches: the same run, bit for bit
        assert torch.equal(a, c) and torch.equal(b, d)
    vc, vu = coupled[7]  # step 7: cond computes, uncond is its own first-order forecast, exact: v_u - v_c = -D
    t = 1.0 - 7 / N
    torch.testing.assert_close(vu - vc, torch.full_like(vu, -8 * (t - 0.5) ** 2), rtol=0, atol=1e-5)


def test_the_difference_on_a_pipeline_without_split_branches_says_it_does_nothing():
    model = CfgToy()
    x, cond = torch.randn(2, 4, 3), torch.ones(2, 2, 3)
    with pytest.warns(DCacheHealthWarning, match="cfg_difference=True has no effect"):
        with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True)) as handle:
            for i in range(N):  # batched CFG: one call, no cache_context names
                model(hidden_states=x, encoder_hidden_states=cond, timestep=torch.tensor([1.0 - i / N]))
    assert "cfg_difference_no_branches" in handle.stats().health["notes"]


def test_the_difference_without_guidance_says_it_does_nothing():
    # guidance off: diffusers pipelines still name the one call per step "cond", and no "uncond" call ever runs
    model = CfgToy()
    x, cond = torch.randn(1, 4, 3), torch.ones(1, 2, 3)
    with pytest.warns(DCacheHealthWarning, match="cfg_difference=True has no effect"):
        with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True)) as handle:
            for i in range(N):
                with model.cache_context("cond"):
                    model(hidden_states=x, encoder_hidden_states=cond, timestep=torch.tensor([1.0 - i / N]))
    assert "cfg_difference_no_branches" in handle.stats().health["notes"]
    with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True)) as handle:  # split CFG: nothing said
        run(model)
    assert "cfg_difference_no_branches" not in handle.stats().health["notes"]


def test_a_difference_that_cannot_be_checked_is_not_served_and_is_said():
    # the uncond keyframes share no computed step with the cond ones after step 0: no evidence, own caches
    model = CfgToy()
    disjoint = dict(keyframes=fractions(COND_STEPS), uncond_keyframes=fractions((0, 3, 5)), order=1, scope="call",
                    num_steps=N)
    with dcache.apply(model, "keyframe", **disjoint):
        separate = run(model)
    with pytest.warns(DCacheHealthWarning, match="could not check"):
        with dcache.apply(model, "keyframe", **disjoint, cfg_difference=True) as handle:
            coupled = run(model)
    assert "cfg_difference_unchecked" in handle.stats().health["notes"]
    for (a, b), (c, d) in zip(separate, coupled):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_a_difference_first_checked_late_is_served_after_its_check_and_not_called_unchecked():
    # the uncond branch shares its second keyframe with the cond one only at step 6 of 8: its calls before that are
    # served from its own cache (no evidence yet), the check at step 6 finds the difference better (D is linear in
    # t here), step 7 is served through it, and nothing says the difference could not be checked
    model = CfgToy()
    late = dict(keyframes=fractions(COND_STEPS), uncond_keyframes=fractions((0, 6)), order=1, scope="call",
                num_steps=N)
    with dcache.apply(model, "keyframe", **late):
        separate = run(model)
    with dcache.apply(model, "keyframe", **late, cfg_difference=True) as handle:
        coupled = run(model)
    assert "cfg_difference_unchecked" not in handle.stats().health["notes"]
    for i in range(7):
        assert torch.equal(separate[i][1], coupled[i][1]), i
    assert not torch.equal(separate[7][1], coupled[7][1])


class CubicDifferenceBlock(nn.Module):
    """Delta_u = t, Delta_c = t + e (t + 1)^3: the CFG difference D = (t + 1)^3 (times ones) is no polynomial of
    first order in the step, but D(t) = ((t + 1) / (s + 1))^3 D(s) is linear in its history with one scalar weight,
    which L2P's difference table finds; one weight shared by both branches fits neither ratio exactly."""

    def forward(self, hidden_states, encoder_hidden_states, temb):
        e = encoder_hidden_states.mean(dim=(1, 2))[:, None, None]
        t = temb[:, None, None]
        return hidden_states + t + e * (t + 1) ** 3


def test_an_l2p_difference_table_forecasts_the_difference_it_was_fitted_on():
    from dcache.schedules.tuning.l2p_fit import fit_l2p

    model = CfgToy()
    model.blocks = nn.ModuleList([CubicDifferenceBlock()])
    spec = fit_l2p(model, [lambda: run(model)], "keyframe", **{k: v for k, v in keyframes().items() if k != "scope"},
                   window=1, ridge=0.0, progress=False)
    t6, t7 = 1.0 - 6 / N, 1.0 - 7 / N
    assert spec["difference_weights"]["7|6"] == pytest.approx([((t7 + 1) / (t6 + 1)) ** 3], rel=1e-9)
    with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True, forecaster=spec)) as handle:
        coupled = run(model)
    assert "cfg_difference_fallback" not in handle.stats().health["notes"]  # measured better than the own table
    vc, vu = coupled[7]  # step 7: cond computes; uncond = Delta_c - D^ with D^ the table's exact forecast
    torch.testing.assert_close(vu, vc - (t7 + 1) ** 3, rtol=0, atol=1e-5)
    without = {k: v for k, v in spec.items() if k != "difference_weights"}  # D forecast by Taylor order 1
    with dcache.apply(model, "keyframe", **keyframes(cfg_difference=True, forecaster=without)):
        vc, vu = run(model)[7]
    assert float((vu - (vc - (t7 + 1) ** 3)).abs().max()) > 1e-3
