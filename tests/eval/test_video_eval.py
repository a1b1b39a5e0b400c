"""`dcache eval` end to end on a video pipeline: a tiny random-weight diffusers WanPipeline saved to a folder and
loaded by `--model <folder>`; per-frame PSNR/SSIM/LPIPS/|err|, the temporal-consistency error per video, CLIP score
and ImageReward per frame (stand-in networks, tests/eval/stand_ins.py), and the report."""

from __future__ import annotations

import json
import math
import re

import pytest
from eval_testkit import HtmlChecker
from stand_ins import Brightness, SquaredError, tiny_clip
from tiny_video import CALL, HEIGHT, PROMPTS, WIDTH, save_tiny_wan

from dcache.eval.metrics import psnr_per_image, ssim_per_image, temporal_error
from dcache.eval.networks import ClipScorer, ImageRewardScorer, LpipsScorer
from dcache.eval.runner import EvalConfig, run_eval
from dcache.files.state_file import load_state

FRAMES = CALL["num_frames"]
SAME = "fixed_interval(interval=1)"  # computes every step: bit-identical to uncached
METRICS = ["psnr", "ssim", "lpips", "max_abs", "mean_abs", "temporal", "clip_score", "image_reward"]


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return save_tiny_wan(root / "wan"), prompts


@pytest.fixture(scope="module")
def video_eval(wan, tmp_path_factory):
    wan, prompts = wan
    root = tmp_path_factory.mktemp("video-eval")
    return run_eval(_video_config(wan, prompts, root / "report"), networks=_networks(), progress=False)


def _video_config(wan, prompts, out) -> EvalConfig:
    return EvalConfig(model=str(wan), methods=["fora", "fixed_interval:interval=1"], prompts=str(prompts), seeds=1,
                      steps=4, guidance=1.0, height=HEIGHT, width=WIDTH, pipeline_kwargs=dict(CALL), repeats=1,
                      warmup=0, metrics=",".join(METRICS), out=str(out), command="dcache eval (video test)")


def _networks() -> dict:
    return {"lpips": LpipsScorer(net=SquaredError()), "clip_score": ClipScorer(lambda: tiny_clip(seed=2)),
            "image_reward": ImageRewardScorer(model=Brightness())}


def test_a_rerun_resumes_from_the_video_records(wan, video_eval):
    """The records of a video eval (one row per frame, temporal per video) pass the checks a rerun makes: nothing
    is generated again and the numbers are the same."""
    made = []
    again = run_eval(_video_config(*wan, video_eval.out_dir), networks=_networks(), progress=False,
                     on_record=lambda label, item: made.append(label))
    assert made == []
    for label, row in video_eval.results["variants"].items():
        assert again.results["variants"][label].get("psnr") == row.get("psnr"), label


def test_per_frame_and_temporal_numbers(video_eval):
    res = video_eval.results
    assert res["is_video"] and res["metrics"] == METRICS
    v = res["variants"]
    n_frames = len(PROMPTS) * FRAMES
    for label in (SAME, "fora"):
        per = v[label]["per_image"]
        for name in ("psnr", "ssim", "lpips", "mean_abs", "clip_score", "image_reward"):
            assert len(per[name]) == n_frames, name  # one value per frame
        assert len(per["temporal"]) == len(PROMPTS)  # one value per video
        # the stand-in LPIPS is 4 x MSE, so it follows from the PSNR of the same frame
        assert per["lpips"] == pytest.approx([4 * 10 ** (-p / 10) for p in per["psnr"]], rel=1e-5, abs=1e-12)
    # distribution metrics score every row, the uncached one too; identical frames score identically
    assert v[SAME]["per_image"]["clip_score"] == v["uncached"]["per_image"]["clip_score"]
    assert v[SAME]["per_image"]["image_reward"] == v["uncached"]["per_image"]["image_reward"]
    words = [len(p.split()) for p in PROMPTS for _ in range(FRAMES)]  # Brightness = mean pixel + words of the prompt
    assert all(0 <= r - w <= 1 for r, w in zip(v["fora"]["per_image"]["image_reward"], words))
    assert all(0 <= c <= 100 for c in v["fora"]["per_image"]["clip_score"])
    same = v[SAME]
    assert same["compute_ratio"] == 1.0 and same["max_abs"] == 0.0 and same["temporal"] == 0.0
    assert all(math.isinf(p) for p in same["per_image"]["psnr"]) and same["ssim"] == pytest.approx(1.0, abs=1e-12)
    fora = v["fora"]
    assert 0 < fora["compute_ratio"] < 1 and fora["max_abs"] > 0 and fora["temporal"] > 0
    # cached vs uncached is bounded: close (reuse of a slowly changing residual), never identical by accident
    assert all(40.0 < p < math.inf for p in fora["per_image"]["psnr"])  # measured 55-68 dB
    assert all(0.99 < s <= 1.0 for s in fora["per_image"]["ssim"])
    # temporal error <= 2 x the largest per-frame mean |error| of the video (triangle inequality on frame deltas)
    for k, t in enumerate(fora["per_image"]["temporal"]):
        frames = fora["per_image"]["mean_abs"][k * FRAMES:(k + 1) * FRAMES]
        assert 0 < t <= 2 * max(frames)


def test_metrics_match_the_stored_frames(video_eval):
    work = video_eval.out_dir / ".work"
    [fora_dir] = [p for p in work.iterdir() if p.name.startswith("fora-")]
    ref = load_state(work / "uncached" / "s0-p0-0.safetensors", "eval record", "rerun")
    rec = load_state(fora_dir / "s0-p0-0.safetensors", "eval record", "rerun")
    assert rec["frames_per_sample"] == FRAMES and rec["images"].shape == (FRAMES, 3, HEIGHT, WIDTH)
    assert 0.0 <= float(ref["images"].min()) and float(ref["images"].max()) <= 1.0
    assert float(ref["images"].std()) > 0.01  # the decoded video is not a constant image
    per = video_eval.results["variants"]["fora"]["per_image"]
    assert per["psnr"][:FRAMES] == psnr_per_image(rec["images"], ref["images"]).tolist()
    assert per["ssim"][:FRAMES] == ssim_per_image(rec["images"], ref["images"]).tolist()
    assert per["temporal"][0] == float(temporal_error(rec["images"], ref["images"], FRAMES)[0])


def test_video_report_is_well_formed(video_eval):
    import PIL.Image

    out = video_eval.out_dir
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["pipeline_kwargs"] == CALL and results["is_video"] is True
    md = (out / "report.md").read_text()
    assert "dcache eval (video test)" in md and "num_frames=5" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert all(h in table[0] for h in ("temporal err", "LPIPS", "CLIP score", "ImageReward")) and len(table) == 1 + 3
    assert len({len(re.findall(r"(?<!\\)\|", line)) for line in table}) == 1
    parser = HtmlChecker()
    parser.feed((out / "report.html").read_text())
    assert not parser.errors and not parser.stack and parser.links == []
    assert parser.rows == 1 + 3 and len(parser.images) == 4  # pareto, grid, diff, decisions
    grid = PIL.Image.open(out / "grid.png")
    assert grid.width > 4 * 64  # the grid shows several frames of the first video
    assert not list(out.rglob("*.tmp*"))


def test_batch_generation_writes_one_gif_per_video(wan, tmp_path):
    import PIL.Image

    from dcache.eval.batch import generate_batch

    wan, prompts = wan
    result = generate_batch(model=str(wan), prompts=str(prompts), seeds=1, cache="fora", steps=4, guidance=1.0,
                            height=HEIGHT, width=WIDTH, pipeline_kwargs=dict(CALL), out=str(tmp_path), progress=False)
    assert [e["file"] for e in result.images] == ["images/s0-p00000.gif", "images/s0-p00001.gif"]
    for e in result.images:
        gif = PIL.Image.open(tmp_path / e["file"])
        assert gif.n_frames == FRAMES and gif.size == (WIDTH, HEIGHT)
    assert result.summary["pipeline_kwargs"] == CALL and 0 < result.summary["compute_ratio"] < 1
