"""The library needs torch + diffusers (+ safetensors) only: the optional packages behind extras stay optional.

A subprocess hides the optional packages (as if never installed: `importlib.util.find_spec` returns None and their
distributions have no metadata), imports dcache, applies a method to the bundled tiny pipeline and compares with the
uncached run; then the command line and eval name the extra to install.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Every distribution an extra (or the dev tools) brings; none may be needed by `import dcache; dcache.apply(...)`.
OPTIONAL = ["matplotlib", "pymoo", "accelerate", "torchmetrics", "triton", "typer", "sklearn", "scipy",
            "torchvision", "transformers", "peft", "torch_fidelity", "cache_dit", "hypothesis", "pytest"]


def hide(names: list[str]) -> str:
    """Code that makes `names` (top-level import names = normalised distribution names) look uninstalled."""
    return textwrap.dedent(f"""
    import sys
    from importlib.machinery import PathFinder

    HIDDEN = {sorted(set(names) | {"scikit_learn"})!r}

    class WithoutOptional(PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            return None if name.partition(".")[0] in HIDDEN else super().find_spec(name, path, target)

        @classmethod
        def find_distributions(cls, *args, **kwargs):
            for dist in super().find_distributions(*args, **kwargs):
                if (dist.metadata["Name"] or "").lower().replace("-", "_") not in HIDDEN:
                    yield dist

    sys.meta_path[:] = [WithoutOptional if finder is PathFinder else finder for finder in sys.meta_path]
    """)


APPLY = hide(OPTIONAL) + textwrap.dedent("""
    import json
    import torch
    import dcache
    from dcache.pipelines.bundled import load_tiny_pipeline

    torch.set_num_threads(1)
    pipe = load_tiny_pipeline()
    run = lambda: pipe(["3", "7"], num_inference_steps=10, generator=torch.Generator().manual_seed(0),
                       output_type="pt").images
    reference = run()
    handle = dcache.apply(pipe, "magcache")
    cached = run()
    stats = handle.stats().to_dict()
    handle.remove()
    after = run()
    loaded = sorted(name for name in sys.modules if name.partition(".")[0] in HIDDEN)
    print(json.dumps({"rel": float((cached - reference).norm() / reference.norm()),
                      "identical_after_remove": bool(torch.equal(after, reference)),
                      "compute_ratio": stats["compute_ratio"], "loaded": loaded}))
""")


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_apply_runs_with_torch_and_diffusers_only(tmp_path):
    out = _run(APPLY, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], f"the core imported optional packages: {result['loaded']}"
    assert result["compute_ratio"] < 0.9, f"too little was reused: {result}"
    assert result["rel"] < 0.1, f"cached output too far from the uncached one: {result}"
    assert result["identical_after_remove"]


USES = textwrap.dedent("""
    import torch
    from dcache.eval.metrics import ssim_per_image
    from dcache.eval.plots import curve_plot
    from dcache.pipelines.cli import main

    for use in [lambda: ssim_per_image(torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, 8)),
                lambda: curve_plot({"cond": [1.0, 0.9]}, "curve.png", title="t", ylabel="y")]:
        try:
            use()
            print("ran without its extra")
        except ModuleNotFoundError as error:
            print(error)
    sys.argv = ["dcache", "eval", "--methods", "magcache", "--steps", "2", "--num-prompts", "1", "--out", "out"]
    try:
        main()
    except SystemExit as exit:
        print("exit", exit.code)
""")


def test_a_missing_extra_is_named_with_its_install_command(tmp_path):
    # Without the eval extra: SSIM still runs (plain torch, dcache/quality.py); a plot (matplotlib) and `dcache eval`
    # (accelerate) name the extra
    out = _run(hide([name for name in OPTIONAL if name != "typer"]) + USES, tmp_path)  # typer: the CLI's own
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-3:]
    assert lines[0] == "ran without its extra", lines
    assert lines[1].startswith("matplotlib is needed") and lines[1].endswith('pip install "dcache[eval]".'), lines
    assert lines[2] != "exit 0" and 'accelerate is needed' in out.stderr and 'pip install "dcache[eval]"' in \
        out.stderr, out.stderr[-2000:]
