"""benchmarks/transfer.py --quick on the bundled video model: every row measured against the uncached clips of the
same seeds, with the meter's compute ratio, and the table written with the exact command and "tuned on" column."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "transfer.py"


@pytest.mark.slow  # ~20 s on a busy 2-core CPU
def test_quick_transfer_rows_on_the_video_model(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("dcache_transfer_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--quick", "--models", "motion", "--steps", "4", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # the script pins its thread count

    rows = {r["contender"]: r for r in result["rows"]}
    assert set(rows) == {"cadence-2x (the default method)", "magcache at its defaults",
                         "fbcache (default threshold 0.08)"}
    for row in rows.values():
        assert "error" not in row, row
        assert 0.0 < row["compute_ratio"] <= 1.0 + 1e-9 and 0.0 <= row["accuracy"] <= 1.0
        assert row["restored_bit_identical"]  # removing the cache gives the uncached clips back exactly
    # fbcache at its default threshold reuses nothing in 4 steps on this model: every block ran, output unchanged
    fb = rows["fbcache (default threshold 0.08)"]
    assert fb["compute_ratio"] == pytest.approx(1.0) and math.isinf(fb["psnr"])
    # the default computes steps 0, 2 and the last of 4 on both branches, whatever the model
    assert rows["cadence-2x (the default method)"]["compute_ratio"] == pytest.approx(0.75)
    assert json.loads((tmp_path / "transfer.json").read_text())["rows"] == result["rows"]
    table = (tmp_path / "transfer.md").read_text()
    assert table.startswith("`python benchmarks/transfer.py --quick --models motion --steps 4")
    assert "| tuned on | measured on |" in table and "tiny-motion held-out seeds" in table
