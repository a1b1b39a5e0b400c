"""Per-sample decisions (dcache.runtime.lanes, the default): a sample's output does not depend on its batch.

Reference: the same sample run alone (batch 1, the engine's ordinary path). Every sample of a batched generation,
and each CFG half of a batched-CFG one, takes the decisions it takes alone (the same action per step and unit); the
rows that decided alike run as one sub-batch, so outputs equal the sample's own run up to the kernels' batch-size
rounding (float32 sums in another order: < 1e-6 on the bundled model, bounded here at 1e-5). A batch whose rows all
decide alike runs as one call: all-compute is the uncached batch, bit for bit. What a row ran while deciding is
counted as computed work, so handle.stats() matches a FLOP meter around the generation. `decisions="batch"` is the
control
showing that the comparison can fail: with one decision per batch, TeaCache gives the label-0 sample of [1, 3, 7, 0]
at 16 steps an output 3.7e-3 away from its own run."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcache
from dcache.generations.health import DCacheHealthWarning
from dcache.runtime.lanes import BatchDecisionsWarning
from dcache.methods import methods
from dcache.pipelines.bundled import load_tiny_pipeline

STEPS = 16
LABELS = [3, 0]
BATCH_ROUNDING = 1e-5  # |batch - alone| where the same decisions run at another batch size (kernels' rounding)


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def _noise(pipe, n: int) -> torch.Tensor:
    return torch.randn((n, *pipe.sample_shape()), generator=torch.Generator().manual_seed(0))


def _images(pipe, labels, latents, **kwargs) -> torch.Tensor:
    return pipe(labels=labels, num_inference_steps=STEPS, latents=latents, output_type="pt", **kwargs).images


def _decisions(handle, alone: bool = False) -> list[str]:
    """Each sample's actions, call after call: its lane's record (its rows' lanes for a sample run alone with batched
    CFG), or after a batch-1 run the engine's own."""
    engine = handle.engine
    own = alone and engine.record is not None and engine.record.calls
    records = [engine.record] if own else [rec for _, rec in engine.lanes.records()]
    return ["".join(c.actions for c in rec.calls) for rec in records]


def _batch_and_alone(pipe, method, labels, apply_kwargs=(), with_alone=True, **call_kwargs):
    """(batched images, each sample's images alone, the batch's stats, whether the schedule reads signals, the
    samples' decisions in the batch, their decisions alone). with_alone=False: the batch alone (the alone images
    and decisions empty)."""
    noise = _noise(pipe, len(labels))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)  # a setting that reuses nothing is fine here
        with dcache.apply(pipe, method, **dict(apply_kwargs)) as handle:
            lanes = handle.engine.lanes
            dynamic = lanes is not None and lanes._reads_signals()
            batch = _images(pipe, labels, noise, **call_kwargs)
            stats = handle.stats()
            together = _decisions(handle) if dynamic else []
            alone, own = [], []
            for i, label in enumerate(labels if with_alone else []):
                alone.append(_images(pipe, [label], noise[i:i + 1], **call_kwargs)[0])
                if dynamic:
                    own.append(_decisions(handle, alone=True))
    if own:  # in the batch's row order: with batched CFG the rows are [uncond_0, uncond_1, cond_0, cond_1]
        own = [per_sample[k] for k in range(len(own[0])) for per_sample in own]
    return batch, torch.stack(alone) if alone else None, stats, dynamic, together, own


def _assert_each_sample_alone(batch, alone) -> None:
    diff = (batch - alone).abs().amax(dim=(1, 2, 3)).tolist()
    assert max(diff) < BATCH_ROUNDING, diff


@pytest.mark.parametrize("method", sorted(methods()))
def test_every_method_batch_equals_alone(pipe, method):
    batch, alone, stats, dynamic, together, own = _batch_and_alone(pipe, method, LABELS)
    _assert_each_sample_alone(batch, alone)
    if dynamic:  # each sample decided as alone; stats per sample: its own calls (split CFG: cond + uncond per step)
        assert together == own
        assert [s["sample"] for s in stats.per_sample] == [0, 1]
        assert all(s["calls"] == 2 * STEPS for s in stats.per_sample)
        assert stats.calls == 2 * STEPS  # batched calls
        assert stats.units_computed == sum(s["units_computed"] for s in stats.per_sample)
    else:
        assert stats.per_sample == [] and stats.calls == 2 * STEPS


def test_batch_decisions_control_differs(pipe):
    """The reported case with decisions="batch": the label-0 sample's decisions follow the batch's, so its output
    differs from its own run; with per-sample decisions (the default) it takes its own run's decisions."""
    labels = [1, 3, 7, 0]
    batch, alone, stats, _, together, own = _batch_and_alone(pipe, "teacache", labels)
    _assert_each_sample_alone(batch, alone)
    assert together == own
    reused = [s["units_reused"] for s in stats.per_sample]
    assert reused[3] != reused[0], reused  # the samples did decide differently (2, 2, 2, 3 units reused)
    # a sample alone decides the same with either setting, so the alone runs above are the reference here too
    batch, _, stats, _, _, _ = _batch_and_alone(pipe, "teacache", labels, {"decisions": "batch"}, with_alone=False)
    assert (batch[3] - alone[3]).abs().max() > 1e-3
    assert stats.per_sample == []


def test_rows_that_compute_run_as_one_sub_batch(pipe):
    """Where rows decide differently, the rows that compute run as one call on their rows and the others are served
    from their own caches: the blocks run once per call, at the batch size of the rows that compute."""
    labels = [1, 3, 7, 0]
    noise = _noise(pipe, len(labels))
    sizes: list[int] = []
    attn = pipe.transformer.single_transformer_blocks[-1].attn  # runs only where a row's stack is computed
    hook = attn.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["hidden_states"].shape[0]),
                                          with_kwargs=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DCacheHealthWarning)
            with dcache.apply(pipe, "teacache") as handle:
                _images(pipe, labels, noise)
                decisions = _decisions(handle)
    finally:
        hook.remove()
    per_call = list(zip(*decisions))  # the 4 samples' action per call
    computing = [row.count("C") for row in per_call if "C" in row]
    assert sizes == computing, (sizes, computing)  # one block run per call, over exactly the rows that compute
    assert any(0 < n < len(labels) for n in computing), per_call  # some calls did mix computed and served rows


@pytest.mark.parametrize("method", ["teacache", "fbcache"])
def test_batched_cfg_each_half_alone(pipe, method):
    batch, alone, stats, dynamic, together, own = _batch_and_alone(pipe, method, LABELS, cfg_mode="batched")
    _assert_each_sample_alone(batch, alone)
    assert dynamic and together == own
    assert len(stats.per_sample) == 2 * len(LABELS)  # rows [uncond_0, uncond_1, cond_0, cond_1]


@pytest.mark.parametrize("method", ["easycache", "seacache", "magcache"])
def test_call_scope_batch_equals_alone(pipe, method):
    batch, alone, stats, dynamic, together, own = _batch_and_alone(pipe, method, LABELS, {"scope": "call"})
    _assert_each_sample_alone(batch, alone)
    assert together == own


def test_unsplittable_call_falls_back_with_one_warning(pipe):
    """A call dcache cannot split (the reason set by hand, as dcache.apply sets it for a cached ControlNet) takes
    batch decisions and says so once per handle, with the reason."""
    noise = _noise(pipe, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)
        with dcache.apply(pipe, "teacache") as handle:
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
    with dcache.apply(pipe, "teacache") as handle:
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


@pytest.mark.parametrize("method", ["fbcache", "teacache", "easycache"])
def test_all_compute_with_per_sample_decisions_is_the_uncached_batch(pipe, method):
    """Threshold 0 computes every row of every call: the rows decide alike, so each call runs whole, on the batch as
    given, and the images are the uncached batch's bit for bit under the default per-sample decisions."""
    noise = _noise(pipe, 2)
    reference = _images(pipe, LABELS, noise)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)
        with dcache.apply(pipe, method, threshold=0.0) as handle:
            cached = _images(pipe, LABELS, noise)
    stats = handle.stats()
    assert stats.units_reused == 0 and len(stats.per_sample) == 2
    assert torch.equal(cached, reference), (cached - reference).abs().max().item()


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


# ------------------------------------------------------------------------------------------ cost
@pytest.fixture(scope="module")
def motion():
    from dcache.pipelines.bundled import load_motion_pipeline

    return load_motion_pipeline()


def _metered(pipe, labels, steps: int, **kwargs) -> tuple[float, torch.Tensor]:
    """(FLOPs of one generation as torch's FlopCounterMode counts every op it runs, its clips)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as meter:
        clips = pipe(labels=labels, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                     output_type="pt", **kwargs).frames
    return meter.get_total_flops(), clips


@pytest.mark.parametrize("batch, cfg_mode, knobs, steps", [
    (4, "split", {}, 4),  # every row computes every call: each call runs whole, its probe block once more
    (1, "batched", {}, 4),  # the same, the CFG halves of one sample as two rows
    (4, "split", {"threshold": 0.25}, 12),  # rows decide differently: their probe outputs are served
])
def test_stats_computed_flops_match_a_flop_meter(motion, batch, cfg_mode, knobs, steps):
    """Each row decides at batch 1, running the embedders and FBCache's probe block; where every row computes, the
    call then runs whole from its start (the uncached batch, bit for bit), running the probe block again, and where
    rows differ their sub-batches are served the probe outputs. Whatever runs is counted: the stats' computed FLOPs
    over their uncached total equal a FLOP meter's cached over uncached FLOPs within 2% (the meter also counts the
    work outside the blocks, in both). Before this was counted, the first two cases measured 1.258 and said 1.00."""
    labels = [(3 * i) % 4 for i in range(batch)]
    uncached, reference = _metered(motion, labels, steps, cfg_mode=cfg_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DCacheHealthWarning)
        with dcache.apply(motion, "fbcache", **knobs) as handle:
            cached, images = _metered(motion, labels, steps, cfg_mode=cfg_mode)
    stats = handle.stats()
    assert len(stats.per_sample) == (2 * batch if cfg_mode == "batched" else batch)  # a lane per row
    measured = stats.block_flops_computed / stats.block_flops_total
    assert measured == pytest.approx(cached / uncached, rel=0.02), (measured, cached / uncached)
    if knobs:
        reused = [s["units_reused"] for s in stats.per_sample]
        assert len(set(reused)) > 1, reused  # the rows did decide differently (10, 10, 11, 10 reused)
    else:
        assert stats.units_reused == 0 and torch.equal(images, reference)


def test_forecasts_are_evaluated_once_per_row(pipe, monkeypatch):
    """A forecast a row's decision evaluated (its finite check) is what its sub-batch serves, stacked with the other
    rows': each forecast unit of each row is evaluated once, not again on the stacked Taylor tables."""
    from dcache.runtime.cache_state import UnitHistory

    evaluated = []
    forecast = UnitHistory.forecast
    monkeypatch.setattr(UnitHistory, "forecast", lambda self, step: evaluated.append(step) or forecast(self, step))
    batch, alone, stats, dynamic, together, own = _batch_and_alone(pipe, "seacache", [1, 3, 7, 0])
    _assert_each_sample_alone(batch, alone)
    assert together == own
    forecasts = stats.units_forecast
    assert forecasts > 0 and len(evaluated) == 2 * forecasts  # the batch's, then each sample's alone
