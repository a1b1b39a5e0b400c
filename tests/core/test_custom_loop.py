"""Custom denoising loops (`handle.loop`, dcache.api.custom_loop): hand-written loops shaped like SGLang's (split CFG,
one call per branch) and vLLM-Omni's (batched CFG, one call on [uncond; cond]) around the bundled model's transformer.

References: the uncached loop (all-compute is bit-identical), the same loop tracked by dcache from its timesteps
(where that works, the explicit signals give the same decisions and outputs bit for bit), a fresh handle per step
count, and the schedule's own cadence (where timestep tracking cannot work: repeated timesteps).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dcache
from dcache.runtime.concurrency import ConcurrentGenerationError
from dcache.generations.health import DCacheHealthWarning
from dcache.pipelines.bundled import load_tiny_pipeline
from dcache.pipelines.tiny_pipeline import image_ids, text_ids

GUIDANCE = 1.5


@pytest.fixture(scope="module")
def parts():
    pipe = load_tiny_pipeline()
    return pipe.transformer, pipe.label_encoder


def denoise(transformer, encoder, labels, steps, loop=None, cfg="split", sigmas=None, seed=0):
    """x_1 = noise [B, 64, 4] -> x_0 by Euler on sigmas (default linspace(1, 0)); v = v_u + g (v_c - v_u).
    loop: signal steps and branches through it; None: leave dcache (if applied) to track the timesteps."""
    batch = len(labels)
    x = torch.randn(batch, 64, 4, generator=torch.Generator().manual_seed(seed))
    sigmas = torch.linspace(1.0, 0.0, steps + 1) if sigmas is None else sigmas
    with torch.no_grad():
        cond = encoder(torch.tensor(labels))
        uncond = encoder(torch.full((batch,), encoder.null_label))
        ids = dict(txt_ids=text_ids(encoder.config.num_tokens), img_ids=image_ids())

        def call(x_in, embedded, t):
            hidden, pooled = embedded
            return transformer(hidden_states=x_in, encoder_hidden_states=hidden, pooled_projections=pooled,
                               timestep=t.expand(x_in.shape[0]), return_dict=False, **ids)[0]

        def branch(name):
            if loop is not None:
                return loop.branch(name)
            return transformer.cache_context(name) if hasattr(transformer, "cache_context") else \
                contextlib.nullcontext()

        for i in range(steps):
            if loop is not None:
                loop.step(i)
            t = sigmas[i]
            if cfg == "split":
                with branch("cond"):
                    v_cond = call(x, cond, t)
                with branch("uncond"):
                    v_uncond = call(x, uncond, t)
            else:  # batched: [uncond; cond] in one call, no branch names
                both = tuple(torch.cat([u, c]) for u, c in zip(uncond, cond))
                v_uncond, v_cond = call(torch.cat([x, x]), both, t).chunk(2)
            x = x + (sigmas[i + 1] - sigmas[i]) * (v_uncond + GUIDANCE * (v_cond - v_uncond))
    return x


def rows(handle):
    """(step, branch, actions) of every call: the engine's record, or each sample's where the samples of a batch
    decided on their own (per-sample decisions, the default)."""
    engine = handle.engine
    own = engine.record is not None and engine.record.calls
    records = [engine.record] if own else [record for _, record in engine.lanes.records()]
    return [[(c.step, c.branch, c.actions) for c in record.calls] for record in records]


@pytest.mark.parametrize("cfg", ["split", "batched"])
@pytest.mark.parametrize("method,knobs", [("teacache", {"threshold": 0.8}), ("fixed_interval", {})])
def test_explicit_signals_match_timestep_tracking_bit_for_bit(parts, method, knobs, cfg):
    transformer, encoder = parts
    with dcache.apply(transformer, method, num_steps=12, **knobs) as handle:
        tracked = denoise(transformer, encoder, [3, 7], 12, cfg=cfg)
        tracked_rows = rows(handle)
    with dcache.apply(transformer, method, **knobs) as handle:  # no step count at apply: the loop gives it
        with handle.loop(num_steps=12) as loop:
            signalled = denoise(transformer, encoder, [3, 7], 12, loop=loop, cfg=cfg)
        assert rows(handle) == tracked_rows
        assert handle.stats().compute_ratio < 1.0  # it cached something
    assert torch.equal(signalled, tracked)


def test_all_compute_in_a_loop_is_the_uncached_loop_bit_for_bit(parts):
    transformer, encoder = parts
    reference = denoise(transformer, encoder, [1, 4], 8)
    with dcache.apply(transformer, "fixed_interval", interval=1) as handle:
        with pytest.warns(DCacheHealthWarning, match="reused nothing"), handle.loop(num_steps=8) as loop:
            out = denoise(transformer, encoder, [1, 4], 8, loop=loop)
        assert handle.stats().compute_ratio == 1.0
    assert torch.equal(out, reference)


def test_each_loop_has_its_own_step_count(parts):
    """Requests of 12 and then 6 steps through one handle: each as a fresh handle with its own num_steps gives."""
    transformer, encoder = parts
    reference = {}
    for steps in (12, 6):
        with dcache.apply(transformer, "fixed_interval", interval=3, num_steps=steps) as handle:
            reference[steps] = (denoise(transformer, encoder, [5], steps), rows(handle))
    with dcache.apply(transformer, "fixed_interval", interval=3) as handle:
        for steps in (12, 6):
            with handle.loop(num_steps=steps) as loop:
                out = denoise(transformer, encoder, [5], steps, loop=loop)
            assert handle.engine.record.num_steps == steps and handle.engine.record.finished
            assert torch.equal(out, reference[steps][0]) and rows(handle) == reference[steps][1]


def test_repeated_timesteps_keep_their_steps(parts):
    """Timesteps that repeat (two evaluations per noise level): tracked from timesteps, the repeats merge into one
    step with four calls; signalled, each is a step of its own and the cadence is the schedule's."""
    transformer, encoder = parts
    levels = torch.linspace(1.0, 0.0, 5)
    sigmas = torch.cat([levels[:-1].repeat_interleave(2), levels[-1:]])  # [1, 1, .75, .75, ..., 0]: 8 steps
    with dcache.apply(transformer, "fixed_interval", interval=2, num_steps=8) as handle:
        denoise(transformer, encoder, [2], 8, sigmas=sigmas)
        assert max(c.step for c in handle.engine.record.calls) < 7  # tracking lost steps
    with dcache.apply(transformer, "fixed_interval", interval=2, num_steps=8) as handle:
        denoise(transformer, encoder, [2], 8)  # distinct timesteps: tracking sees every step
        cadence = rows(handle)
    with dcache.apply(transformer, "fixed_interval", interval=2) as handle:
        with handle.loop(num_steps=8) as loop:
            denoise(transformer, encoder, [2], 8, loop=loop, sigmas=sigmas)
        assert rows(handle) == cadence  # eight steps, two branches each, the schedule's own cadence
        assert any("C" not in actions for _, _, actions in cadence[0])


def test_no_timestep_is_read_on_the_host_inside_a_loop(parts, monkeypatch):
    transformer, encoder = parts
    import dcache.generations.records

    def refuse(timestep):
        raise AssertionError("a timestep was read on the host inside a custom loop")

    with dcache.apply(transformer, "fixed_interval", interval=2) as handle:
        monkeypatch.setattr(dcache.generations.records, "timestep_value", refuse)
        with handle.loop(num_steps=4) as loop:
            denoise(transformer, encoder, [0], 4, loop=loop)


def test_a_loop_left_early_or_by_an_exception_ends_its_generation(parts):
    transformer, encoder = parts
    with dcache.apply(transformer, "fixed_interval", interval=2) as handle:
        with pytest.raises(KeyboardInterrupt):
            with handle.loop(num_steps=6) as loop:
                loop.step(0)
                with loop.branch("cond"):
                    raise KeyboardInterrupt
        assert handle.engine.branches == {}  # the caches were freed
        with pytest.raises(RuntimeError, match="has ended"):
            loop.step(1)
        with handle.loop(num_steps=6) as loop:  # the next request starts clean
            out = denoise(transformer, encoder, [6], 6, loop=loop)
        assert torch.isfinite(out).all() and handle.engine.record.finished


def test_a_second_loop_takes_the_transformer_over(parts):
    transformer, encoder = parts
    with dcache.apply(transformer, "fixed_interval", interval=2) as handle:
        first = handle.loop(num_steps=4).__enter__()
        first.step(0)
        with handle.loop(num_steps=4) as second:
            denoise(transformer, encoder, [8], 4, loop=second)
        with pytest.raises(RuntimeError, match="another loop or pipeline"):
            first.step(1)
        first.__exit__(None, None, None)  # ending a taken-over loop leaves the other generation alone
        assert handle.engine.record is second.record


def test_steps_out_of_order_and_bad_arguments_are_refused(parts):
    transformer, _ = parts
    with dcache.apply(transformer, "fixed_interval", interval=2) as handle:
        with pytest.raises(ValueError, match="num_steps is the loop's number of denoising steps"):
            handle.loop(num_steps=0)
        with pytest.raises(ValueError, match="one per step"):
            handle.loop(num_steps=3, timesteps=[1.0, 0.5])
        loop = handle.loop(num_steps=4)
        with pytest.raises(RuntimeError, match="as a context manager"):
            loop.step(0)
        with loop:
            with pytest.raises(ValueError, match="in order, one at a time"):
                loop.step(2)
            with pytest.raises(ValueError, match=r"in \[0, 4\)"):
                loop.step(4)
            with pytest.raises(ValueError, match="non-empty string"):
                with loop.branch(""):
                    pass
    class RewritesTheUpdate(dcache.Schedule):
        name = "rewrites-the-update"
        granularity = "block"
        acts_on_steps = True

        def decide(self, ctx):
            return dcache.Action.COMPUTE

    with dcache.apply(transformer, RewritesTheUpdate()) as handle:
        with pytest.raises(ValueError, match="acts on the sampler's update"):
            handle.loop(num_steps=4).__enter__()
    handle_removed = dcache.apply(transformer, "fixed_interval")
    handle_removed.remove()
    with pytest.raises(RuntimeError, match="removed handle"):
        handle_removed.loop(num_steps=4)


def test_another_thread_cannot_step_a_loop_it_does_not_own(parts):
    import threading

    transformer, encoder = parts
    errors = []
    with dcache.apply(transformer, "fixed_interval", interval=2) as handle:
        with handle.loop(num_steps=4) as loop:
            denoise_steps = threading.Thread(target=lambda: _step_from_thread(loop, errors))
            denoise_steps.start()
            denoise_steps.join()
    assert errors and isinstance(errors[0], ConcurrentGenerationError)


def _step_from_thread(loop, errors):
    try:
        loop.step(1)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)
