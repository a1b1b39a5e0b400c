"""The benchmark scripts answer --help before loading torch, write to a git-ignored scratch folder by default, and
name the missing [bench] extra instead of dropping cache-dit's rows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())  # not modules
PROBE = """
import runpy, sys
sys.argv = [{path!r}, "--help"]
try:
    runpy.run_path({path!r}, run_name="__main__")
except SystemExit as exc:
    code = exc.code
print("exit", code, "torch" in sys.modules, "diffusers" in sys.modules)
"""


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"dcache_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_before_torch_and_diffusers_load(script):
    path = str(BENCH / script)
    proc = subprocess.run([sys.executable, "-c", PROBE.format(path=path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "exit 0 False False"
    assert "usage:" in proc.stdout


def test_out_defaults_to_the_ignored_scratch_folder_never_the_tracked_results():
    methods, overhead, search = _load("methods"), _load("overhead"), _load("search")
    defaults = [methods.parse_args([]).out, overhead.build_parser().parse_args([]).out,
                search.build_parser().parse_args([]).results]
    assert all(path == BENCH / "out" for path in defaults)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(BENCH / "out" / "methods.md")], cwd=BENCH)
    assert ignored.returncode == 0  # git ignores the scratch folder


def test_a_missing_cache_dit_is_an_error_naming_the_bench_extra(monkeypatch):
    methods, overhead = _load("methods"), _load("overhead")
    if importlib.util.find_spec("cache_dit") is None:  # this machine: the real reason names the extra
        assert "pip install -e '.[bench]'" in methods.peers.cache_dit_unavailable()
    why = "cache-dit is not usable (import cache_dit failed: ModuleNotFoundError); install the benchmark extra with " \
          "`pip install -e '.[bench]'`, or pass --no-cache-dit to leave its rows out"
    monkeypatch.setattr(methods.peers, "cache_dit_unavailable", lambda: why)
    with pytest.raises(SystemExit, match=r"\.\[bench\]"):
        methods.main(["--steps", "2"])
    monkeypatch.setattr(overhead, "cache_dit_unavailable", lambda: why)
    with pytest.raises(SystemExit) as exc:
        overhead.main(["--rounds", "1"])
    assert exc.value.code == 2  # argparse's error exit, with the reason on stderr
