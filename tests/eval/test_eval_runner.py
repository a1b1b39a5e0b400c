"""`dcache eval` end to end on a random-weight tiny model: numbers, report files, resume, refusal, CLI errors, and
equality of a 2-process `accelerate launch` run with the single-process run."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest
from eval_testkit import FAST, TINY_LABELS, HtmlChecker

from dcache.eval.metrics import psnr_per_image
from dcache.eval.runner import EvalConfig, make_variants, parse_method, run_eval
from dcache.files.state_file import load_state

METHODS = ["fora", "fixed_interval:interval=1", "fixed_interval:interval=2"]
METRICS = "psnr,ssim,max_abs,mean_abs,fid,accuracy"


def _config(tiny_dir, classifier_path, out, methods=METHODS, **kw) -> EvalConfig:
    settings = dict(prompts=TINY_LABELS, seeds=2, batch_size=2, metrics=METRICS, grid_items=2, **FAST)
    return EvalConfig(model=str(tiny_dir), methods=list(methods), classifier=str(classifier_path), out=str(out),
                      **{**settings, **kw})


@pytest.fixture(scope="module")
def plan_file(tiny_dir, tmp_path_factory):
    """A plan exported from a fixed_interval:interval=2 run at the eval's settings (replayed as a method)."""
    import dcache
    from dcache.pipelines.runner import GenerationJob, load_pipeline

    pipe, _ = load_pipeline(str(tiny_dir))
    pipe.set_progress_bar_config(disable=True)
    with dcache.apply(pipe, "fixed_interval", interval=2) as handle:
        GenerationJob(pipe, True, prompts=["0", "1"], steps=FAST["steps"], guidance=FAST["guidance"])()
        path = tmp_path_factory.mktemp("plan") / "every-other.json"
        handle.plan().save(path)
    return path


@pytest.fixture(scope="module")
def eval_run(tiny_dir, classifier_path, plan_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "report"
    cfg = _config(tiny_dir, classifier_path, out, methods=METHODS + [str(plan_file)], command="dcache eval (test)")
    return run_eval(cfg, progress=False)


def test_numbers_follow_the_definitions(eval_run):
    v = eval_run.results["variants"]
    assert eval_run.results["order"] == ["uncached", "fora", "fixed_interval(interval=1)",
                                         "fixed_interval(interval=2)", "every-other"]
    for row in v.values():
        assert row["num_images"] == 8  # 4 labels x 2 seeds
    assert v["uncached"]["compute_ratio"] == 1.0
    # all-compute is bit-identical to uncached (dcache invariant): PSNR inf, zero error, FID 0
    same = v["fixed_interval(interval=1)"]
    assert same["compute_ratio"] == 1.0 and same["max_abs"] == 0.0 and same["mean_abs"] == 0.0
    assert all(math.isinf(p) for p in same["per_image"]["psnr"]) and same["ssim"] == pytest.approx(1.0)
    assert same["fid_vs_uncached"] == pytest.approx(0.0, abs=1e-6)
    fora = v["fora"]
    ideal = fora["ideal_speedup"]  # arithmetic from FLOPs, not a timing
    assert 0 < fora["compute_ratio"] < 1 and ideal == pytest.approx(1 / fora["compute_ratio"])
    assert fora["max_abs"] > 0 and math.isfinite(fora["psnr"])
    per_image = fora["per_image"]["max_abs"]
    assert fora["max_abs"] == pytest.approx(sum(per_image) / 8) and fora["max_abs_max"] == max(per_image)
    assert 0.0 <= fora["accuracy"] <= 1.0 and fora["fid_vs_data"] >= 0
    # a plan replays its run bit-exactly: the plan method equals the method it was exported from
    assert v["every-other"]["per_image"] == v["fixed_interval(interval=2)"]["per_image"]
    assert v["every-other"]["compute_ratio"] == v["fixed_interval(interval=2)"]["compute_ratio"]
    # measured FLOPs of a whole call shrink with the compute ratio
    assert fora["flops_per_image"] < v["uncached"]["flops_per_image"]
    assert v["uncached"]["latency"]["n"] == 4 and v["uncached"]["latency"]["median_s"] > 0
    # the reported CPU-time ratio is the ratio of the reported medians (report arithmetic; no timing is bounded)
    reported_ref, reported = v["uncached"]["cpu_speedup"], fora["cpu_speedup"]
    assert reported_ref == 1.0 and fora["cpu_latency"]["n"] == 4
    assert reported == pytest.approx(v["uncached"]["cpu_latency"]["median_s"] / fora["cpu_latency"]["median_s"])


def test_per_image_psnr_matches_the_stored_images(eval_run):
    work = eval_run.out_dir / ".work"
    [fora_dir] = [p for p in work.iterdir() if p.name.startswith("fora-")]
    ref = load_state(work / "uncached" / "s0-p0-1.safetensors", "eval record", "rerun")
    rec = load_state(fora_dir / "s0-p0-1.safetensors", "eval record", "rerun")
    expected = psnr_per_image(rec["images"], ref["images"]).tolist()
    assert eval_run.results["variants"]["fora"]["per_image"]["psnr"][:2] == expected


def test_report_files_are_well_formed(eval_run):
    import PIL.Image

    out = eval_run.out_dir
    for name in ("report.md", "report.html", "results.json", "pareto.png", "grid.png", "diff.png", "decisions.png"):
        assert (out / name).is_file(), name
    results = json.loads((out / "results.json").read_text())
    assert results["format"] == "dcache.eval" and results["seeds"] == [0, 1]
    assert results["config"]["methods"][0] == "fora" and results["environment"]["versions"]["torch"]
    assert results["environment"]["num_processes"] == 1
    assert results["variants"]["fixed_interval(interval=1)"]["per_image"]["psnr"][0] == "inf"  # JSON has no inf

    md = (out / "report.md").read_text()
    assert "dcache eval (test)" in md and "![Pareto plot](pareto.png)" in md and "| CPU-time speed-up |" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    cells = [len(re.findall(r"(?<!\\)\|", line)) for line in table]  # unescaped pipes
    assert len(table) == 1 + 5 and len(set(cells)) == 1

    parser = HtmlChecker()
    parser.feed((out / "report.html").read_text())
    assert not parser.errors and not parser.stack, parser.errors or parser.stack
    assert parser.links == []  # self-contained: no external files or URLs
    assert parser.rows == 1 + 5 and len(parser.images) == 4
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        image = PIL.Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        assert image.width > 100 and image.height > 50
    assert not list(out.rglob("*.tmp*"))  # nothing half-written


def test_resume_continues_where_it_stopped(eval_run, tiny_dir, classifier_path, tmp_path):
    out = tmp_path / "resumed"
    seen = []

    def stop_after_three(label, item):
        seen.append((label, item.id))
        if len(seen) == 3:
            raise KeyboardInterrupt

    cfg = _config(tiny_dir, classifier_path, out, methods=["fora"])
    with pytest.raises(KeyboardInterrupt):
        run_eval(cfg, progress=False, on_record=stop_after_three)
    assert not (out / "report.html").exists() and not list(out.rglob("*.tmp*"))
    done = list(seen)
    seen.clear()
    result = run_eval(cfg, progress=False, on_record=lambda label, item: seen.append((label, item.id)))
    assert len(seen) == 2 * 4 - 3 and not set(seen) & set(done)  # only the rest was generated
    fora, ref = result.results["variants"]["fora"], eval_run.results["variants"]["fora"]
    assert fora["per_image"] == ref["per_image"] and fora["compute_ratio"] == ref["compute_ratio"]
    assert fora["fid_vs_uncached"] == ref["fid_vs_uncached"] and fora["accuracy"] == ref["accuracy"]
    seen.clear()
    again = run_eval(cfg, progress=False, on_record=lambda label, item: seen.append(label))
    assert seen == [] and again.results["variants"]["fora"]["per_image"] == fora["per_image"]


def test_different_settings_in_the_same_folder_are_refused(eval_run, tiny_dir, classifier_path):
    cfg = _config(tiny_dir, classifier_path, eval_run.out_dir, seeds=3)
    with pytest.raises(ValueError, match="different settings"):
        run_eval(cfg, progress=False)


def test_bad_methods_fail_before_generating(tiny_dir, classifier_path, tmp_path):
    with pytest.raises(ValueError, match="--methods 'nope'"):
        run_eval(_config(tiny_dir, classifier_path, tmp_path / "x", methods=["nope"]), progress=False)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        run_eval(_config(tiny_dir, classifier_path, tmp_path / "x", methods=["missing.json"]), progress=False)
    assert not (tmp_path / "x" / ".work" / "uncached").exists()


def test_method_specs():
    assert parse_method("magcache:threshold=0.1:max_skip_steps=2") == ("magcache", {"threshold": 0.1,
                                                                                    "max_skip_steps": 2})
    labels = [v.label for v in make_variants(["fora", "fora", "fbcache:threshold=0.2"])]
    assert labels == ["fora", "fora#2", "fbcache(threshold=0.2)"]
    with pytest.raises(ValueError, match="key=value"):
        parse_method("fora:oops")


def test_cli_errors_are_clear(tiny_dir, tmp_path):
    from typer.testing import CliRunner

    from dcache.eval.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["eval", "--model", str(tiny_dir), "--metrics", "psnr,bogus", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "unknown metric" in r.output and "bogus" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("[1,")
    r = runner.invoke(app, ["eval", "--model", str(tiny_dir), "--prompts", str(bad), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "not valid JSON" in r.output
    r = runner.invoke(app, ["eval", "--model", str(tiny_dir), "--metrics", "clip_score", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "text prompts" in r.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_identical_numbers(eval_run, tiny_dir, classifier_path, plan_file, tmp_path):
    out = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           "-m", "dcache.eval.cli", "eval", "--model", str(tiny_dir),
           "--methods", ",".join(METHODS + [str(plan_file)]),
           "--prompts", TINY_LABELS, "--seeds", "2", "--batch-size", "2", "--steps", str(FAST["steps"]),
           "--guidance", str(FAST["guidance"]), "--repeats", "1", "--warmup", "0", "--metrics", METRICS,
           "--classifier", str(classifier_path), "--grid-items", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dist = json.loads((out / "results.json").read_text())
    single = json.loads((eval_run.out_dir / "results.json").read_text())
    assert dist["environment"]["num_processes"] == 2
    keys = ("per_image", "psnr", "ssim", "max_abs", "mean_abs", "compute_ratio", "ideal_speedup", "fid_vs_uncached",
            "fid_vs_data", "accuracy", "flops_per_image", "num_images", "units", "cache_bytes")
    for label, row in single["variants"].items():
        for key in keys:
            assert dist["variants"][label].get(key) == row.get(key), (label, key)
    # each process generated its own half of the items
    assert sorted(p.name for p in (out / ".work" / "uncached").glob("*.safetensors")) == \
        ["s0-p0-1.safetensors", "s0-p2-3.safetensors", "s1-p0-1.safetensors", "s1-p2-3.safetensors"]


def test_dcache_cli_has_eval_and_analyze():
    from typer.testing import CliRunner

    from dcache.pipelines.cli import app

    for command in ("eval", "analyze"):
        r = CliRunner().invoke(app, [command, "--help"])
        assert r.exit_code == 0 and "--out" in r.output
