"""dcache.memory.estimate (meta-device accounting) against handle.memory() of real runs: equal bytes, kind by kind and
branch by branch, on the bundled model (every unit kind, with / without / batched CFG, forecast orders, call scope) and
on the zoo's families; the compute-ratio floor against the measured ratio of a schedule that reads no signal."""

from __future__ import annotations

import warnings

import pytest
import torch
from zoo import READS_TENSOR_VALUES, ZOO

import dcache
from dcache.memory.estimate import estimate
from dcache.pipelines.bundled import load_tiny_pipeline
from dcache.pipelines.estimate import estimate_spec, resolve_model, with_overrides

STEPS = 5


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_pipeline()


def _measured(pipe, method, overrides, guidance, cfg_mode, scope):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = dcache.apply(pipe, method, scope=scope, **overrides)
    try:
        pipe(["3", "7"], num_inference_steps=STEPS, guidance_scale=guidance, cfg_mode=cfg_mode,
             generator=torch.Generator().manual_seed(0), output_type="pt")
        return handle.memory(), handle.stats()
    finally:
        handle.remove()


def _estimated(method, overrides, guidance, cfg_mode, scope):
    spec = resolve_model(None)
    setting = with_overrides(spec.setting, steps=STEPS, guidance=guidance, cfg=cfg_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = estimate_spec(spec, [method], overrides=overrides, batch=2, dtype="float32", setting=setting,
                             scope=scope)
    assert len(rows) == 1
    return rows[0].estimate


CASES = [  # (method, overrides, guidance, cfg_mode, scope, the unit kind it caches)
    ("magcache", {}, 1.5, "split", None, "stack"),
    ("magcache", {"order": 2}, 1.5, "split", None, "stack"),  # Taylor table of order 2: 3 tensors per stream
    ("magcache", {"order": 1}, 1.5, "split", "call", "call"),
    ("seacache", {}, 1.5, "split", None, "stack"),  # spectral signal reference (filtered latents)
    ("fbcache", {}, 1.0, "split", None, "stack"),  # no CFG: one branch; probe residual reference
    ("teacache", {}, 1.5, "split", None, "stack"),  # modulated-input reference
    ("taylorseer", {}, 1.5, "batched", None, "module"),  # batched CFG: one branch of batch 4
    ("delta_dit", {}, 1.5, "split", None, "block"),
    ("cg_taylor", {}, 1.5, "split", None, "stack"),  # forecast-error probe history
]


@pytest.mark.parametrize("method,overrides,guidance,cfg_mode,scope,kind", CASES,
                         ids=[f"{c[0]}-{c[3]}-g{c[2]}-{c[4] or 'blocks'}-{c[1]}" for c in CASES])
def test_estimate_equals_measured_on_the_bundled_model(pipe, method, overrides, guidance, cfg_mode, scope, kind):
    measured, stats = _measured(pipe, method, overrides, guidance, cfg_mode, scope)
    est = _estimated(method, overrides, guidance, cfg_mode, scope)
    assert measured.peak_bytes > 0 and measured.live_bytes == 0  # a finished generation frees its cache
    assert est.memory.peak_bytes == measured.peak_bytes
    assert est.memory.by_branch == measured.by_branch
    assert kind in est.memory.by_kind
    branches = 1 if guidance <= 1 or cfg_mode == "batched" else 2
    assert len(est.memory.by_branch) == branches == len(stats.branches)
    # the FLOPs of one computed call are the engine's own count of the real run's first call
    assert max(est.flops_per_call.values()) == pytest.approx(stats.block_flops_total / stats.calls, rel=0.35)


def test_forecast_order_multiplies_the_stack_cache(pipe):
    """Analytic: a Taylor table of order k holds k + 1 tensors of each cached residual."""
    order0 = _estimated("magcache", {}, 1.5, "split", None).memory.by_kind["stack"]
    order2 = _estimated("magcache", {"order": 2}, 1.5, "split", None).memory.by_kind["stack"]
    assert order2 == 3 * order0


@pytest.mark.parametrize("name", [n for n in ZOO if n not in READS_TENSOR_VALUES])
def test_estimate_equals_measured_on_the_zoo(name):
    """Transformer-only use: two calls per step named by call order (call0 / call1)."""
    entry = ZOO[name]
    method = ("fbcache", "taylorseer", "delta_dit")[sorted(ZOO).index(name) % 3]  # stack / module / block
    model = entry.make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(model, method, entry.make_inputs(0), branches=(None, None), num_steps=3)
        handle = dcache.apply(model, method, num_steps=3)
    try:
        with torch.no_grad():
            for step in range(3):
                for _ in range(2):
                    model(**entry.make_inputs(step))
        measured = handle.memory()
    finally:
        handle.remove()
    assert measured.peak_bytes > 0
    assert est.memory.peak_bytes == measured.peak_bytes
    assert est.memory.by_branch == measured.by_branch


def test_a_forward_that_reads_values_gets_a_teaching_error():
    entry = ZOO["hidream"]  # its MoE router counts tokens per expert (bincount): no meta kernel
    with pytest.raises(ValueError, match="cannot run on meta tensors.*handle.memory"):
        estimate(entry.make_model(), "fbcache", entry.make_inputs(0), branches=(None,), num_steps=3)


def test_ratio_floor_of_a_schedule_without_signals_is_its_measured_ratio(pipe):
    """fixed_interval decides from the step index alone: the simulated ratio is the run's ratio."""
    measured, stats = _measured(pipe, "fixed_interval", {"interval": 3}, 1.5, "split", None)
    est = _estimated("fixed_interval", {"interval": 3}, 1.5, "split", None)
    assert est.ratio_floor == pytest.approx(stats.compute_ratio, abs=1e-6)
    assert est.ratio_ceiling == pytest.approx(1.0)
    assert est.ratio_range == pytest.approx((est.ratio_floor, 1.0))  # a knob the user set is not swept
    swept = _estimated("fixed_interval", {}, 1.5, "split", None)  # interval 2 (default); the CLI sweeps 2..6
    # 5 steps, first and last computed: interval 2 computes steps 0, 2, 4 (0.6), interval >= 4 only 0 and 4 (0.4)
    assert swept.ratio_floor == pytest.approx(0.6) and swept.ratio_range == pytest.approx((0.4, 1.0))
