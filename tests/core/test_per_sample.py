"""Per-sample decisions (dcache.lanes): a sample's output does not depend on its batch.

Reference: the same sample run alone (batch 1, the engine's ordinary path). Every sample of a batched generation,
and each CFG half of a batched-CFG one, is decided and cached on its own, at batch 1: outputs are bit-identical to
the sample's own run. `decisions="batch"` is the control showing that the comparison can fail: with one decision per
batch, TeaCache gives the label-0 sample of [1, 3, 7, 0] at 16 steps an output 3.7e-3 away from its own run."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcache
from dcache.health import DCacheHealthWarning
from dcache.lanes import BatchDecisionsWarning
from dcache.methods import methods
from dcache.pipelines.bundled import load_tiny_pipeline

STEPS = 16
LABELS = [3, 0]


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def _noise(pipe, n: int) -> torch.Tensor:
    return torch.randn((n, *pipe.sample_shape()), generator=torch.Generator().manual_seed(0))


def _images(pipe, labels, latents, **kwargs) -> torch.Tensor:
    return pipe(labels=labels, num_inference_steps=STEPS, latents=latents, output_type="pt", **kwargs).images


def _batch_and_alone(pipe, method, labels, apply_kwargs=(), **call_kwargs):
    """(batched images, each sample's images alone, the batch's stats, whether the schedule reads signals)."""
    noise = _noise(pipe, len(labels))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)  # a setting that reuses nothing is fine here
        with dcache.apply(pipe, method, **{"decisions": "sample", **dict(apply_kwargs)}) as handle:
            lanes = handle.engine.lanes
            dynamic = lanes is not None and lanes._reads_signals()
            batch = _images(pipe, labels, noise, **call_kwargs)
            stats = handle.stats()
            alone = [_images(pipe, [label], noise[i:i + 1], **call_kwargs)[0] for i, label in enumerate(labels)]
    return batch, torch.stack(alone), stats, dynamic


def _assert_each_sample_alone(batch, alone, dynamic: bool) -> None:
    """A schedule that reads signals runs every row on its own: bit-identical to the sample's own run. One that
    decides from the step alone decides every row alike and runs the batch whole: equal up to the kernels' batch
    size effects (float32 sums in another order, < 1e-5 here)."""
    diff = (batch - alone).abs().amax(dim=(1, 2, 3)).tolist()
    if dynamic:
        assert torch.equal(batch, alone), diff
    else:
        assert max(diff) < 1e-5, diff


@pytest.mark.parametrize("method", sorted(methods()))
def test_every_method_batch_equals_alone(pipe, method):
    batch, alone, stats, dynamic = _batch_and_alone(pipe, method, LABELS)
    _assert_each_sample_alone(batch, alone, dynamic)
    if dynamic:  # stats per sample: each sample's own calls (split CFG: cond + uncond per step), totals their sum
        assert [s["sample"] for s in stats.per_sample] == [0, 1]
        assert all(s["calls"] == 2 * STEPS for s in stats.per_sample)
        assert stats.calls == 2 * STEPS  # batched calls
        assert stats.units_computed == sum(s["units_computed"] for s in stats.per_sample)
    else:
        assert stats.per_sample == [] and stats.calls == 2 * STEPS


def test_batch_decisions_control_differs(pipe):
    """The reported case with decisions="batch": the label-0 sample's decisions follow the batch's, so its output
    differs from its own run; with per-sample decisions it is its own run's, bit for bit."""
    labels = [1, 3, 7, 0]
    batch, alone, stats, _ = _batch_and_alone(pipe, "teacache", labels, {"decisions": "batch"})
    assert (batch[3] - alone[3]).abs().max() > 1e-3
    assert stats.per_sample == []
    batch, alone, stats, _ = _batch_and_alone(pipe, "teacache", labels)
    assert torch.equal(batch, alone)
    reused = [s["units_reused"] for s in stats.per_sample]
    assert reused[3] != reused[0], reused  # the samples did decide differently (2, 2, 2, 3 units reused)


@pytest.mark.parametrize("method", ["teacache", "fbcache"])
def test_batched_cfg_each_half_alone(pipe, method):
    batch, alone, stats, dynamic = _batch_and_alone(pipe, method, LABELS, cfg_mode="batched")
    assert dynamic and torch.equal(batch, alone)
    assert len(stats.per_sample) == 2 * len(LABELS)  # rows [uncond_0, uncond_1, cond_0, cond_1]


@pytest.mark.parametrize("method", ["easycache", "seacache", "magcache"])
def test_call_scope_batch_equals_alone(pipe, method):
    batch, alone, stats, dynamic = _batch_and_alone(pipe, method, LABELS, {"scope": "call"})
    _assert_each_sample_alone(batch, alone, dynamic)


def test_unsplittable_call_falls_back_with_one_warning(pipe):
    """A call dcache cannot split (the reason set by hand, as dcache.apply sets it for a cached ControlNet) takes
    batch decisions and says so once per handle, with the reason."""
    noise = _noise(pipe, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)
        with dcache.apply(pipe, "teacache", decisions="sample") as handle:
            handle.engine.lanes.batch_reason = "a reason given by a test"
            with pytest.warns(BatchDecisionsWarning, match="a reason given by a test") as caught:
                _images(pipe, LABELS, noise)
                _images(pipe, LABELS, noise)
            assert sum(issubclass(w.category, BatchDecisionsWarning) for w in caught) == 1
            assert handle.stats().per_sample == []


def test_bad_decisions_value_names_the_field(pipe):
    with pytest.raises(ValueError, match=r"decisions='rows'.*'sample'.*'batch'"):
        dcache.apply(pipe, "teacache", decisions="rows")


def test_requests_must_match_the_rows(pipe):
    noise = _noise(pipe, 2)
    with dcache.apply(pipe, "teacache", decisions="sample") as handle:
        with pytest.raises(ValueError, match=r"named 3 requests.*2 rows"):
            with handle.requests(["a", "b", "c"]):
                pipe(labels=LABELS, num_inference_steps=2, latents=noise, guidance_scale=1.0)
        with pytest.raises(ValueError, match="distinct"):
            with handle.requests(["a", "a"]):
                pass


# ------------------------------------------------------------------------------------------ continuous batching
def _serving_loop(pipe, handle, arrivals: dict[str, int], labels: dict[str, int], noise: dict[str, torch.Tensor]):
    """A hand-written serving loop on the bare transformer (no pipeline, no scheduler): at tick k the requests that
    arrive at k join the batch; every tick runs one transformer call over the active requests, each at its own step
    and timestep (a per-row timestep vector), and an Euler step x <- x + (sigma_{i+1} - sigma_i) v per request;
    a request leaves the batch after its last step. handle: name the requests of each call (None: the plain
    calls, batch 1 alone). Returns each request's final state x_0 [1, 64, 4]."""
    pipe._set_timesteps(STEPS, "cpu")
    sigmas = pipe.scheduler.sigmas.float()  # [STEPS + 1], 1 -> 0
    pipe._to_state(next(iter(noise.values())))  # sets the RoPE ids (pipe._ids), once per generation
    txt_ids, img_ids = pipe._ids
    state = {r: [None, 0] for r in arrivals}
    done: dict[str, torch.Tensor] = {}
    for tick in range(max(arrivals.values()) + STEPS):
        for r, start in arrivals.items():
            if start == tick:
                state[r][0] = pipe._to_state(noise[r])
        active = [r for r in arrivals if state[r][0] is not None and r not in done]
        if not active:
            continue
        x = torch.cat([state[r][0] for r in active])
        t = torch.stack([sigmas[state[r][1]] for r in active])  # Flux's timestep = sigma, per row
        y = torch.tensor([labels[r] for r in active])
        call = lambda: pipe._velocity(x, y, t, txt_ids, img_ids)  # noqa: E731
        if handle is not None:  # a serving loop names its requests in every call, one id per row
            with handle.requests(active):
                v = call()
        else:
            v = call()
        for row, r in enumerate(active):
            i = state[r][1]
            state[r][0] = state[r][0] + (sigmas[i + 1] - sigmas[i]) * v[row:row + 1]
            state[r][1] = i + 1
            if i + 1 == STEPS:
                done[r] = state[r][0]
    return done


@torch.no_grad()
@pytest.mark.parametrize("method", ["teacache", "magcache"])
def test_continuous_batching_each_request_gets_its_own_image(pipe, method):
    """Request b joins while a is at step 3, c at step 7 (a finishes and leaves while b and c run on): each
    request's final state equals the one it gets alone in the same loop, and the cache did act (it differs from the
    uncached loop)."""
    arrivals, labels = {"a": 0, "b": 3, "c": 7}, {"a": 1, "b": 0, "c": 7}
    noise = {r: torch.randn((1, *pipe.sample_shape()), generator=torch.Generator().manual_seed(i))
             for i, r in enumerate(arrivals)}
    plain = _serving_loop(pipe, None, arrivals, labels, noise)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DCacheHealthWarning)
        with dcache.apply(pipe.transformer, method, num_steps=STEPS, decisions="sample") as handle:
            together = _serving_loop(pipe, handle, arrivals, labels, noise)
        alone = {}
        for r in arrivals:
            with dcache.apply(pipe.transformer, method, num_steps=STEPS, decisions="sample") as handle:
                alone.update(_serving_loop(pipe, None, {r: 0}, labels, noise))  # the engine's own path
    for r in arrivals:
        assert torch.equal(together[r], alone[r]), (r, (together[r] - alone[r]).abs().max().item())
    assert max((alone[r] - plain[r]).abs().max().item() for r in arrivals) > 1e-4  # something was reused


def test_all_compute_with_per_sample_decisions_matches_uncached(pipe):
    """Threshold 0 computes every row; each row runs at batch 1, so the batch equals the uncached batch up to the
    kernels' batch-size rounding (decisions="batch" keeps it bit-identical: tests/compat/test_pipeline_calls.py)."""
    noise = _noise(pipe, 2)
    reference = _images(pipe, LABELS, noise)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)
        with dcache.apply(pipe, "fbcache", threshold=0.0, decisions="sample") as handle:
            cached = _images(pipe, LABELS, noise)
    assert handle.stats().compute_ratio == 1.0 and len(handle.stats().per_sample) == 2
    assert (cached - reference).abs().max() < 1e-5


def test_memory_report_sums_the_samples(pipe):
    """Each sample caches its own rows: handle.memory() adds the lanes up to the batch's bytes, branch by branch."""
    noise, reports = _noise(pipe, 2), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)
        for mode in ("sample", "batch"):
            with dcache.apply(pipe, "teacache", decisions=mode) as handle:
                pipe(labels=LABELS, num_inference_steps=4, latents=noise, output_type="pt")
                reports[mode] = handle.memory().by_branch
    assert reports["sample"] == reports["batch"] and reports["batch"], reports
