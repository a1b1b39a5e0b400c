"""Forecasters beyond Taylor (dcache.schedules.forecasters) against closed forms.

References: analytic histories where a forecaster is exact (a quadratic at uneven steps for FoCa, Spectrum and HyCa;
linear dynamics for DMD; a history proportional to one tensor for L2P), the uncached toy transformer
(tests/toy_models.py) whose every residual and call Delta is b * t(s) with t quadratic in the step, and each
forecaster applied by hand to the uncached Deltas."""

from __future__ import annotations

import warnings

import pytest
import toy_models as toy
import torch

import dcache
from dcache.generations.health import DCacheHealthWarning
from dcache.plans.plan import PlanError
from dcache.schedules.forecasters import FORECASTERS, build_forecaster
from dcache.schedules.forecasters.dmd import matrix_power
from dcache.runtime.cache_state import UnitHistory

EXACT_ON_QUADRATICS = [{"name": "foca", "calibration": 1.0}, {"name": "spectrum", "ridge": 0.0, "window": 6},
                       {"name": "hyca", "max_order": 2}]
ALL = ["foca", "spectrum", "hyca", "dmd"]


def _quadratic(shape=(2, 5, 3), seed=0):
    c = torch.randn(3, *shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return lambda s: c[0] + c[1] * s + c[2] * s * s


@pytest.mark.parametrize("spec", EXACT_ON_QUADRATICS)
def test_polynomial_forecasters_are_exact_on_a_quadratic_at_uneven_steps(spec):
    f = build_forecaster(spec)
    trend = _quadratic()
    steps = [0.0, 3.0, 4.0, 8.0, 9.0, 13.0][-f.depth:]
    for target in (14.0, 16.5, 20.0):
        got = f.extrapolate(steps, [trend(s) for s in steps], target)
        torch.testing.assert_close(got, trend(target), rtol=1e-9, atol=1e-9)


def test_the_engine_taylor_table_is_not_exact_there():
    # the reason for the forecasters above: the table divides by the last gap only, so uneven steps break it
    trend = _quadratic()
    hist = UnitHistory(2)
    for s in (0, 3, 4, 8, 9, 13):
        hist.update([trend(float(s))], s)
    err = (hist.forecast(16)[0] - trend(16.0)).abs().max()
    assert err > 1e-2


def test_foca_without_the_corrector_is_the_tangent_line():
    trend = _quadratic()
    steps, target = [2.0, 5.0, 6.0], 10.0
    slope_at_6 = (trend(6.0 + 1e-3) - trend(6.0 - 1e-3)) / 2e-3
    got = build_forecaster({"name": "foca", "calibration": 0.0}).extrapolate(steps, [trend(s) for s in steps], target)
    torch.testing.assert_close(got, trend(6.0) + 4.0 * slope_at_6, rtol=1e-6, atol=1e-6)
    assert (got - trend(target)).abs().max() > 1e-2  # the curvature term it leaves out


def test_spectrum_ridge_trades_exactness_for_a_bounded_shrinkage():
    trend = _quadratic()
    steps = [0.0, 4.0, 8.0, 12.0, 16.0, 20.0]
    f = build_forecaster({"name": "spectrum", "ridge": 1e-3, "window": 6})
    f.num_steps = 28  # the step axis [0, 27] maps onto [-1, 1]
    exact = trend(24.0)
    err = (f.extrapolate(steps, [trend(s) for s in steps], 24.0) - exact).abs().max()
    assert 0 < err < 0.05 * exact.abs().max()


def test_hyca_serves_reuse_where_extrapolation_amplifies_jitter():
    # per element: channel 0 jitters around a level (+-eps), channel 1 is a line, channel 2 a parabola
    eps, steps = 0.01, [0.0, 1.0, 2.0, 3.0, 4.0]

    def value(s):
        return torch.tensor([[5.0 + eps * (-1) ** int(s), 1.0 + 2.0 * s, 0.5 * s * s]], dtype=torch.float64)

    values = [value(s) for s in steps]
    target, truth = 5.0, torch.tensor([[5.0 - eps, 11.0, 12.5]], dtype=torch.float64)
    got = build_forecaster({"name": "hyca", "max_order": 2}).extrapolate(steps, values, target)
    torch.testing.assert_close(got[:, 1:], truth[:, 1:], rtol=1e-9, atol=1e-9)  # line and parabola: exact
    quadratic = build_forecaster({"name": "spectrum", "ridge": 0.0, "window": 3}).extrapolate(steps[-3:],
                                                                                               values[-3:], target)
    assert abs(float(got[0, 0] - truth[0, 0])) <= 2 * eps + 1e-12  # reuse: one jitter swing
    assert abs(float(quadratic[0, 0] - truth[0, 0])) >= 6 * eps  # a parabola through jitter overshoots


def _linear_dynamics(batch=2, dim=40, seed=1):
    """x_k = a + Q [r^k cos(w k), r^k sin(w k)] per sample: a level plus a damped rotation (3 modes)."""
    g = torch.Generator().manual_seed(seed)
    level = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    q = torch.randn(batch, dim, 2, generator=g, dtype=torch.float64)
    r = 0.93 - 0.1 * torch.arange(batch, dtype=torch.float64)  # per sample: its own decay and frequency
    w = 0.35 - 0.1 * torch.arange(batch, dtype=torch.float64)

    def at(k: float) -> torch.Tensor:
        osc = torch.stack([r ** k * torch.cos(w * k), r ** k * torch.sin(w * k)], dim=1)  # [B, 2]
        return level + (q @ osc.unsqueeze(2)).squeeze(2)

    return at


def test_dmd_is_exact_on_linear_dynamics_at_integer_and_fractional_horizons():
    at = _linear_dynamics()
    f = build_forecaster({"name": "dmd", "window": 5})
    steps = [0.0, 2.0, 4.0, 6.0, 8.0]  # h = 2
    values = [at(s) for s in steps]
    for target in (10.0, 11.0, 13.0):
        torch.testing.assert_close(f.extrapolate(steps, values, target), at(target), rtol=1e-7, atol=1e-7)
    taylor = build_forecaster({"name": "foca", "calibration": 1.0}).extrapolate(steps, values, 13.0)
    assert (taylor - at(13.0)).abs().max() > 1e-3  # a polynomial does not follow the rotation


def test_dmd_fractional_power_of_a_polynomial_trend_is_exact():
    # a quadratic is a linear recurrence with a defective (Jordan) operator: the binomial series handles it
    a = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    half = matrix_power(a, 0.5)
    torch.testing.assert_close(half @ half, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", ["hyca", "dmd"])
def test_a_sample_forecast_does_not_depend_on_its_batch(spec):
    at = _linear_dynamics(batch=3)
    f = build_forecaster(spec)
    steps = [0.0, 1.0, 2.0, 3.0, 4.0][-f.depth:]
    values = [at(s) for s in steps]
    together = f.extrapolate(steps, values, 6.0)
    alone = f.extrapolate(steps, [v[1:2] for v in values], 6.0)
    torch.testing.assert_close(together[1:2], alone, rtol=0, atol=1e-12)


def test_unit_history_keeps_copies_of_the_last_depth_values():
    hist = UnitHistory(0, depth=3)
    buffer = torch.zeros(2)
    for s in range(5):
        buffer.fill_(float(s))  # an order-0 table is written in place; the samples must not follow
        hist.update([buffer], s)
    assert [s for s, _ in hist.samples] == [2, 3, 4]
    assert [float(v[0][0]) for _, v in hist.samples] == [2.0, 3.0, 4.0]
    hist.update([torch.zeros(3)], 5)  # another shape: a new trajectory
    assert [s for s, _ in hist.samples] == [5]
    assert UnitHistory(1).samples == [] and UnitHistory(1).nbytes == 0


def _quadratic_toy(b: float = 0.7) -> toy.ToyTransformer:
    """Every block adds b * t, no attention term: with a constant input every residual, module output and call Delta
    is b * t (times the block count), so with t = 1 + c s^2 each is a quadratic in the step."""
    model = toy.ToyTransformer(joint=(0.0, 0.0, 0.0), single=(0.0, 0.0, 0.0))
    for block in model.blocks():
        block.ff.b = b
    return model


def _generate(model, timesteps, method=None, **apply):
    inputs = toy.toy_inputs(0, len(timesteps))
    handle = dcache.apply(model, method, num_steps=len(timesteps), **apply) if method else None
    try:
        with torch.no_grad():
            return [model(**{**inputs, "timestep": torch.tensor([t], dtype=torch.float64)}).double()
                    for t in timesteps]
    finally:
        if handle is not None:
            handle.remove()


QUADRATIC_T = [1.0 + 0.01 * s * s for s in range(14)]
# steps 0, 1, 2, 3 (4 values: every forecaster has its full window, HyCa all three solvers), then 7 and 11
KEYFRAMES = (0.0, 1 / 13, 2 / 13, 3 / 13, 7 / 13, 11 / 13)


@pytest.mark.parametrize("spec", EXACT_ON_QUADRATICS)
@pytest.mark.parametrize("setting", [
    ("keyframe", {"scope": "call", "keyframes": KEYFRAMES, "order": 1}),
    ("keyframe", {"scope": "blocks", "keyframes": KEYFRAMES, "order": 1}),
    ("taylorseer", {"granularity": "block", "interval": 3, "warmup_steps": 4, "order": 1}),
    ("taylorseer", {"granularity": "module", "interval": 3, "warmup_steps": 4, "order": 1}),
    ("fixed_interval", {"scope": "call", "interval": 3, "warmup_steps": 4, "cutoff_steps": 0, "forecast_order": 1}),
    ("seacache", {"scope": "call", "gate": False, "max_consecutive": 2, "retention_steps": 4, "order": 1}),
], ids=["keyframe-call", "keyframe-stack", "taylorseer-block", "taylorseer-module", "fixed-interval-call",
        "seacache-call"])
def test_forecasting_schedules_serve_the_forecaster_exactly_on_every_unit_kind(spec, setting):
    method, overrides = setting
    model = _quadratic_toy()
    reference = _generate(model, QUADRATIC_T)
    cached = _generate(model, QUADRATIC_T, method, forecaster=spec, **overrides)
    for out, ref in zip(cached, reference):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    taylor = _generate(model, QUADRATIC_T, method, **overrides)  # order 1 Taylor is not exact here
    assert max(float((t - r).abs().max()) for t, r in zip(taylor, reference)) > 1e-3


@pytest.mark.parametrize("spec", ALL)
def test_call_scope_serves_x_plus_the_forecast_of_the_computed_deltas(spec):
    # keyframes 0, 1, 3, 5, 8 of 12 (uneven): every other step is x + f(history of Delta), f applied here by hand
    model = _quadratic_toy()
    n, keyframes = 12, (0.0, 1 / 11, 3 / 11, 5 / 11, 8 / 11)
    u = [s / n for s in range(n)]
    timesteps = [1.0 - 0.5 * a + 0.3 * a * a - 0.2 * a ** 3 for a in u]  # a falling cubic: no forecaster is exact
    reference = _generate(model, timesteps)
    x = toy.toy_inputs(0, n)["hidden_states"].double()
    cached = _generate(model, timesteps, "keyframe", scope="call", keyframes=keyframes, order=2, forecaster=spec)
    f = build_forecaster(spec)
    f.num_steps = n
    computed = [0, 1, 3, 5, 8]
    for s in range(n):
        if s in computed:
            torch.testing.assert_close(cached[s], reference[s])
            continue
        history = [k for k in computed if k < s][-f.depth:]
        if len(history) < f.min_samples:
            continue  # the Taylor table serves while the window fills
        expected = x + f.extrapolate([float(k) for k in history], [reference[k] - x for k in history], float(s))
        torch.testing.assert_close(cached[s], expected, rtol=1e-4, atol=1e-4)


def test_the_forecaster_knob_names_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"KeyframeConfig\.forecaster='spectrm' is invalid: it must be a forecaster "
                                         r"name .* is not a forecaster\. Did you mean 'spectrum'"):
        dcache.config_for("keyframe", forecaster="spectrm")
    with pytest.raises(ValueError, match=r"no setting\(s\) 'calib'\. Did you mean 'calibration'"):
        dcache.config_for("taylorseer", forecaster={"name": "foca", "calib": 0.5})
    with pytest.raises(ValueError, match=r"TaylorSeerConfig\.forecaster=.* is invalid: .*forecaster\.window=1 must be "
                                         r"in \[3, 16\]"):
        dcache.config_for("taylorseer", forecaster={"name": "dmd", "window": 1})
    with pytest.raises(ValueError, match="'taylor' takes no settings"):
        dcache.config_for("keyframe", forecaster={"name": "taylor", "order": 2})
    config = dcache.config_for("keyframe", forecaster={"name": "spectrum", "degree": 3})
    assert dcache.config_from_dict(config.to_dict()) == config  # JSON round trip


def test_plans_carry_a_forecaster_in_their_extras_and_refuse_bad_ones():
    from dcache.runtime.forecast import forecaster_from_plan

    class FakePlan:
        extras = {"forecaster": {"name": "hyca", "backtests": 3}}

    forecaster = forecaster_from_plan(FakePlan())
    assert forecaster.to_extras() == {"name": "hyca", "max_order": 1, "backtests": 3}
    assert forecaster.depth == 1 + 1 + 3
    FakePlan.extras = {"forecaster": {"name": "hyca", "backtests": 0}}
    with pytest.raises(PlanError, match=r"extras\.forecaster'\.backtests=0 must be in \[1, 8\]"):
        forecaster_from_plan(FakePlan())


def test_every_registered_forecaster_is_documented_with_its_paper_and_use():
    import inspect

    for name, cls in FORECASTERS.items():
        doc = inspect.getmodule(cls).__doc__
        assert "arxiv.org" in doc or "Schmid" in doc, name
        assert "When it helps" in doc and "Memory" in doc, name


@pytest.mark.parametrize("method, overrides", [
    ("taylorseer", {"granularity": "block", "interval": 3, "warmup_steps": 4, "forecaster": "dmd"}),
    ("keyframe", {"scope": "call", "keyframes": KEYFRAMES, "forecaster": {"name": "spectrum", "degree": 1}}),
])
def test_an_exported_run_replays_its_forecasts_bit_exactly(method, overrides):
    model = _quadratic_toy()
    timesteps = [1.0 - 0.05 * s - 0.002 * s ** 3 for s in range(14)]  # a cubic: the forecasts are not exact
    inputs = toy.toy_inputs(0, len(timesteps))

    def generate():
        with torch.no_grad():
            return [model(**{**inputs, "timestep": torch.tensor([t])}) for t in timesteps]

    with dcache.apply(model, method, num_steps=len(timesteps), **overrides) as handle:
        first = generate()
    plan = handle.plan()
    assert plan.extras["forecaster"] == build_forecaster(overrides["forecaster"]).to_extras()
    with dcache.apply(model, plan, num_steps=len(timesteps)):
        replay = generate()
    assert all(torch.equal(a, b) for a, b in zip(first, replay))
    with dcache.apply(model, method, num_steps=len(timesteps), **{**overrides, "forecaster": "taylor"}):
        taylor = generate()
    assert not all(torch.equal(a, b) for a, b in zip(first, taylor))  # the forecaster really served the run


def test_cache_memory_counts_the_forecaster_window_from_the_first_step():
    # dcache.memory.estimate and the memory budget read the bytes after one call: the window's peak must show there
    hist = UnitHistory(1, depth=4)
    x = torch.zeros(3, 5)
    hist.update([x], 0)
    one = x.numel() * x.element_size()
    assert hist.nbytes == (2 + 4) * one  # the order-1 table (2 rows) + 4 kept values
    for s in range(1, 6):
        hist.update([x + s], s)
    assert hist.nbytes == (2 + 4) * one and len(hist.samples) == 4


FITTED = ["hyca", "dmd", {"name": "hyca", "max_order": 3, "backtests": 2}, {"name": "dmd", "rank": 1, "window": 5}]


@pytest.mark.parametrize("spec", FITTED, ids=lambda s: s if isinstance(s, str) else "-".join(map(str, s.values())))
def test_a_fit_is_made_once_per_computed_value_and_every_forecast_until_the_next_is_what_a_fresh_one_gives(spec,
                                                                                                         monkeypatch):
    # HyCa's backtests and DMD's Gram matrices depend on the kept values only: the forecasts between two computed
    # steps share one fit per stream (kept in hist.fitted), and a new computed value makes a new one
    f = build_forecaster(spec)
    fits = []
    fit = type(f).fit
    monkeypatch.setattr(type(f), "fit", lambda self, steps, values: (fits.append(steps) if self is f else None,
                                                                     fit(self, steps, values))[1])
    at = _linear_dynamics(batch=2)
    hist = UnitHistory(1, depth=f.depth)

    def fresh(target):  # a new forecaster on the same values: nothing kept from before
        steps = [float(s) for s, _ in hist.samples]
        return [build_forecaster(spec).extrapolate(steps, [v[i] for _, v in hist.samples], float(target))
                for i in range(2)]

    computed = list(range(f.depth))
    for s in computed:
        hist.update([at(float(s)), 2.0 * at(float(s)) + 1.0], s)  # two streams (hidden, encoder)
    for target in (f.depth, f.depth + 1, f.depth + 3):
        for got, want in zip(f(hist, target), fresh(target)):
            assert torch.equal(got, want)
    assert len(fits) == 2  # one per stream, for three forecast steps
    hist.update([at(7.0), 2.0 * at(7.0) + 1.0], 7)
    for target in (8, 9):
        for got, want in zip(f(hist, target), fresh(target)):
            assert torch.equal(got, want)
    assert len(fits) == 4 and fits[-1][-1] == 7.0


def test_hycas_choice_is_the_first_smallest_backtest_error_per_element():
    # reference: every candidate's backtest error stacked, argmin over the candidates (the first on ties); values on a
    # coarse grid so that many elements tie (a constant stretch: every solver is exact there)
    from dcache.schedules.forecasters.hyca import solver_forecast

    g = torch.Generator().manual_seed(3)
    steps = [0.0, 2.0, 3.0, 5.0, 8.0, 9.0]
    values = [torch.randint(0, 3, (4, 50), generator=g).float() for _ in steps]
    values = [torch.where(torch.arange(50) < 10, torch.ones(4, 50), v) for v in values]
    f = build_forecaster({"name": "hyca", "max_order": 3, "backtests": 2})
    orders, choice = f.fit(steps, values)
    errors = [sum((solver_forecast(p, steps[:j], values[:j], steps[j]) - values[j]).abs() for j in (4, 5))
              for p in orders]
    assert orders == [0, 1, 2, 3] and choice.dtype == torch.uint8
    assert torch.equal(choice.long(), torch.stack(errors).argmin(dim=0))
    assert (choice[:, :10] == 0).all()  # ties: the lowest order


def test_hycas_per_element_choice_is_counted_in_the_cache_memory_from_the_first_step():
    # the choice (one byte per element) is kept from the first forecast after a computed value; a memory estimate
    # after one call (dcache.memory.estimate, the memory budget) must already see it, as it sees the window's peak
    from dcache.runtime.cache_state import BranchState
    from dcache.runtime.forecast import history_fit_bytes

    hyca = build_forecaster("hyca")
    schedule = dcache.config_for("keyframe", forecaster="hyca").build(_quadratic_toy())
    assert history_fit_bytes(schedule) == hyca.fit_bytes == 1
    assert history_fit_bytes(dcache.config_for("keyframe", forecaster="dmd").build(_quadratic_toy())) == 0
    hist = BranchState(depth=hyca.depth, fit_bytes=hyca.fit_bytes).history("stack", 1)
    x = torch.zeros(3, 5)
    hist.update([x], 0)
    one = x.numel() * x.element_size()
    expected = (2 + hyca.depth) * one + x.numel()  # the order-1 table, the window, the choice
    assert hist.nbytes == expected
    for s in range(1, 3):
        hist.update([x + s * s], s)
    hyca(hist, 4)
    assert hist.fitted and hist.nbytes == expected


def test_the_engine_counts_hycas_choice_in_the_cache_bytes_it_reports():
    # HyCa and FoCa keep the same window (3 values); HyCa's fit adds one byte per element of the cached Delta
    model = _quadratic_toy()
    inputs = toy.toy_inputs(0, len(QUADRATIC_T))
    peak = {}
    for name in ("foca", "hyca"):
        with dcache.apply(model, "keyframe", num_steps=len(QUADRATIC_T), scope="call", keyframes=KEYFRAMES,
                          forecaster=name) as handle, torch.no_grad():
            for t in QUADRATIC_T:
                out = model(**{**inputs, "timestep": torch.tensor([t], dtype=torch.float64)})
            peak[name] = handle.stats().cache_bytes
    assert peak["hyca"] - peak["foca"] == out.numel()


def test_a_low_precision_cache_serves_the_forecaster_its_full_precision_window():
    # cache_dtype stores the Taylor table in bfloat16 (dcache.memory.cache_codec.CodedHistory); the forecaster's window
    # stays in the compute dtype and reaches it through hist.plain()
    from dcache.memory.cache_codec import CacheCodec
    from dcache.runtime.cache_state import BranchState

    hist = BranchState(codec=CacheCodec(torch.bfloat16), depth=3).history("stack", 1)
    trend = _quadratic()
    for s in (0, 3, 4):
        hist.update([trend(float(s))], s)
    f = build_forecaster({"name": "foca", "calibration": 1.0})
    torch.testing.assert_close(f(hist.plain(), 7)[0], trend(7.0), rtol=1e-9, atol=1e-9)
    assert (hist.forecast(7)[0].double() - trend(7.0)).abs().max() > 1e-3  # the bfloat16 table is not exact
    hyca = build_forecaster("hyca")
    hyca(hist.plain(), 7)  # each read decodes a new view; the fit made through it stays with the history
    assert list(hist.fitted) == [(hyca, 0)]
    hist.update([trend(5.0)], 5)
    assert hist.fitted == {}


# ------------------------------------------------------------------------------------------------ L2P
def test_l2p_fitted_on_a_run_is_exact_where_no_polynomial_in_the_step_is():
    """Every call Delta of the toy is t(s) V (one tensor V): with t a falling cubic of the step no polynomial
    extrapolation in s is exact, but Delta(t) = (t(s_t) / t(s_k)) Delta(s_k) is linear in the history with scalar
    weights, which the least-squares fit finds from one recorded run."""
    from dcache.schedules.tuning.l2p_fit import fit_l2p

    model = _quadratic_toy()
    n, keyframes = 12, (0.0, 1 / 11, 3 / 11, 5 / 11, 8 / 11)
    u = [s / n for s in range(n)]
    timesteps = [1.0 - 0.5 * a + 0.3 * a * a - 0.2 * a ** 3 for a in u]
    reference = _generate(model, timesteps)
    spec = fit_l2p(model, [lambda: _generate(model, timesteps)], "keyframe", keyframes=keyframes, window=3,
                   ridge=0.0, num_steps=n, progress=False)
    assert spec["fitted_steps"] == n and len(spec["weights"]) == n - 1  # every step after the first:
    # the forecasts, and the computed ones (cfg_difference checks the forecasts there)
    cached = _generate(model, timesteps, "keyframe", scope="call", keyframes=keyframes, order=2, forecaster=spec)
    for out, ref in zip(cached, reference):  # exact up to the toy's float32 arithmetic
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    taylor = _generate(model, timesteps, "keyframe", scope="call", keyframes=keyframes, order=2)
    assert max(float((t - r).abs().max()) for t, r in zip(taylor, reference)) > 1e-3


def test_l2p_statistics_of_any_placement_come_from_one_recording():
    """delta_grams records the runs once; l2p_statistics(grams=...) then gives every placement's G and g from the
    Gram matrices with one cadence run each, equal to the definition G_ij = sum <Delta(s_i), Delta(s_j)>,
    g_i = sum <Delta(s_i), Delta(t)> over the recorded Deltas (here a toy whose Deltas change with the step)."""
    from dcache.schedules.tuning.l2p_fit import _RecordEveryCall, delta_grams, l2p_statistics

    model = _quadratic_toy()
    n = 10
    timesteps = [1.0 - 0.5 * a + 0.3 * a * a - 0.2 * a ** 3 for a in (s / n for s in range(n))]  # falling
    calls = []

    def run():
        calls.append(1)
        return _generate(model, timesteps)

    recorder = _RecordEveryCall()
    with dcache.apply(model, recorder, scope="call", num_steps=n):
        run()
    deltas = {step: delta.flatten().double() for step, delta in recorder.trajectories[0]}
    calls.clear()
    grams = delta_grams(model, [run, run], progress=False, num_steps=n)
    assert len(calls) == 2 and [steps for steps, _, _ in grams] == [list(range(n))] * 2
    for keyframes in ((0.0, 3 / 9, 6 / 9), (0.0, 2 / 9, 5 / 9, 8 / 9)):
        calls.clear()
        stats = l2p_statistics(model, [run, run], "keyframe", keyframes=keyframes, window=2, order=1,
                               num_steps=n, progress=False, grams=grams)
        assert len(calls) == 1  # the cadence only
        assert len(stats["pairs"]) == n - 1  # the forecasts and the computed steps after the first
        for key, (t, history) in stats["pairs"].items():
            h = torch.stack([deltas[s] for s in history])
            gram, cross = stats["sums"][key]
            torch.testing.assert_close(gram, 2 * (h @ h.T), rtol=1e-12, atol=0)  # two identical runs
            torch.testing.assert_close(cross, 2 * (h @ deltas[t]), rtol=1e-12, atol=0)


def test_l2p_auto_ridge_keeps_the_run_closest_to_uncached():
    """choose_ridge scores each ridge by the relative squared error of what the cached run returns (here every step's
    output) against the uncached run (recomputed here by serving each table); on the cubic toy plain least squares is
    exact, so it wins, and fit_l2p(ridge="auto") returns the table of the best of AUTO_RIDGES."""
    from dcache.schedules.tuning.l2p_fit import AUTO_RIDGES, choose_ridge, fit_l2p, l2p_statistics, solve_l2p

    model = _quadratic_toy()
    n, keyframes = 12, (0.0, 1 / 11, 3 / 11, 5 / 11, 8 / 11)
    timesteps = [1.0 - 0.5 * a + 0.3 * a * a - 0.2 * a ** 3 for a in (s / n for s in range(n))]
    run = lambda: _generate(model, timesteps)  # noqa: E731
    stats = l2p_statistics(model, [run], "keyframe", keyframes=keyframes, window=3, order=2, num_steps=n,
                           progress=False)
    ridge, errors = choose_ridge(model, run, stats, "keyframe", ridges=(1e3, 1.0, 0.0), keyframes=keyframes,
                                 num_steps=n, progress=False)
    reference = run()

    def served_error(spec: dict) -> float:  # relative squared error of the run served with this table
        cached = _generate(model, timesteps, "keyframe", scope="call", keyframes=keyframes, order=2, forecaster=spec)
        return sum(float((c - f).square().sum()) for c, f in zip(cached, reference)) / sum(
            float(f.square().sum()) for f in reference)

    for r, error in errors.items():
        assert error == pytest.approx(served_error(solve_l2p(stats, r)), rel=1e-6, abs=1e-15)
    assert ridge == 0.0 and errors[0.0] < 1e-10 < errors[1.0] < errors[1e3]
    auto = fit_l2p(model, [run], "keyframe", keyframes=keyframes, window=3, ridge="auto", num_steps=n, progress=False)
    _, auto_errors = choose_ridge(model, run, stats, "keyframe", ridges=AUTO_RIDGES, keyframes=keyframes,
                                  num_steps=n, progress=False)
    ranked = sorted(auto_errors.values())
    assert ranked[1] > 10 * ranked[0]  # a clear winner on this toy (plain least squares: the toy is exact for it)
    # fit_l2p recomputes the statistics (float64 sums whose rounding can follow the BLAS thread count), and the
    # toy's history is rank-deficient (every Delta is t(s) V), so the least-squares weights are not unique: compare
    # what the table serves, not its numbers. The auto table serves the winner's error, not another ridge's.
    assert served_error(auto) < ranked[1] / 10
    with pytest.raises(ValueError, match="'auto'"):
        fit_l2p(model, [run], "keyframe", keyframes=keyframes, ridge="best", num_steps=n, progress=False)
    with pytest.raises(ValueError, match="output_type='pt'"):  # a run that returns no sample cannot be scored
        choose_ridge(model, lambda: None, stats, "keyframe", keyframes=keyframes, num_steps=n, progress=False)


def test_l2p_fit_never_fits_the_calibration_data_worse_than_taylor():
    """J(w) = sum |sum_k w_k D(s_k) - D(t)|^2 over the recorded runs: the ridge solution towards the Taylor weights p
    has J(w*) + lam |w* - p|^2 <= J(p), so J(w*) <= J(p) for every lambda; lambda -> inf gives p back."""
    from dcache.schedules.tuning.l2p_fit import _taylor_weights, solve_l2p

    generator = torch.Generator().manual_seed(0)
    basis = torch.randn(4, 50, dtype=torch.float64, generator=generator)
    steps, t = [0, 3, 6], 8
    gram, cross = torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for _ in range(3):  # three runs of a trajectory that no fixed weights reproduce exactly
        coefficients = torch.randn(10, 4, dtype=torch.float64, generator=generator)
        values = {s: coefficients[s] @ basis for s in (*steps, t)}
        history = torch.stack([values[s] for s in steps])
        gram += history @ history.T
        cross += history @ values[t]
    stats = {"pairs": {"8|0,3,6": (t, steps)}, "sums": {"8|0,3,6": (gram, cross)}, "num_steps": 10, "window": 3,
             "order": 2}
    prior = torch.tensor(_taylor_weights(steps, t, 2), dtype=torch.float64)

    def loss(w):  # J(w) up to the constant sum |D(t)|^2
        return float(w @ gram @ w - 2 * w @ cross)

    for ridge in (0.0, 0.01, 1.0):
        w = torch.tensor(solve_l2p(stats, ridge)["weights"]["8|0,3,6"], dtype=torch.float64)
        assert loss(w) <= loss(prior) + 1e-9
    far = torch.tensor(solve_l2p(stats, 1e9)["weights"]["8|0,3,6"], dtype=torch.float64)
    torch.testing.assert_close(far, prior, rtol=1e-6, atol=1e-6)


def test_l2p_serves_taylor_where_its_table_has_no_entry():
    from dcache.schedules.forecasters.l2p import L2PForecaster

    class History:  # what the engine hands a forecaster: the last computed values and its own Taylor table
        samples = [(0, [torch.ones(3)]), (2, [2 * torch.ones(3)])]

        def forecast(self, step):
            return [torch.full((3,), -1.0)]

    f = L2PForecaster(weights={"4|0,2": [0.5, 1.5]}, window=2, fitted_steps=10)
    f.num_steps = 10
    torch.testing.assert_close(f(History(), 4)[0], torch.full((3,), 3.5))  # 0.5 * 1 + 1.5 * 2
    with pytest.warns(DCacheHealthWarning, match=r"no weights for the forecast at step 5 .*'5\|0,2'.*refit"):
        assert f(History(), 5)[0].tolist() == [-1.0] * 3  # no entry for step 5: Taylor
    f.num_steps = 20  # another step count than the table's: Taylor everywhere
    assert f(History(), 4)[0].tolist() == [-1.0] * 3
    assert (f.served, f.fallbacks) == (1, 2)


def test_an_l2p_table_that_cannot_serve_says_so_once():
    """Fitted at 12 steps on one placement: a generation at 14 steps, or with other keyframes, is served by Taylor
    (the same images as without the table) and a DCacheHealthWarning names why and the fix, once per forecaster;
    the fitted setting serves from the table without a warning."""
    from dcache.schedules.tuning.l2p_fit import fit_l2p

    model = _quadratic_toy()
    n, keyframes = 12, (0.0, 1 / 11, 3 / 11, 5 / 11, 8 / 11)
    timesteps = [1.0 - 0.5 * a + 0.3 * a * a - 0.2 * a ** 3 for a in (s / n for s in range(n))]
    spec = fit_l2p(model, [lambda: _generate(model, timesteps)], "keyframe", keyframes=keyframes, window=3,
                   ridge=0.0, num_steps=n, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DCacheHealthWarning)
        _generate(model, timesteps, "keyframe", scope="call", keyframes=keyframes, order=2, forecaster=spec)
    longer = [1.0 - 0.5 * a + 0.3 * a * a - 0.2 * a ** 3 for a in (s / (n + 2) for s in range(n + 2))]
    for steps, frames, reason in ((longer, keyframes, r"fitted at 12 steps and this generation has 14 steps"),
                                  (timesteps, (0.0, 1 / 11, 2 / 11, 6 / 11), r"fitted for another placement")):
        with pytest.warns(DCacheHealthWarning, match=reason) as said:
            served = _generate(model, steps, "keyframe", scope="call", keyframes=frames, order=2, forecaster=spec)
        assert len([w for w in said if issubclass(w.category, DCacheHealthWarning)]) == 1
        taylor = _generate(model, steps, "keyframe", scope="call", keyframes=frames, order=2)
        assert all(torch.equal(a, b) for a, b in zip(served, taylor))


@pytest.mark.parametrize("weights", [{"4|0,2": [1.0]}, {"4|2,0": [1.0, 1.0]}, {"2|0,2": [1.0, 1.0]},
                                     {"4|0,2": [1.0, float("nan")]}, {"4|0,x": [1.0, 1.0]}, {"4": [1.0]},
                                     {"4|0,2": [True, 1.0]}, {"9|0,1,2,3": [1.0] * 4}])
def test_a_bad_l2p_table_names_the_entry_and_the_fix(weights):
    with pytest.raises(ValueError, match=r"forecaster\.weights\[.*is not an entry of an L2P table.*refit"):
        build_forecaster({"name": "l2p", "window": 3, "weights": weights})
