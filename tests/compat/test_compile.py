"""torch.compile of the transformer (whole model) and of its blocks (regional), composed with dcache.

On CPU the graphs are compiled with a counting backend that runs them eagerly (what backend="eager" does), so the
tests measure what dynamo does -- graphs, recompiles, graph breaks -- not codegen; one inductor case is `long`.

  * outputs of compiled + dcache match eager + dcache (the same decisions, the same numbers);
  * no recompilation storm: a second identical generation compiles nothing new, and dynamo never reaches its
    recompile limit (past it, dynamo silently runs the frame eagerly: the user loses compile without a word);
  * the blocks really run compiled: under a static plan each block's whole op sequence (as the same compile captures
    it without dcache) lands in one graph -- no graph break inside a block, no silent eager fallback.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from compat_kit import BLOCK_LAYOUT, NUM_BLOCKS, make_pipeline, rel_error, seeded

import dcache
from dcache import Plan

STEPS = 4
# backend="eager"-style graphs replay the traced ops; fusion-free, so outputs agree to float32 rounding.
COMPILE_ATOL = 1e-5


def stack_plan() -> Plan:
    rows = ["C", "R", "C", "R"]
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="stack",
                units=["stack"], num_steps=STEPS, actions={"cond": rows}, probe_blocks=1)


def block_plan() -> Plan:
    rows = ["C" * NUM_BLOCKS, "CRCRC", "CCRRC", "CRRRC"]
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="block",
                units=[f"b{i}" for i in range(NUM_BLOCKS)], num_steps=STEPS, actions={"cond": rows})


def call_plan() -> Plan:
    """A stack plan without probe blocks, replayed in call scope (dcache.runtime.call_scope)."""
    return Plan(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="stack",
                units=["stack"], num_steps=STEPS, actions={"cond": ["C", "C", "F", "C"]}, forecast_order=1)


METHODS = {
    "stack-plan": lambda pipe: dcache.apply(pipe, stack_plan()),
    "call-plan": lambda pipe: dcache.apply(pipe, call_plan(), scope="call"),
    "block-plan": lambda pipe: dcache.apply(pipe, block_plan()),
    "fbcache": lambda pipe: dcache.apply(pipe, "fbcache", threshold=0.5),
}


class GraphCounter:
    """A torch.compile backend that records every graph it is handed and runs it as traced (no codegen)."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    @staticmethod
    def ops(gm) -> list[str]:
        return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def generate(pipe, **kwargs):
    return pipe([1, 2], generator=seeded(0), num_inference_steps=STEPS, **kwargs)


def compile_transformer(pipe, mode: str, backend) -> None:
    if mode == "full":
        pipe.transformer.compile(backend=backend)  # in place: the pipeline keeps its FluxTransformer2DModel
    else:
        pipe.transformer.compile_repeated_blocks(backend=backend)  # diffusers' regional compilation


@contextlib.contextmanager
def fresh_dynamo(**config):
    torch._dynamo.reset()
    with torch._dynamo.config.patch(**config):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def eager_outputs():
    """{method: output of eager dcache}, the reference of every compiled case."""
    out = {}
    for name, apply in METHODS.items():
        pipe = make_pipeline()
        handle = apply(pipe)
        out[name] = generate(pipe)
        handle.remove()
    return out


@pytest.mark.parametrize("mode,order,method", [
    ("full", "before", "stack-plan"),
    ("regional", "before", "block-plan"),
    ("regional", "after", "fbcache"),
    ("full", "before", "call-plan"),
    ("regional", "after", "call-plan"),
])
def test_compiled_outputs_match_eager(mode, order, method, eager_outputs):
    """compile before or after dcache.apply: same outputs as eager dcache, same decisions, repeatable."""
    with fresh_dynamo():
        pipe = make_pipeline()
        if order == "before":
            compile_transformer(pipe, mode, GraphCounter())
        handle = METHODS[method](pipe)
        if order == "after":
            compile_transformer(pipe, mode, GraphCounter())
        first = generate(pipe)
        again = generate(pipe)
        stats = handle.stats()
        handle.remove()
        after_remove = generate(pipe)
    assert (first - eager_outputs[method]).abs().max().item() <= COMPILE_ATOL
    assert torch.equal(first, again)
    assert stats.compute_ratio < 1.0  # the cache really worked under compile
    assert rel_error(after_remove, generate(make_pipeline())) <= COMPILE_ATOL




def _bare_block_graphs(mode: str) -> list[list[str]]:
    """Op sequences of the graphs the same compile produces without dcache (one per block class for regional)."""
    bare = GraphCounter()
    with fresh_dynamo():
        pipe = make_pipeline()
        compile_transformer(pipe, mode, bare)
        generate(pipe)
    return [GraphCounter.ops(g) for g in bare.graphs if len(g.graph.nodes) > 60]  # the block graphs


@pytest.mark.parametrize("mode,count_flops", [
    ("regional", True),
    ("full", True),
    ("regional", False),
])
def test_blocks_are_compiled_whole_under_a_static_plan(mode, count_flops):
    """A static block plan: every block's full op sequence is captured in one graph (the blocks really run compiled,
    with no graph break inside a block); a second generation compiles nothing new; the recompile limit is never hit."""
    want = _bare_block_graphs("regional")
    assert want, "the bare regional compile captured no block graph"
    cached = GraphCounter()
    with fresh_dynamo(fail_on_recompile_limit_hit=True):
        pipe = make_pipeline()
        compile_transformer(pipe, mode, cached)
        dcache.apply(pipe, block_plan(), count_flops=count_flops)
        generate(pipe)
        warm = len(cached.graphs)
        generate(pipe)
    captured = [GraphCounter.ops(g) for g in cached.graphs]
    for ops in want:
        assert any(_contains_in_order(c, ops) for c in captured), \
            "a block was not compiled (ran eagerly) or was split across graphs (graph break inside the block)"
    assert len(cached.graphs) == warm, f"{len(cached.graphs) - warm} graphs compiled after warm-up"


@pytest.mark.parametrize("mode,method", [("regional", "fbcache"), ("full", "fixed_interval"), ("full", "fbcache")])
def test_no_recompile_storm(mode, method):
    """Dynamic methods with CFG: after one warm-up generation, the same generation again compiles nothing new, and the
    recompile limit is never reached (past it dynamo silently runs the frame eagerly)."""
    counter = GraphCounter()
    with fresh_dynamo(fail_on_recompile_limit_hit=True):
        pipe = make_pipeline()
        compile_transformer(pipe, mode, counter)
        dcache.apply(pipe, method, count_flops=False)
        generate(pipe, guidance_scale=3.0)
        warm = len(counter.graphs)
        generate(pipe, guidance_scale=3.0)
    assert warm > 0
    assert len(counter.graphs) == warm, f"{len(counter.graphs) - warm} graphs compiled after warm-up"


def test_bare_regional_compile_is_storm_free():
    """Control for the tests above: without dcache the same set-up compiles a bounded set of graphs once."""
    counter = GraphCounter()
    with fresh_dynamo(fail_on_recompile_limit_hit=True):
        pipe = make_pipeline()
        compile_transformer(pipe, "regional", counter)
        generate(pipe)
        warm = len(counter.graphs)
        generate(pipe)
    assert 0 < warm <= 4 and len(counter.graphs) == warm


def _contains_in_order(ops: list[str], want: list[str]) -> bool:
    it = iter(ops)
    return all(any(o == w for o in it) for w in want)


@pytest.mark.long
def test_inductor_regional_matches_eager(eager_outputs):
    """One real codegen case (inductor, regional, static stack plan); ~90 s of C++ compilation on a small CPU."""
    with fresh_dynamo():
        pipe = make_pipeline()
        handle = METHODS["stack-plan"](pipe)
        compile_transformer(pipe, "regional", "inductor")
        out = generate(pipe)
        handle.remove()
    assert (out - eager_outputs["stack-plan"]).abs().max().item() <= 1e-4
