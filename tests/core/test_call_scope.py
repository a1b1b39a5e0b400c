"""Call scope (dcache.runtime.call_scope): the whole transformer call x -> v is computed or replaced by x + Delta.

References: the uncached model itself (an all-compute generation is bit-identical), and the closed form of a
replaced call, v_t = x_t + (v_c - x_c) for REUSE and the Taylor forecast of Delta for FORECAST, built here from the
uncached outputs. A replaced call must run nothing of the transformer (no embedder, no block)."""

from __future__ import annotations

import pytest
import torch
import zoo as zoo_module

import dcache
from dcache import Action, Granularity, Schedule
from dcache.pipelines.bundled import load_tiny_pipeline


ZOO = zoo_module.ZOO
LABELS = [0, 3, 7]
STEPS = 10


class Rows(Schedule):
    """Fixed stack decisions per step (the same for every branch)."""

    def __init__(self, rows: str, order: int = 0):
        self.rows, self.forecast_order, self.name = rows, order, "rows"

    def decide(self, ctx):
        return self.rows[ctx.step]


class AllCompute(Schedule):
    def decide(self, ctx):
        return Action.COMPUTE


def _sample(out):
    if isinstance(out, torch.Tensor):  # e.g. Kandinsky 5 returns the tensor itself
        return out
    return out[0] if isinstance(out, (tuple, list)) else out.sample


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def generate(pipe, steps=STEPS, **kw):
    return pipe(labels=LABELS, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                output_type="pt", **kw).images


class Calls:
    """Records every `_velocity` call of the tiny pipeline: (branch label tensor, x, v)."""

    def __init__(self, pipe):
        self.pipe, self.calls = pipe, []

    def __enter__(self):
        inner = type(self.pipe)._velocity

        def velocity(x, labels, *args):
            v = inner(self.pipe, x, labels, *args)
            self.calls.append((labels.clone(), x.clone(), v.clone()))
            return v

        self.pipe._velocity = velocity
        return self.calls

    def __exit__(self, *exc):
        del self.pipe._velocity


def test_all_compute_in_call_scope_is_bit_identical(pipe):
    reference = generate(pipe)
    with dcache.apply(pipe, AllCompute(), scope="call") as handle:
        assert torch.equal(generate(pipe), reference)
    assert handle.stats().compute_ratio == 1.0


@pytest.mark.parametrize("name", ["flux", "wan", "sd3"])
def test_reuse_and_forecast_are_x_plus_delta_and_run_nothing(name):
    """Steps C C R F with order 1: v_2 = x_2 + D_1, v_3 = x_3 + D_1 + 2 (D_1 - D_0), D = v - x (uncached v)."""
    torch.manual_seed(0)
    entry = ZOO[name]
    model = entry.make_model()
    inputs = [entry.make_inputs(step) for step in range(4)]
    with torch.no_grad():
        v = [_sample(model(**kw, return_dict=False)) for kw in inputs[:2]]
        d0, d1 = (v[i] - inputs[i]["hidden_states"] for i in range(2))
        counted = []
        first_block = dcache.adapter_for(model).blocks(model)[0][1]
        hooks = [first_block.register_forward_pre_hook(lambda *a: counted.append(1))]
        with dcache.apply(model, Rows("CCRF", order=1), num_steps=4, scope="call") as handle:
            outs = [_sample(model(**kw, return_dict=False)) for kw in inputs]
        for h in hooks:
            h.remove()
    assert len(counted) == 2  # the block ran in the two computed calls only
    assert torch.equal(outs[0], v[0]) and torch.equal(outs[1], v[1])
    torch.testing.assert_close(outs[2], inputs[2]["hidden_states"] + d1, rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[3], inputs[3]["hidden_states"] + d1 + 2 * (d1 - d0), rtol=0, atol=1e-5)
    stats = handle.stats()
    assert stats.calls == 4 and stats.units_reused == 1 and stats.units_forecast == 1
    assert stats.compute_ratio == pytest.approx(0.5)  # every call costs the same block FLOPs


def test_return_dict_output_is_rebuilt_in_the_model_output_class():
    entry = ZOO["flux"]
    model = entry.make_model()
    inputs = [entry.make_inputs(step) for step in range(2)]
    with torch.no_grad(), dcache.apply(model, Rows("CR"), num_steps=2, scope="call"):
        outs = [model(**kw) for kw in inputs]
    assert type(outs[1]) is type(outs[0]) and outs[1].sample.shape == outs[0].sample.shape


def test_cfg_branches_keep_their_own_delta(pipe):
    """Split CFG: at a reused step the cond call adds the cond Delta, the uncond call the uncond Delta."""
    with Calls(pipe) as calls, dcache.apply(pipe, Rows("CCR" + "C" * (STEPS - 3)), scope="call"):
        generate(pipe)
    (_, x1, vc1), (_, _, vu1), (_, x2, vc2), (_, _, vu2) = calls[2:6]  # steps 1 and 2, cond then uncond
    torch.testing.assert_close(vc2, x2 + (vc1 - x1), rtol=0, atol=1e-6)
    torch.testing.assert_close(vu2, x2 + (vu1 - x1), rtol=0, atol=1e-6)
    assert (vc2 - vu2).abs().max() > 1e-3  # the branches differ, so sharing a Delta would fail above


def test_a_plan_recorded_in_call_scope_replays_in_it(pipe):
    with dcache.apply(pipe, "seacache-cadence", scope="call") as handle:
        cached = generate(pipe)
        plan = handle.plan()
    assert plan.extras["scope"] == "call"
    with dcache.apply(pipe, plan) as replay:
        assert torch.equal(generate(pipe), cached)
        assert replay.engine.scope == "call"
    with dcache.apply(pipe, plan, scope="blocks") as blocks:
        assert not torch.equal(generate(pipe), cached)
        assert "scope" not in blocks.plan().extras


def test_call_scope_meets_the_ideal_in_block_work(pipe):
    """A replaced call runs no block and no embedder: block calls = computed calls x blocks."""
    runs = []
    hooks = [pipe.transformer.x_embedder.register_forward_hook(lambda *a: runs.append(1))]
    with dcache.apply(pipe, "seacache-cadence", scope="call") as handle:
        generate(pipe, steps=12)
        stats = handle.stats()
    for h in hooks:
        h.remove()
    assert stats.calls_fully_computed < stats.calls
    assert len(runs) == stats.calls_fully_computed


@pytest.mark.parametrize("method, overrides, problem", [
    ("fbcache", {}, "probe_blocks=1"),
    ("teacache", {}, "modulated_rel_l1"),
    ("taylorseer", {}, "granularity is 'module'"),
    ("cg_taylor", {}, "forecast_error"),
])
def test_schedules_that_decide_inside_the_call_are_refused(pipe, method, overrides, problem):
    with pytest.raises(ValueError, match="scope='call' needs a schedule") as info:
        dcache.apply(pipe, method, scope="call", **overrides)
    assert problem in str(info.value) and "scope='blocks'" in str(info.value)
    assert getattr(pipe.transformer, "_dcache_engine", None) is None  # nothing left installed


def test_unknown_scope_is_refused(pipe):
    with pytest.raises(ValueError, match="scope='everything' is not one of"):
        dcache.apply(pipe, "magcache", scope="everything")


# Families whose call cannot be replaced by x + Delta, and the reason the error gives.
REFUSED = {
    "pixart": "must return one tensor shaped like its latent input",  # learned variance: 2C output channels
    "hunyuan_dit": "must return one tensor shaped like its latent input",  # the same
    "ltx2": "must return one tensor shaped like its latent input",  # video and audio outputs
    "z_image": "reads the latent input `hidden_states`",  # per-sample lists, argument `x`
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_family_replays_x_plus_delta_or_is_refused_with_the_reason(name):
    """Every zoo family: computed calls bit-identical to the bare model, a reused call = x + Delta exactly; or, for
    the families listed in REFUSED, a teaching error at the first call and nothing left half-done."""
    torch.manual_seed(0)
    entry = ZOO[name]
    model = entry.make_model()
    inputs = [entry.make_inputs(step) for step in range(3)]
    with torch.no_grad():
        if name in REFUSED:
            with dcache.apply(model, Rows("CRR"), num_steps=3, scope="call"):
                with pytest.raises(ValueError, match=REFUSED[name]) as info:
                    model(**inputs[0], return_dict=False)
                assert "scope='blocks'" in str(info.value) and model._dcache_engine.call is None
            return
        bare = [_sample(model(**kw, return_dict=False)) for kw in inputs[:2]]
        with dcache.apply(model, Rows("CCR"), num_steps=3, scope="call") as handle:
            outs = [_sample(model(**kw, return_dict=False)) for kw in inputs]
    assert torch.equal(outs[0], bare[0]) and torch.equal(outs[1], bare[1])
    expected = inputs[2]["hidden_states"] + (bare[1] - inputs[1]["hidden_states"])
    torch.testing.assert_close(outs[2], expected, rtol=0, atol=1e-6)
    assert handle.stats().units_reused == 1


def test_call_scope_is_stack_granularity_only():
    class ModuleRows(Rows):
        granularity = Granularity.MODULE

    model = ZOO["flux"].make_model()
    with pytest.raises(ValueError, match="granularity is 'module'"):
        dcache.apply(model, ModuleRows("C"), num_steps=1, scope="call")
