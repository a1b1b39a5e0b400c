"""Engine mechanics on analytic toy blocks: exactly known results for compute, reuse and forecast."""

from __future__ import annotations

import pytest
import torch
import toy_models as toy

import dcache
from dcache import Plan


def make_plan(rows, granularity="stack", units=("stack",), probe=0, tail=0, order=0, branches=("call0",)):
    return Plan(model_class="ToyTransformer", block_layout=[3, 3], granularity=granularity, units=list(units),
                num_steps=len(rows), actions={b: list(rows) for b in branches}, probe_blocks=probe,
                tail_blocks=tail, forecast_order=order)


def closed_form(hidden, t, joint, single):
    h = hidden
    for a in joint:
        h = toy.toy_block_step(h, a, t)
    for a in single:
        h = toy.toy_single_step(h, a, t)
    return h


def run(model, num_steps, **kw):
    with torch.no_grad():
        return [model(**toy.toy_inputs(s, num_steps, **kw)) for s in range(num_steps)]


JOINT, SINGLE = (0.1, 0.2, 0.3), (0.05, -0.1, 0.15)


def test_uncached_toy_matches_closed_form():
    model = toy.ToyTransformer(JOINT, SINGLE)
    for s, out in enumerate(run(model, 4)):
        inp = toy.toy_inputs(s, 4)
        expected = closed_form(inp["hidden_states"], 1 - s / 4, JOINT, SINGLE)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_stack_reuse_skips_middle_blocks_and_adds_the_cached_segment_residuals():
    model = toy.ToyTransformer(JOINT, SINGLE)
    plan = make_plan(["C", "R", "R", "C"], probe=1, tail=1)
    with dcache.apply(model, plan, num_steps=4) as handle:
        outs = run(model, 4)
    calls = [b.calls for b in model.blocks()]
    assert calls == [4, 2, 2, 2, 2, 4], calls  # probe and tail every step; the middle only on computed steps
    # Step 1 reuses the segment residuals measured at step 0 (per block list: joint[1:3], single[0:2]).
    h0, h1 = toy.toy_inputs(0, 4)["hidden_states"], toy.toy_inputs(1, 4)["hidden_states"]
    t0, t1 = 1.0, 0.75
    a = toy.toy_block_step(h0, JOINT[0], t0)
    joint_res0 = closed_form(a, t0, JOINT[1:], ()) - a
    b = closed_form(h0, t0, JOINT, ())
    single_res0 = closed_form(b, t0, (), SINGLE[:2]) - b
    x = toy.toy_block_step(h1, JOINT[0], t1) + joint_res0 + single_res0
    expected = toy.toy_single_step(x, SINGLE[2], t1)
    torch.testing.assert_close(outs[1], expected, rtol=1e-6, atol=1e-6)
    stats = handle.stats()
    assert stats.units_reused == 2 and stats.units_computed == 2
    ideal = stats.ideal_speedup  # FLOP arithmetic, not a timing
    assert 1.0 < ideal < 6 / 2  # probe + tail always run: at most 6 blocks / 2 per reused step


def test_block_reuse_applies_each_blocks_own_residual():
    model = toy.ToyTransformer(JOINT, SINGLE)
    rows = ["CCCCCC", "CRCCRC", "CCCCCC"]
    plan = make_plan(rows, granularity="block", units=[f"b{i}" for i in range(6)])
    with dcache.apply(model, plan, num_steps=3):
        outs = run(model, 3)
    assert [b.calls for b in model.blocks()] == [3, 2, 3, 3, 2, 3]
    h0, h1 = toy.toy_inputs(0, 3)["hidden_states"], toy.toy_inputs(1, 3)["hidden_states"]
    t0, t1 = 1.0, 2 / 3
    # Residual of block 1 and single block 1 as computed at step 0.
    a0 = toy.toy_block_step(h0, JOINT[0], t0)
    r_b1 = toy.toy_block_step(a0, JOINT[1], t0) - a0
    s_in0 = toy.toy_single_step(closed_form(h0, t0, JOINT, ()), SINGLE[0], t0)
    r_s1 = toy.toy_single_step(s_in0, SINGLE[1], t0) - s_in0
    x = toy.toy_block_step(h1, JOINT[0], t1) + r_b1
    x = toy.toy_block_step(x, JOINT[2], t1)
    x = toy.toy_single_step(x, SINGLE[0], t1) + r_s1
    expected = toy.toy_single_step(x, SINGLE[2], t1)
    torch.testing.assert_close(outs[1], expected, rtol=1e-6, atol=1e-6)


def test_module_reuse_returns_the_cached_module_output():
    model = toy.ToyTransformer(JOINT, SINGLE)
    units = [f"b{i}.{m}" for i in range(6) for m in ("attn", "ff")]
    rows = ["C" * 12, "RC" + "C" * 10]  # block 0: attention reused, feed-forward computed
    plan = make_plan(rows, granularity="module", units=units)
    with dcache.apply(model, plan, num_steps=2):
        outs = run(model, 2)
    blk = model.joint_blocks[0]
    assert (blk.attn.calls, blk.ff.calls, blk.calls) == (1, 2, 2)
    h0, h1 = toy.toy_inputs(0, 2)["hidden_states"], toy.toy_inputs(1, 2)["hidden_states"]
    first = h1 + JOINT[0] * 1.0 * h0 + 0.5 * JOINT[0] * 0.5  # attn(h0, t0) reused, ff(., t1) fresh
    expected = closed_form(first, 0.5, JOINT[1:], SINGLE)
    torch.testing.assert_close(outs[1], expected, rtol=1e-6, atol=1e-6)


def test_first_order_forecast_is_exact_on_a_residual_linear_in_the_step():
    # With constant input, each block's residual is affine in t (the residual of the shift-only model is exactly
    # linear), so an order-1 Taylor forecast from steps 0 and 1 predicts step 3 exactly.
    model = toy.ToyTransformer(joint=(0.0, 0.0, 0.0), single=(0.0, 0.0, 0.0))
    for blk in model.blocks():
        blk.ff.b = 0.7
    plan = make_plan(["C", "C", "F", "F"], order=1)
    with dcache.apply(model, plan, num_steps=4):
        with torch.no_grad():
            outs = [model(**{**toy.toy_inputs(0, 4), "timestep": torch.tensor([1.0 - s / 4])}) for s in range(4)]
    ref_model = toy.ToyTransformer(joint=(0.0, 0.0, 0.0), single=(0.0, 0.0, 0.0))
    for blk in ref_model.blocks():
        blk.ff.b = 0.7
    with torch.no_grad():
        refs = [ref_model(**{**toy.toy_inputs(0, 4), "timestep": torch.tensor([1.0 - s / 4])}) for s in range(4)]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_branches_keep_separate_caches_by_call_order():
    model = toy.ToyTransformer(JOINT, SINGLE)
    plan = make_plan(["C", "R"], branches=("call0", "call1"))
    outs = {}
    with dcache.apply(model, plan, num_steps=2) as handle:
        with torch.no_grad():
            for s in range(2):
                for branch, seed in (("call0", 0), ("call1", 1)):
                    outs[(s, branch)] = model(**toy.toy_inputs(s, 2, seed=seed, scale=1 + seed))
    assert handle.stats().branches == ["call0", "call1"]
    for branch, seed in (("call0", 0), ("call1", 1)):
        h0 = toy.toy_inputs(0, 2, seed=seed, scale=1 + seed)["hidden_states"]
        h1 = toy.toy_inputs(1, 2, seed=seed, scale=1 + seed)["hidden_states"]
        residual0 = closed_form(h0, 1.0, JOINT, SINGLE) - h0
        torch.testing.assert_close(outs[(1, branch)], h1 + residual0, rtol=1e-5, atol=1e-5)


def test_cache_context_names_the_branches():
    model = toy.ToyTransformer(JOINT, SINGLE)
    handle = dcache.apply(model, make_plan(["C", "C"], branches=("cond", "uncond")), num_steps=2)
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    with torch.no_grad():
        for s in range(2):
            for name in ("cond", "uncond"):
                _set_cache_context(model, CacheContext(name))
                model(**toy.toy_inputs(s, 2))
                _set_cache_context(model, None)
    assert handle.stats().branches == ["cond", "uncond"]
    handle.remove()


def test_transformer_only_use_starts_a_new_generation_when_time_goes_back_up():
    model = toy.ToyTransformer(JOINT, SINGLE)
    handle = dcache.apply(model, "fbcache", threshold=0.0)
    run(model, 5)
    run(model, 5)
    stats = handle.stats()
    assert stats.generations == 2 and stats.calls == 5 and stats.num_steps is None
    handle.remove()


def test_reuse_without_a_cache_is_forced_to_compute_and_recorded_so():
    model = toy.ToyTransformer(JOINT, SINGLE)

    class AlwaysReuse(dcache.Schedule):
        def decide(self, ctx):
            return dcache.Action.REUSE

    with dcache.apply(model, AlwaysReuse(), num_steps=3) as handle:
        run(model, 3)
    assert [row["call0"] for row in handle.stats().per_step] == ["C", "R", "R"]


def test_remove_restores_the_forward_and_a_removed_handle_says_so():
    model = toy.ToyTransformer(JOINT, SINGLE)
    ref = run(model, 3)
    handle = dcache.apply(model, make_plan(["C", "R", "R"]), num_steps=3)
    with pytest.raises(RuntimeError, match="already applied"):
        dcache.apply(model, "fbcache")
    handle.remove()
    with pytest.raises(RuntimeError, match="already removed"):
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(ref, run(model, 3)))
    assert not hasattr(model, "_dcache_engine")
