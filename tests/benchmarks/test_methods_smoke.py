"""benchmarks/methods.py --quick runs end to end on the bundled model (no cache-dit needed) and writes a table with
finite numbers for dcache and for diffusers' built-in caches, the JSON beside it and the Pareto plot."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "methods.py"


def _assets_present() -> bool:
    from dcache.pipelines.bundled import DIGIT_CLASSIFIER_PATH, TINY_MODEL_DIR

    return (TINY_MODEL_DIR / "model_index.json").is_file() and DIGIT_CLASSIFIER_PATH.is_file()


def run_script(monkeypatch, argv: list[str]) -> Path:
    """benchmarks/methods.py's main(argv), loaded by path; the report it returns."""
    spec = importlib.util.spec_from_file_location("dcache_methods_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        return bench.main(argv)
    finally:
        torch.set_num_threads(threads)  # the script pins its thread count


@pytest.mark.slow  # ~100 s on a busy 2-core CPU
@pytest.mark.skipif(not _assets_present(), reason="the bundled tiny model / classifier assets are not built yet")
def test_quick_benchmark_table_has_dcache_and_diffusers_rows(tmp_path, monkeypatch):
    md = run_script(monkeypatch, ["--quick", "--no-cache-dit", "--repeats", "1", "--out", str(tmp_path)])

    text = md.read_text()
    assert "python benchmarks/methods.py --quick --no-cache-dit" in text  # the exact command heads the table
    results = text.split("## Results", 1)[1].split("\n## ", 1)[0]  # the main table (later tables have other columns)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in results.splitlines()
            if line.startswith("| dcache |") or line.startswith("| diffusers |")]
    libraries = {r[0] for r in rows}
    assert libraries == {"dcache", "diffusers"}, libraries
    for r in rows:
        ratio, ideal, b1_ratio, b1_wall, b1_cpu, meas_over_ideal, b10_speedup = map(float, r[4:11])
        assert 0 < ratio <= 1.0 + 1e-9 and 0 < b1_ratio <= 1.0 + 1e-9
        assert ideal == pytest.approx(1 / ratio, rel=0.01)
        for v in (b1_wall, b1_cpu, meas_over_ideal, b10_speedup):
            assert math.isfinite(v) and v > 0
        psnr_cells = r[11:14]
        assert all(c == "∞" or math.isfinite(float(c)) for c in psnr_cells)
        ssim, acc, fd = float(r[14]), float(r[15]), float(r[16])
        assert 0 <= ssim <= 1.0 + 1e-9 and 0 <= acc <= 1 and math.isfinite(fd) and fd >= 0

    data = json.loads((tmp_path / "methods_quick.json").read_text())
    results = data["results"]
    assert all(r["error"] is None and r["restored"] for r in results), [(r["method"], r["error"]) for r in results]
    # dcache's own stats count the same block FLOPs as the benchmark's meter
    for r in results:
        for row in r["rows"]:
            if row["b1_lib_ratio"] is not None:
                assert row["b1_lib_ratio"] == pytest.approx(row["b1_ratio"], abs=1e-3)
    assert (tmp_path / "methods_quick_pareto.png").stat().st_size > 10_000


@pytest.mark.slow  # ~25 s each on a 2-core CPU
@pytest.mark.parametrize("model, cfg_mode, diffusers_applies",
                         [("motion", "split", True), ("shapes", "batched", False)])
def test_quick_benchmark_runs_on_the_other_bundled_models(tmp_path, monkeypatch, model, cfg_mode, diffusers_applies):
    """--model runs the sweep on tiny-motion (Wan, split CFG) and tiny-shapes (SD3, batched CFG) in the model's own
    CFG mode; where diffusers' caches cannot be put on the transformer the report says so instead of dropping them."""
    md = run_script(monkeypatch, ["--model", model, "--quick", "--no-cache-dit", "--repeats", "1",
                                  "--out", str(tmp_path)])

    assert md.name == f"methods_{model}_quick.md"
    data = json.loads((tmp_path / f"methods_{model}_quick.json").read_text())
    meta, results = data["meta"], data["results"]
    assert meta["model"] == model and meta["cfg_mode"] == cfg_mode
    assert all(r["error"] is None and r["restored"] for r in results), [(r["method"], r["error"]) for r in results]
    assert {r["library"] for r in results} == ({"dcache", "diffusers"} if diffusers_applies else {"dcache"})
    assert all(r["cfg_mode"] == cfg_mode for r in results if r["library"] == "dcache")
    assert bool(meta["unavailable"]) != diffusers_applies  # shapes: diffusers' caches named as not applicable
    for r in results:
        for row in r["rows"]:
            assert 0 < row["ratio"] <= 1 + 1e-9 and (math.isinf(row["psnr_heldout"]) or row["psnr_heldout"] > 10)
            if row["b1_lib_ratio"] is not None:  # dcache's count agrees with the meter on every family
                assert row["b1_lib_ratio"] == pytest.approx(row["b1_ratio"], abs=1e-3)
    assert f"tiny-{model}" in md.read_text().splitlines()[0]
