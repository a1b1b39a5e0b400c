"""Concurrent generations on one hooked transformer are refused, never mixed (dcache.runtime.concurrency).

Two pipelines built from the same components (each with its own scheduler), dcache applied to one of them, called
from two threads. The interleavings are forced with hooks so each case is deterministic:
  * the second thread's whole generation runs while the first is between two transformer calls: the second gets
    its own correct image (it took the transformer over) and the first is refused at its next call;
  * the second thread calls while the first is inside a transformer call: the second is refused and the first
    finishes with its correct image;
  * free-running threads: every result is either the image the request gets alone or a ConcurrentGenerationError.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from compat_kit import CompatPipeline, make_pipeline, seeded

import dcache
from dcache import ConcurrentGenerationError

STEPS = 6


def two_pipelines():
    pipe = make_pipeline()
    other = CompatPipeline(**{**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)})
    other.set_progress_bar_config(disable=True)
    return pipe, other


def generate(p, label):
    return p([label], num_inference_steps=STEPS, guidance_scale=2.0, generator=seeded(label))


def references(method="fbcache", **settings):
    """Each request's image with the transformer to itself (a fresh handle per request)."""
    pipe, _ = two_pipelines()
    out = {}
    for label in (1, 7):
        with dcache.apply(pipe, method, **settings):
            out[label] = generate(pipe, label)
    return out


def run_in_thread(fn):
    result = {}

    def target():
        try:
            result["out"] = fn()
        except BaseException as exc:  # the test reads it back
            result["error"] = exc

    thread = threading.Thread(target=target, name="second")
    thread.start()
    thread.join()
    return result


SETTINGS = {"threshold": 0.3}


def second_request_at(module, n, other):
    """Run the second request's whole generation (label 7, on `other`, in thread 'second') from inside the n-th
    forward of `module`; returns (its result, the hook handle)."""
    second: dict = {}
    calls = {"n": 0}

    def pre_hook(_module, _args):
        calls["n"] += 1
        if calls["n"] == n and not second:
            second.update(run_in_thread(lambda: generate(other, 7)))

    return second, module.register_forward_pre_hook(pre_hook)


def test_a_generation_started_between_two_calls_of_another_takes_over_and_the_first_is_refused():
    expected = references(**SETTINGS)
    pipe, other = two_pipelines()
    handle = dcache.apply(pipe, "fbcache", **SETTINGS)
    # the label encoder runs before each transformer call: its 5th run is between two calls of the first request
    second, hook = second_request_at(pipe.label_encoder, 5, other)
    with pytest.raises(ConcurrentGenerationError, match="was ended when thread 'second' started a generation"):
        generate(pipe, 1)
    hook.remove()
    assert "error" not in second, second.get("error")
    assert torch.equal(second["out"], expected[7])
    # the refused thread's next generation is whole again
    assert torch.equal(generate(pipe, 1), expected[1])
    handle.remove()


def test_a_call_while_another_thread_is_inside_a_call_is_refused_and_the_running_generation_is_correct():
    expected = references(**SETTINGS)
    pipe, other = two_pipelines()
    handle = dcache.apply(pipe, "fbcache", **SETTINGS)
    # the first block's 3rd run is inside the first request's 3rd transformer call
    second, hook = second_request_at(pipe.transformer.transformer_blocks[0], 3, other)
    out = generate(pipe, 1)
    hook.remove()
    assert isinstance(second.get("error"), ConcurrentGenerationError), second
    assert "is inside a call of the same dcache-hooked transformer" in str(second["error"])
    assert torch.equal(out, expected[1])
    assert handle.stats().to_dict()["calls"] == 2 * STEPS  # only the first request's calls were counted
    handle.remove()


def test_free_running_threads_get_their_own_image_or_an_error_never_a_mixed_one():
    expected = references(**SETTINGS)
    for trial in range(4):
        pipe, other = two_pipelines()
        results: dict[int, object] = {}
        start = threading.Barrier(2)

        def work(p, label):
            start.wait()
            try:
                results[label] = generate(p, label)
            except ConcurrentGenerationError as exc:
                results[label] = exc

        with dcache.apply(pipe, "fbcache", **SETTINGS):
            threads = [threading.Thread(target=work, args=(p, label)) for p, label in ((pipe, 1), (other, 7))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for label, got in results.items():
            assert isinstance(got, ConcurrentGenerationError) or torch.equal(got, expected[label]), (trial, label)
        assert len(results) == 2


def test_transformer_only_calls_from_another_thread_may_start_but_not_continue_a_generation():
    pipe, _ = two_pipelines()
    transformer = pipe.transformer
    handle = dcache.apply(transformer, "fbcache", num_steps=STEPS, threshold=0.3)
    x = torch.randn(1, 16, 4)

    def call(t):
        kwargs = pipe_call_arguments(pipe, x, t)
        return transformer(**kwargs)

    call(1.0)
    second = run_in_thread(lambda: call(0.8))  # the next step of the first thread's generation
    assert isinstance(second.get("error"), ConcurrentGenerationError), second
    call(0.8)  # the owner goes on
    fresh = run_in_thread(lambda: call(1.0))  # back at the start: a new generation, the other thread's now
    assert "error" not in fresh, fresh.get("error")
    handle.remove()


def pipe_call_arguments(pipe, x, t):
    from compat_kit import TXT_TOKENS, grid_ids
    enc, pooled = pipe.label_encoder(torch.tensor([1]))
    return dict(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled,
                timestep=torch.tensor([t]), img_ids=grid_ids(4, 4), txt_ids=torch.zeros(TXT_TOKENS, 3),
                return_dict=False)
