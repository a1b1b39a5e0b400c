"""benchmarks/overhead.py: the achievable-speed-up arithmetic on known timings (no wall clock is asserted)."""

import pytest


@pytest.fixture(scope="module")
def overhead(load_benchmark):
    return load_benchmark("overhead")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def test_report_splits_time_into_floor_blocks_and_overhead(overhead):
    steps = overhead.STEPS
    # per generation: bare 10 ms/call, floor (no block compute) 1 ms/call -> 9 ms/call of block compute
    meta = {"t_bare": 10e-3 * steps, "t_floor": 1e-3 * steps, "rounds": 3, "torch": "x"}
    exact = overhead.Row("lib", "ideal-cache", "s", enable=None, ratio=0.5, times=[5.5e-3 * steps] * 3)
    slow = overhead.Row("lib", "slow-cache", "s", enable=None, ratio=0.5, times=[6.5e-3 * steps, 6.5e-3 * steps])
    lines = overhead.report(meta, [exact, slow])
    assert any("10.00 ms" in line for line in lines) and any("1.00 ms" in line and "10%" in line for line in lines)
    rows = {(_cells(line)[1]): _cells(line) for line in lines if line.startswith("| lib |")}
    # achievable time at r = 0.5: 1 + 0.5 * 9 = 5.5 ms -> speed-up 10 / 5.5 = 1.82; ideal 2.00
    cells = rows["ideal-cache"]
    assert cells[3:11] == ["0.500", "5.50", "+0.00", "1.82", "2.00", "1.82", "0.91", "1.00"]
    cells = rows["slow-cache"]
    assert cells[5] == "+1.00" and cells[10] == "0.85"  # 5.5 / 6.5


def test_bound_line_states_the_cap_at_ratio_03(overhead):
    meta = {"t_bare": 1.0, "t_floor": 0.2, "rounds": 1, "torch": "x"}
    line = next(text for text in overhead.report(meta, []) if "compute ratio 0.3" in text)
    # 1 / (0.2 + 0.3 * 0.8) = 2.27x; measured/ideal <= 0.3 * 2.27 = 0.68
    assert "2.27x" in line and "<= 0.68" in line


def test_memo_line_states_dcaches_cap_with_the_memoised_floor(overhead):
    meta = {"t_bare": 1.0, "t_floor": 0.2, "t_floor_memo": 0.1, "rounds": 1, "torch": "x"}
    line = next(text for text in overhead.report(meta, []) if "step-invariant memo" in text)
    # the blocks still cost 1 - 0.2 = 0.8; 1 / (0.1 + 0.3 * 0.8) = 2.94x; measured/ideal <= 0.3 * 2.94 = 0.88
    assert "10%" in line and "2.94x" in line and "<= 0.88" in line
