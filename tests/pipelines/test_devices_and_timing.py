"""Commands run on the best device by default and say so; a printed timing carries its spread, CPU time and
warnings."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dcache.pipelines import devices
from dcache.pipelines.cli import app
from dcache.pipelines.timing_checks import relative_spread, spread, timing_warnings


@pytest.mark.parametrize("cuda, mps, expected", [
    (True, True, ("cuda", "bfloat16")),  # CUDA first, in the dtype big DiTs are loaded in
    (False, True, ("mps", "float32")),
    (False, False, ("cpu", "float32")),
])
def test_auto_picks_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert devices.resolve_device("auto", "auto") == expected
    assert devices.resolve_device(None, None) == expected


def test_explicit_choices_are_kept_and_bad_dtypes_named():
    assert devices.resolve_device("cuda:1", "auto") == ("cuda:1", "bfloat16")
    assert devices.resolve_device("cpu", "bfloat16") == ("cpu", "bfloat16")
    with pytest.raises(ValueError, match="--dtype 'fp8' is not one of float32, bfloat16, float16"):
        devices.resolve_device("cpu", "fp8")


def test_spread_and_warnings_against_hand_computed_values():
    assert spread([0.31, 0.30, 0.42]) == {"min": 0.30, "median": 0.31, "max": 0.42, "repeats": 3}
    assert relative_spread([0.31, 0.30, 0.42]) == pytest.approx(0.12 / 0.31)
    quiet = timing_warnings({"uncached": [1.00, 1.02, 1.05], "cached": [0.50, 0.51]}, load=(0.9, 2))
    assert quiet == []  # spreads 5% and 2%, load 0.9 <= 2 / 2
    busy = timing_warnings({"uncached": [1.0, 1.3, 1.1], "cached": [0.5, 0.51]}, load=(3.0, 2))
    assert len(busy) == 2
    assert busy[0].startswith("uncached repeats disagree: 1.000-1.300 s, a spread of 27%")
    assert busy[1].startswith("load average 3.0 on 2 cores")


def test_generate_says_device_dtype_batch_spread_and_cpu_time(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", "--prompt", "3,seven", "--steps", "4", "--repeats", "2",
                                      "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["device"], stats["dtype"]) == devices.resolve_device("auto", "auto")  # no --device needed
    assert stats["batch_size"] == 2 and stats["prompts"] == ["3", "seven"]
    for variant in ("uncached", "cached"):
        s = stats[f"{variant}_seconds_spread"]
        assert s["repeats"] == 2 and s["min"] <= s["median"] == stats[f"{variant}_seconds"] <= s["max"]
    assert stats["cpu_speedup"] == pytest.approx(stats["uncached_cpu_seconds"] / stats["cached_cpu_seconds"])
    assert f"device       {stats['device']} (" in result.output
    assert "process CPU time" in result.output and "one call of the batch of 2 images" in result.output
    assert "[dcache] timing uncached vs cached" in result.output  # --no-progress: a line per stage
