"""taylor_update / taylor_forecast: derivative tables for TaylorSeer and CG-Taylor, on both backends."""

import math

import pytest
import torch

from dcache.kernels import taylor_forecast, taylor_forecast_reference, taylor_update, taylor_update_reference


def test_update_recurrence_on_known_numbers(backend, device):
    # Values 1, 3, 9 pushed one step apart into an order-2 table:
    # d0 = 9, d1 = 9 - 3 = 6, d2 = 6 - (3 - 1) = 4; forecast 1 step ahead = 9 + 6 + 4 / 2 = 17.
    table = torch.full((3, 1, 2), float("nan"), device=device)
    filled = 0
    for value in (1.0, 3.0, 9.0):
        filled = taylor_update(table, torch.full((1, 2), value, device=device), 1, filled)
    assert filled == 3
    assert table[:, 0, 0].tolist() == [9.0, 6.0, 4.0]
    assert taylor_forecast(table, 1, filled).tolist() == [[17.0, 17.0]]
    assert taylor_forecast(table, 1, 2).tolist() == [[15.0, 15.0]]  # first order only


@pytest.mark.parametrize("order", [1, 2, 3])
def test_linear_features_are_forecast_exactly(backend, order, device, gen, rand, design_bound):
    # f(t) = a + b t sampled every 3 steps: every derivative above the first is 0, so the forecast
    # at any distance ahead is the straight line.
    a = rand((2, 77, 130), torch.float32, device, gen)
    b = rand((2, 77, 130), torch.float32, device, gen, scale=0.1)
    table = torch.empty(order + 1, 2, 77, 130, device=device)
    filled = 0
    for t in (0, 3, 6, 9):
        filled = taylor_update(table, a + b * t, 3, filled)
    for ahead in (1, 2.5):
        want = a + b * (9 + ahead)
        design_bound(taylor_forecast(table, ahead, filled), want, want, atol=1e-5)


# (table dtype, new / out dtype): the usual mix is an fp32 table fed with bf16 features.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]
PAIR_IDS = ["fp32", "fp32-table-bf16", "fp32-table-fp16", "bf16", "fp16"]


def check_update(shape, K, filled, table_dtype, new_dtype, device, gen, rand, design_bound):
    old = rand((K + 1, *shape), table_dtype, device, gen)
    new = rand(shape, new_dtype, device, gen)
    table = old.clone()
    got_filled = taylor_update(table, new, 3, filled)  # 1/3 is inexact: both backends round it alike
    assert got_filled == min(filled + 1, K + 1)

    same = old.clone()
    taylor_update_reference(same, new, 3, filled)
    ref32 = old.float()
    taylor_update_reference(ref32, new.float(), 3, filled)
    n_written = min(filled, K) + 1
    design_bound(table[:n_written], same[:n_written], ref32[:n_written], what="updated entries")
    assert torch.equal(table[n_written:], old[n_written:])  # entries past the valid ones are untouched


def check_forecast(shape, filled, ahead, table_dtype, out_dtype, device, gen, rand, design_bound):
    table = rand((3, *shape), table_dtype, device, gen)
    out = torch.empty(shape, dtype=out_dtype, device=device)
    got = taylor_forecast(table, ahead, filled, out=out)
    assert got is out
    same = taylor_forecast_reference(table, ahead, filled, out=torch.empty_like(out))
    ref32 = taylor_forecast_reference(table.float(), ahead, filled)
    # The result is a sum of terms: allow a rounding of the largest partial sum, sum_k |d_k| |ahead|^k / k!.
    scale = sum(table[k].float().abs() * abs(ahead) ** k / math.factorial(k) for k in range(filled))
    design_bound(got, same, ref32, scale=scale)


def test_update_matches_fp32_reference(backend, shape, dtype, device, gen, rand, design_bound):
    check_update(shape, 2, 3, dtype, dtype, device, gen, rand, design_bound)


def test_forecast_matches_fp32_reference(backend, shape, dtype, device, gen, rand, design_bound):
    check_forecast(shape, 3, 1.5, dtype, dtype, device, gen, rand, design_bound)


@pytest.mark.parametrize("K,filled", [(0, 0), (1, 1), (2, 1), (2, 3), (4, 4)])
@pytest.mark.parametrize("table_dtype,new_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
def test_update_orders_and_dtype_mixes(backend, K, filled, table_dtype, new_dtype, device, gen, rand, design_bound):
    check_update((3, 333, 64), K, filled, table_dtype, new_dtype, device, gen, rand, design_bound)


@pytest.mark.parametrize("filled", [1, 3])
@pytest.mark.parametrize("ahead", [0, 2.5, -1])
@pytest.mark.parametrize("table_dtype,out_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
def test_forecast_orders_and_dtype_mixes(backend, filled, ahead, table_dtype, out_dtype, device, gen, rand,
                                         design_bound):
    check_forecast((1, 77, 130), filled, ahead, table_dtype, out_dtype, device, gen, rand, design_bound)


def test_forecast_default_out_has_table_dtype(backend, device, gen, rand, design_bound):
    table = rand((2, 1, 1, 1), torch.bfloat16, device, gen)
    got = taylor_forecast(table, 1.0, 2)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, 1)
    design_bound(got, taylor_forecast_reference(table, 1.0, 2), taylor_forecast_reference(table.float(), 1.0, 2),
                 scale=table[0].float().abs() + table[1].float().abs())


@pytest.mark.parametrize("call,message", [
    (lambda t, n: taylor_update(t, n, 0, 0), "dist"),
    (lambda t, n: taylor_update(t, n, float("inf"), 0), "dist"),
    (lambda t, n: taylor_update(t, n, 1, 4), "filled"),
    (lambda t, n: taylor_update(t, n, 1, -1), "filled"),
    (lambda t, n: taylor_update(t, n[:, :3], 1, 0), "entries of shape"),
    (lambda t, n: taylor_update(t.transpose(1, 2), n.transpose(0, 1), 1, 0), "contiguous"),
    (lambda t, n: taylor_update(t.double(), n, 1, 0), "dtype"),
    (lambda t, n: taylor_forecast(t, 1, 0), "filled"),
    (lambda t, n: taylor_forecast(t, "1", 1), "dist_ahead"),
    (lambda t, n: taylor_forecast(t, 1, 1, out=torch.empty(4, 6, device=t.device)), "shape"),
    (lambda t, n: taylor_forecast(t[0, 0, 0], 1, 1), "K >= 0"),
])
def test_bad_inputs_raise_value_error(backend, call, message, device):
    table = torch.zeros(3, 4, 5, device=device)
    with pytest.raises(ValueError, match=message):
        call(table, torch.zeros(4, 5, device=device))
