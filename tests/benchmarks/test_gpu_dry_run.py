"""benchmarks/gpu.py --dry-run: the GPU benchmark's code path, on tiny configs of the same families, on the CPU.

Every part runs for FLUX (the speed part for Wan and Qwen-Image too) and writes its JSON; the figures are checked for
what holds on any device: compute ratios of the cadences, handle.memory() == dcache.memory.estimate, an offloaded cache
bit-identical to the on-device one, a compiled generation that still reuses.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("dcache_gpu_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    yield bench
    torch.set_num_threads(threads)  # the script pins one thread on the CPU
    sys.modules.pop(spec.name, None)


def test_every_part_runs_on_tiny_configs_and_writes_its_json(gpu_bench, tmp_path):
    out = tmp_path / "all.json"
    gpu_bench.main(["--dry-run", "--model", "flux.1-dev", "--out", str(out)])
    parts = {r["part"]: r for r in json.loads(out.read_text())}
    assert set(parts) == set(gpu_bench.PARTS)
    for result in parts.values():
        assert result["dry_run"] and result["device"] == "CPU"
        assert result["command"].startswith("python benchmarks/gpu.py")
    speed = {row["method"]: row for row in parts["speed"]["rows"]}
    assert len(speed) == len(gpu_bench.METHODS)
    for row in speed.values():
        assert 0 < row["compute_ratio"] < 1 and math.isfinite(row["measured_speedup"]) and row["cached_s"] > 0
        assert row["ideal_speedup"] == pytest.approx(1 / row["compute_ratio"], rel=0.05)
    assert speed["fixed_interval N=4"]["compute_ratio"] < speed["fixed_interval N=2"]["compute_ratio"]
    for row in parts["memory"]["rows"]:
        assert row["handle_memory_bytes"] == row["estimate_bytes"] > 0
    assert any("residual_apply" in line for line in parts["kernels"]["table"])
    compiled = parts["compile"]
    assert compiled["compute_ratio"] < 1 and compiled["unique_graphs"] >= 1
    assert all(row["bit_identical"] for row in parts["offload"]["rows"])
    whole = parts["cudagraphs"]  # fullgraph=True traced the hooked model; one handle, no recompile after warm-up
    assert whole["graph_breaks"] == 0 and whole["graphs_after_warmup"] == 0 and whole["compute_ratio"] < 1
    assert whole["max_abs_diff_vs_eager_dcache"] == 0.0  # the eager backend: bit-identical to eager dcache


@pytest.mark.parametrize("model", ["wan2.1-t2v-1.3b", "qwen-image"])
def test_the_speed_part_runs_for_the_video_and_mmdit_families(gpu_bench, tmp_path, model):
    out = tmp_path / f"speed-{model}.json"
    gpu_bench.main(["--dry-run", "--model", model, "--part", "speed", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["setting"]["cfg"] == "split"  # both run split CFG: two branches per step
    assert all(0 < row["compute_ratio"] < 1 for row in result["rows"])


def test_the_speed_part_keeps_its_finished_rows_when_stopped(gpu_bench, tmp_path, monkeypatch):
    """A run stopped at a time limit (here: the third method raises) leaves a JSON with the rows it finished,
    marked incomplete; a finished run marks itself complete."""
    out = tmp_path / "speed.json"
    applied = gpu_bench.Applied.__enter__
    calls = []

    def stop_at_the_third_method(self):
        calls.append(self.args[1])
        if len(calls) > 4:  # a warm-up and a timed run per method: two enters each
            raise KeyboardInterrupt("time limit")
        return applied(self)

    monkeypatch.setattr(gpu_bench.Applied, "__enter__", stop_at_the_third_method)
    with pytest.raises(KeyboardInterrupt):
        gpu_bench.main(["--dry-run", "--model", "flux.1-dev", "--part", "speed", "--out", str(out)])
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and [r["method"] for r in partial["rows"]] == [m[0] for m in
                                                                                      gpu_bench.METHODS[:2]]
    monkeypatch.setattr(gpu_bench.Applied, "__enter__", applied)
    gpu_bench.main(["--dry-run", "--model", "flux.1-dev", "--part", "speed", "--out", str(out)])
    assert json.loads(out.read_text())["complete"] is True


def test_without_a_gpu_a_real_size_run_is_refused(gpu_bench):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real-size run would start")
    with pytest.raises(SystemExit) as exc:
        gpu_bench.main(["--part", "speed"])
    assert exc.value.code == 2


def test_assemble_renders_gpu_results_and_never_dry_runs(gpu_bench, tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_report import gpu_part
    finally:
        sys.path.remove(str(SCRIPT.parent))
    folder = tmp_path / "gpu"
    folder.mkdir()
    gpu_bench.main(["--dry-run", "--model", "flux.1-dev", "--part", "speed", "--out", str(folder / "a.json")])
    assert gpu_part(folder).startswith("No GPU figures yet")  # a dry run is never shown as a GPU figure
    result = json.loads((folder / "a.json").read_text())
    result.update(dry_run=False, device="NVIDIA H200")
    (folder / "a.json").write_text(json.dumps(result))
    page = gpu_part(folder)
    assert "**flux.1-dev** on NVIDIA H200" in page and "`python benchmarks/gpu.py" in page
    assert page.count("| fixed_interval N=4 |") == 1
