"""Timing bookkeeping (never a wall-clock bound), FLOP counting, prompt sets and prompt-file errors."""

import json

import pytest
import torch

from dcache.eval.prompts import BUILTIN_PROMPTS, PromptError, load_prompts, precheck_prompts
from dcache.eval.timing import Timing, count_flops, measure


def test_measure_runs_warmup_then_repeats_and_summarises():
    calls = []
    out, timing = measure(lambda: calls.append(1) or len(calls), repeats=4, warmup=2, device="cpu")
    assert len(calls) == 6 and out == 6
    assert len(timing.samples) == 4 and all(s >= 0 for s in timing.samples) and timing.warmup == 2
    assert timing.peak_memory_bytes is None  # CPU
    s = timing.summary()
    assert s["min_s"] <= s["median_s"] <= s["max_s"] and s["repeats"] == 4
    with pytest.raises(ValueError):
        measure(lambda: None, repeats=0)


def test_cpu_time_counts_work_not_waiting():
    import time

    _, timing = measure(lambda: time.sleep(0.05), repeats=2, warmup=0)
    assert len(timing.cpu_samples) == 2
    assert all(w >= 0.05 for w in timing.samples)  # sleep guarantees the wall-clock time
    assert all(0 <= c < 0.02 for c in timing.cpu_samples)  # and costs (almost) no CPU time


def test_timing_statistics_on_known_samples():
    t = Timing([1.0, 2.0, 3.0, 4.0, 100.0])
    assert t.median == 3.0 and t.iqr == pytest.approx(2.0) and t.mean == 22.0


def test_count_flops_of_a_matmul():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    out, flops = count_flops(lambda: a @ b)
    assert flops == 2 * 8 * 16 * 4 and out.shape == (8, 4)


def test_builtin_and_inline_prompts():
    assert load_prompts("builtin", is_tiny=True) == [str(i) for i in range(10)]
    assert load_prompts("builtin", is_tiny=False) == BUILTIN_PROMPTS
    assert load_prompts("builtin:text", is_tiny=False, limit=2) == BUILTIN_PROMPTS[:2]
    assert load_prompts("3,07, 9", is_tiny=True) == ["3", "7", "9"]


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("# a comment\na cat\n\n  a dog  \n")
    assert load_prompts(str(txt), is_tiny=False) == ["a cat", "a dog"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["a cat", {"prompt": "a dog"}]))
    assert load_prompts(str(js), is_tiny=False) == ["a cat", "a dog"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "x"}\n"y"\n')
    assert load_prompts(str(jl), is_tiny=False) == ["x", "y"]
    labels = tmp_path / "labels.txt"
    labels.write_text("1\n2\n")
    assert load_prompts(str(labels), is_tiny=True) == ["1", "2"]


@pytest.mark.parametrize("content,suffix,match", [
    ("", ".txt", "holds no prompts"),
    ("[1, ", ".json", "not valid JSON"),
    ('{"a": 1}', ".json", "expected a list"),
    ('[{"text_missing": 1}]', ".json", "entry 1 is not a prompt"),
    ('{"prompt": "ok"}\nnot json\n', ".jsonl", "line 2 is not valid JSON"),
])
def test_bad_prompt_files_say_what_is_wrong(tmp_path, content, suffix, match):
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    with pytest.raises(PromptError, match=match):
        load_prompts(str(path), is_tiny=False)


def test_missing_file_and_bad_labels():
    with pytest.raises(PromptError, match="does not exist"):
        load_prompts("/no/such/prompts.txt", is_tiny=False)
    with pytest.raises(PromptError, match="class labels 0-9"):
        load_prompts("3,12", is_tiny=True)
    with pytest.raises(PromptError, match="unknown builtin"):
        load_prompts("builtin:nope", is_tiny=False)


def test_precheck_passes_sets_and_labels_and_rejects_bad_files(tmp_path):
    for spec in ("builtin", "builtin:text", "0,3,7", None):
        precheck_prompts(spec)  # model-independent specs pass; labels are checked once the model is known
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# nothing\n")
    for spec, match in ((str(empty), "holds no prompts"), ("/no/such/prompts.txt", "does not exist"),
                        ("builtin:nope", "unknown builtin")):
        with pytest.raises(PromptError, match=match):
            precheck_prompts(spec)
