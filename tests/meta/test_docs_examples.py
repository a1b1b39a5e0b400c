"""The Python blocks and shell commands of README.md and docs/*.md run as written, on the bundled tiny model.

What is changed, and why (nothing else is):
- Python: `DiffusionPipeline.from_pretrained(...)` lines become `pipe = load_tiny_pipeline()` and a `prompt = ...`
  line becomes `prompt = "3"` (no download, no GPU); `run_eval(EvalConfig(...))` gets tiny settings (TINY_EVAL).
- Commands: placeholders (`<hub id or folder>`, `"..."`, `builtin|FILE`) become the bundled model, `3`, `builtin`;
  each `dcache` command gets the tiny settings of TINY_FLAGS appended (a later flag overrides an earlier one), and
  runs in a folder that holds the `plan.json` and `prompts.txt` the commands name.
- Not run, with the reason in SKIPPED: `make` (sets up a virtualenv and runs this suite), multi-process launchers and
  benchmark scripts (tests/eval and tests/benchmarks run them), and Python fragments that name the reader's own
  objects.
A command or block that matches none of these rules fails the test: a new example needs a rule, not silence.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
STEPS = 8  # enough for `--speed 2x` to find a setting on the bundled model
TINY_FLAGS = {
    "generate": ["--steps", str(STEPS), "--repeats", "0", "--no-progress"],
    "generate --prompts": ["--steps", str(STEPS), "--seeds", "1", "--no-progress"],
    "eval": ["--steps", str(STEPS), "--seeds", "1", "--num-prompts", "2", "--repeats", "1", "--warmup", "0",
             "--no-flops", "--metrics", "psnr,ssim", "--no-progress"],
    "analyze": ["--steps", str(STEPS), "--seeds", "1", "--num-prompts", "2", "--no-progress"],
    "calibrate": ["--steps", str(STEPS)],
    "search": ["--steps", str(STEPS), "--pop-size", "4", "--generations", "1", "--no-progress"],
}
TINY_EVAL = "seeds=1, steps=%d, num_prompts=2, repeats=1, warmup=0, flops=False, metrics='psnr', " % STEPS
PLACEHOLDERS = [("<hub id or folder>", "tiny"), ("<hub id | folder | tiny>", "tiny"), ("<...>", "tiny"),
                ('--prompt "..."', "--prompt 3"), ("builtin|FILE", "builtin")]
# Documents that hold no runnable example, with the reason.
WITHOUT_EXAMPLES = {"docs/reliability.md": "a table of failure cases; each row names the test that exercises it"}
SKIPPED = {
    "pip install": "installs packages; `make setup` installs dcache the same way into a fresh virtualenv (.ci/run "
                   "runs it on every change)",
    "make ": "sets up the virtualenv; `make demo` is `dcache generate`, run here, and `make test` is this suite",
    "accelerate launch": "multi-process runs: tests/eval/test_eval_runner.py and test_generate_batch.py run them",
    "torchrun": "multi-process runs: tests/eval/test_eval_runner.py runs the accelerate equivalent",
    "python benchmarks/": "a benchmark (minutes to hours); tests/benchmarks smoke-tests the scripts",
    "bash benchmarks/": "a benchmark (minutes to hours); tests/benchmarks smoke-tests the scripts",
    "my_lpips": "a fragment naming the reader's own networks; tests/eval/test_networks.py injects stand-ins",
    "transformer_2": "needs a pipeline with two denoising transformers (Wan 2.2); tests/compat/test_two_experts.py "
                     "runs the same calls on a tiny two-expert WanPipeline",
    "controlnet": "needs a ControlNet pipeline; tests/compat/test_controlnet_cache.py runs the same calls (Python, "
                  "`dcache generate --controlnet`, an eval method spec) on tiny Flux / Qwen-Image ControlNets",
    "queue": "a serving loop over the reader's own transformer, noise and text (docs/serving.md); "
             "tests/core/test_per_sample.py runs the same loop on the bundled model",
    "dcache estimate --table": "every shipped config (minutes on 2 cores); tests/memory/test_estimate_cli.py runs the "
                               "same command on one config and checks the page's table against its output",
    "dcache estimate --model org/repo": "downloads a config from the hub; tests/memory/test_estimate_cli.py runs "
                                        "the shipped and folder forms",
    "dcache estimate --model path/to/pipeline": "names the reader's own folder; tests/memory/test_estimate_cli.py "
                                                "runs a folder",
}


def blocks(document: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return FENCE.findall((ROOT / document).read_text())


def commands(body: str) -> list[str]:
    """Shell command lines of a block: continuations joined, `# comments` dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _skip_reason(text: str) -> str | None:
    """Why an example is not run: a command starting with a SKIPPED key, or a block using a SKIPPED name."""
    for key, why in SKIPPED.items():
        if text.startswith(key) or (key.isidentifier() and key in text):
            return why
    return None


def examples() -> list[tuple[str, str, str]]:
    out = []
    for document in DOCUMENTS:
        for lang, body in blocks(document):
            if lang == "python":
                out.append((document, "python", body))
            elif lang in ("", "bash", "sh", "shell"):
                out += [(document, "shell", line) for line in commands(body)]
    return out


EXAMPLES = examples()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The files the examples name: a plan recorded at STEPS steps, a prompt file."""
    from dcache.pipelines.cli import app

    folder = tmp_path_factory.mktemp("docs")
    result = CliRunner().invoke(app, ["generate", "--prompt", "3", "--steps", str(STEPS), "--repeats", "0",
                                      "--no-progress", "--out", str(folder / "setup")])
    assert result.exit_code == 0, result.output
    (folder / "plan.json").write_bytes((folder / "setup" / "plan.json").read_bytes())
    (folder / "prompts.txt").write_text("3\n7\n")
    return folder


@pytest.fixture
def workdir(inputs, tmp_path):
    """A fresh folder per example (examples write the same --out folders with different settings) with the inputs.
    The calibration tables registered in this process are restored afterwards: a documented `dcache calibrate`
    registers its (8-step) table for the bundled model, which would replace the shipped one for every later test."""
    from dcache.schedules import tables

    for name in ("plan.json", "prompts.txt"):
        (tmp_path / name).write_bytes((inputs / name).read_bytes())
    registered = dict(tables._TABLES)
    yield tmp_path
    tables._TABLES.clear()
    tables._TABLES.update(registered)


def _python(body: str) -> str:
    code = re.sub(r"^(\s*)pipe = DiffusionPipeline\.from_pretrained\(.*$", r"\1pipe = load_tiny_pipeline()", body,
                  flags=re.M)
    code = re.sub(r"^(\s*)prompt = .*$", r'\1prompt = "3"', code, flags=re.M)
    code = code.replace("EvalConfig(", "EvalConfig(" + TINY_EVAL).replace("seeds=4, ", "")
    return "from dcache.pipelines.bundled import load_tiny_pipeline\n" + code


def _shell(line: str) -> list[str]:
    for old, new in PLACEHOLDERS:
        line = line.replace(old, new)
    argv = shlex.split(line)
    assert argv[0] == "dcache", f"no rule for the command {line!r}: add one to tests/meta/test_docs_examples.py"
    command = argv[1]
    key = "generate --prompts" if command == "generate" and "--prompts" in argv else command
    return argv[1:] + TINY_FLAGS.get(key, [])


@pytest.mark.slow
@pytest.mark.parametrize("document, kind, text", EXAMPLES,
                         ids=[f"{d}:{k}:{t.splitlines()[0][:40]}" for d, k, t in EXAMPLES])
def test_documented_example_runs(document, kind, text, workdir, monkeypatch):
    reason = _skip_reason(text.strip())
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(workdir)
    if kind == "python":
        namespace: dict = {}
        exec(compile(_python(text), f"{document} python block", "exec"), namespace)  # noqa: S102
        return
    from dcache.pipelines.cli import app

    result = CliRunner().invoke(app, _shell(text))
    assert result.exit_code == 0, f"{document}: `{text}` failed:\n{result.output[-3000:]}"


def test_every_document_has_examples_and_the_readme_snippet_makes_an_image(tmp_path, monkeypatch):
    """Quick guard beside the slow runs: the README's first block still shows pipe(prompt).images[0], and on the
    bundled model (the substitution above, 4 steps) it gives a PIL image and writes the plan file it names."""
    import PIL.Image

    assert {d for d, _, _ in EXAMPLES} == set(DOCUMENTS) - set(WITHOUT_EXAMPLES)
    first = next(body for lang, body in blocks("README.md") if lang == "python")
    assert "pipe(prompt).images[0]" in first
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    code = _python(first).replace("pipe(prompt)", "pipe(prompt, num_inference_steps=4)")
    exec(compile(code, "README.md python block", "exec"), namespace)  # noqa: S102
    assert isinstance(namespace["image"], PIL.Image.Image) and (tmp_path / "flux-28.plan.json").is_file()
