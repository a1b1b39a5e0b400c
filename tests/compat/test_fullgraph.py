"""torch.compile of the whole transformer with fullgraph=True, composed with dcache (docs/architecture.md,
"torch.compile").

A schedule that decides from the step alone (plans, fixed_interval, keyframe, FORA, TaylorSeer, MagCache with
calibrated ratios) is decided when the call opens, so the block hooks are plain tensor work that dynamo captures:
the whole forward is one graph per distinct action row. In call scope the decision is outside the compiled forward,
for every schedule. Each case checks, against eager dcache on the same pipeline:

  * fullgraph=True traces (any graph break raises);
  * outputs are bit-identical (backend="eager" replays the same ops), and so are the decisions and the stats;
  * one graph per distinct action row (call scope: one for the computed call, one for x + Delta), and a second
    generation compiles nothing new (no recompile storm).

Compiled on CPU with a counting backend that runs each graph as traced (what backend="eager" does).
"""

from __future__ import annotations

import pytest
import torch
from compat_kit import BLOCK_LAYOUT, NUM_BLOCKS, make_pipeline, seeded
from test_compile import GraphCounter, fresh_dynamo

import dcache
from dcache import Plan

STEPS = 5


def stack_plan() -> Plan:
    """A stack plan with a probe block: REUSE and first-order FORECAST rows."""
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="stack",
                units=["stack"], num_steps=STEPS, actions={"cond": ["C", "C", "R", "F", "C"]}, probe_blocks=1,
                forecast_order=1)


def block_plan() -> Plan:
    """A block plan with REUSE and first-order FORECAST blocks (two distinct rows: one graph each)."""
    rows = ["C" * NUM_BLOCKS, "CRCFC", "CRCFC", "CRCFC", "C" * NUM_BLOCKS]
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="block",
                units=[f"b{i}" for i in range(NUM_BLOCKS)], num_steps=STEPS, actions={"cond": rows},
                forecast_order=1)


def call_plan() -> Plan:
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="stack",
                units=["stack"], num_steps=STEPS, actions={"cond": ["C", "C", "F", "R", "C"]}, forecast_order=1)


# name -> (apply(pipe), guidance_scale): every schedule here decides from the step alone
BLOCK_SCOPE = {
    "fixed_interval": (lambda pipe: dcache.apply(pipe, "fixed_interval", interval=2), 1.0),
    "fixed_interval-forecast-cfg": (lambda pipe: dcache.apply(pipe, "fixed_interval", interval=3, forecast_order=1),
                                    3.0),
    "stack-plan": (lambda pipe: dcache.apply(pipe, stack_plan()), 1.0),
    "block-plan": (lambda pipe: dcache.apply(pipe, block_plan()), 1.0),
    "keyframe-cfg": (lambda pipe: dcache.apply(pipe, "keyframe", keyframes=[0.0, 0.5]), 3.0),
    "fora-block": (lambda pipe: dcache.apply(pipe, "fora", interval=2, granularity="block"), 1.0),
    "fora-module": (lambda pipe: dcache.apply(pipe, "fora", interval=2), 1.0),
    "taylorseer-module-cfg": (lambda pipe: dcache.apply(pipe, "taylorseer", interval=2), 3.0),
    "magcache-calibrated": (lambda pipe: dcache.apply(pipe, "magcache", ratios=(1.0, 0.99, 0.98, 0.97, 0.96),
                                                      threshold=0.1, retention_ratio=0.2), 1.0),
}
CALL_SCOPE = {
    "fixed_interval": (lambda pipe: dcache.apply(pipe, "fixed_interval", interval=2, scope="call"), 1.0),
    "call-plan": (lambda pipe: dcache.apply(pipe, call_plan(), scope="call"), 1.0),
    # reads signals (measured on the latents, eagerly, outside the compiled forward): call scope traces it whole too
    "easycache-cfg": (lambda pipe: dcache.apply(pipe, "easycache", threshold=2.0, scope="call"), 3.0),
}


def generate(pipe, guidance_scale: float):
    return pipe([1, 2], generator=seeded(0), num_inference_steps=STEPS, guidance_scale=guidance_scale)


def eager_run(apply, guidance_scale):
    pipe = make_pipeline()
    handle = apply(pipe)
    out = generate(pipe, guidance_scale)
    plan, stats = handle.plan(), handle.stats()
    handle.remove()
    return out, plan, stats


def compiled_run(apply, guidance_scale):
    counter = GraphCounter()
    with fresh_dynamo(fail_on_recompile_limit_hit=True):
        pipe = make_pipeline()
        handle = apply(pipe)
        pipe.transformer.compile(backend=counter, fullgraph=True)
        out = generate(pipe, guidance_scale)
        plan, stats = handle.plan(), handle.stats()
        warm = len(counter.graphs)
        again = generate(pipe, guidance_scale)
        handle.remove()
    return out, plan, stats, warm, len(counter.graphs), again


def rows(plan: Plan) -> set[str]:
    return {row for branch_rows in plan.actions.values() for row in branch_rows}


def check_against_eager(apply, guidance_scale, graphs_for_rows):
    out, plan, stats = eager_run(apply, guidance_scale)
    c_out, c_plan, c_stats, warm, total, again = compiled_run(apply, guidance_scale)
    assert torch.equal(c_out, out), f"compiled differs from eager dcache by {(c_out - out).abs().max().item():.3g}"
    assert torch.equal(again, out)
    assert c_plan.actions == plan.actions  # the same decisions
    assert c_stats.compute_ratio == pytest.approx(stats.compute_ratio, rel=1e-12)
    assert stats.compute_ratio < 1.0  # the cache reused something
    assert warm <= graphs_for_rows(rows(plan)), f"{warm} graphs for the rows {sorted(rows(plan))}"
    assert total == warm, f"{total - warm} graphs compiled in the second generation"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BLOCK_SCOPE))
def test_fullgraph_block_scope_step_decided(name):
    """Block scope: fullgraph=True traces, one graph per distinct action row, outputs bit-identical to eager."""
    apply, guidance_scale = BLOCK_SCOPE[name]
    check_against_eager(apply, guidance_scale, len)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CALL_SCOPE))
def test_fullgraph_call_scope(name):
    """Call scope: the decision is taken outside the compiled forward (for every schedule); two graphs at most: the
    computed call and the served x + Delta."""
    apply, guidance_scale = CALL_SCOPE[name]
    check_against_eager(apply, guidance_scale, lambda rows: 2)


@pytest.mark.slow
def test_fullgraph_fixed_interval_quick():
    """The quick case of the above: fixed_interval, fullgraph=True, a 3-step generation (rows C, R, C)."""
    graphs = GraphCounter()
    ref = make_pipeline()
    with dcache.apply(ref, "fixed_interval", interval=2):
        want = ref([1], generator=seeded(0), num_inference_steps=3)
    with fresh_dynamo(fail_on_recompile_limit_hit=True):
        pipe = make_pipeline()
        handle = dcache.apply(pipe, "fixed_interval", interval=2)
        pipe.transformer.compile(backend=graphs, fullgraph=True)
        got = pipe([1], generator=seeded(0), num_inference_steps=3)
        assert handle.stats().compute_ratio < 1.0
        handle.remove()
    assert torch.equal(got, want)
    assert len(graphs.graphs) == 2  # the computed row and the reused row


class RunCounter(GraphCounter):
    """Also counts the graphs run (a call runs one per piece between graph breaks)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)

        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run


@pytest.mark.slow
def test_signal_schedule_keeps_its_eager_hooks():
    """A schedule that reads a signal measured inside the call (fbcache: the probe block's residual) decides at a
    block, after a host read: its block hooks stay eager frames (the documented graph breaks: each block's forward a
    graph of its own, at most blocks + 3 graphs run per call). Compiled outputs and decisions are still
    bit-identical to eager dcache, and fullgraph=True refuses it with dynamo's own error."""
    # decisions="batch" on both sides: a traced call takes one decision for its whole batch (per-sample lanes would
    # put a Python loop in the graph; BatchDecisionsWarning), so eager is compared at the same decisions
    pipe = make_pipeline()
    handle = dcache.apply(pipe, "fbcache", threshold=0.5, decisions="batch")
    want = generate(pipe, 3.0)
    plan = handle.plan()
    handle.remove()
    with fresh_dynamo(fail_on_recompile_limit_hit=True):
        pipe = make_pipeline()
        handle = dcache.apply(pipe, "fbcache", threshold=0.5, decisions="batch")
        counter = RunCounter()
        pipe.transformer.compile(backend=counter)
        got = generate(pipe, 3.0)
        calls = sum(len(branch_rows) for branch_rows in plan.actions.values())
        assert torch.equal(got, want) and handle.plan().actions == plan.actions and "R" in "".join(rows(plan))
    assert counter.runs / calls <= NUM_BLOCKS + 3, f"{counter.runs / calls:.2f} graphs per call"
    with fresh_dynamo():
        pipe = make_pipeline()
        dcache.apply(pipe, "fbcache", threshold=0.5)
        pipe.transformer.compile(backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="disable"):
            generate(pipe, 3.0)


@pytest.mark.slow
def test_rows_past_the_recompile_limit_run_eagerly_with_the_same_results():
    """More distinct action rows than dynamo keeps graphs for one frame: the frame runs eagerly past the limit, with
    outputs and stats bit-identical to eager dcache. (The FLOP-counting pass on fake tensors runs the memoised
    modules too; nothing it computed may stay in their memos for the eager calls.)"""
    rows = ["C" * NUM_BLOCKS, "CRCRC", "CCRRC", "CRRRC"]
    plan = Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="block",
                units=[f"b{i}" for i in range(NUM_BLOCKS)], num_steps=4, actions={"cond": rows})
    ref = make_pipeline()
    with dcache.apply(ref, plan) as handle:
        want = ref([1], generator=seeded(0), num_inference_steps=4)
        ratio = handle.stats().compute_ratio
    graphs = GraphCounter()
    with fresh_dynamo(recompile_limit=1):
        pipe = make_pipeline()
        handle = dcache.apply(pipe, plan)
        pipe.transformer.compile(backend=graphs)
        got = pipe([1], generator=seeded(0), num_inference_steps=4)
        assert handle.stats().compute_ratio == ratio
        handle.remove()
    assert len(graphs.graphs) == 1
    assert not isinstance(got, torch._subclasses.FakeTensor) and torch.equal(got, want)
