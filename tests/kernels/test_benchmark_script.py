"""benchmarks/kernels.py runs end to end (CPU: torch backend, tiny shapes) and prints a full table."""

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def test_benchmark_script_writes_a_row_per_case(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("dcache_kernel_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.md"
    threads = torch.get_num_threads()
    try:
        bench.main(["--device", "cpu", "--dtype", "fp16", "--scale", "512", "--reps", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script pins one thread on CPU
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "µs" not in line]
    assert len(rows) == 9 * len(bench.MODELS)  # nine cases per model shape
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        mb_moved, torch_us, torch_gbps = float(cells[3]), float(cells[7]), float(cells[8])
        assert mb_moved > 0 and torch_us > 0 and torch_gbps > 0
    assert "python benchmarks/kernels.py --device cpu" in out.read_text()
