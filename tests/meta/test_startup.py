"""`dcache --help` and `dcache methods` start without what they do not need, and print nothing but their output.

`dcache --help` imports neither torch nor diffusers (dcache/__init__.py resolves its names on first use, and the
bundled model's calibration registers at the first registry lookup); `dcache methods` needs torch (the method configs)
but not diffusers. Neither prints import noise on stderr: no torchao binary load failures, no pytree deprecation
warnings (the dev extra installs no torchao; diffusers imports an installed one at start-up).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from dcache.pipelines.cli import main
sys.argv = ["dcache", *{args!r}]
try:
    main()
except SystemExit:
    pass
print(json.dumps({{name: name in sys.modules for name in ("torch", "diffusers", "torchao")}}), file=sys.stderr)
"""
NOISE = ("torchao", "Failed to load", "_pytree", "register_constant", "Warning", "WARNING")


def run(args: list[str]) -> tuple[str, dict, str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True,
                          timeout=120)
    *noise, modules = done.stderr.strip().splitlines()
    return done.stdout, json.loads(modules), "\n".join(noise)


@pytest.mark.parametrize("args, heavy", [(["--help"], ("torch", "diffusers", "torchao")),
                                         (["--version"], ("torch", "diffusers", "torchao")),
                                         (["methods"], ("diffusers", "torchao"))])
def test_start_up_imports_only_what_the_command_needs_and_is_quiet(args, heavy):
    out, modules, noise = run(args)
    assert "generate" in out or "magcache" in out or "dcache 0" in out  # the command did its work
    assert not [name for name in heavy if modules[name]], modules
    assert not [word for word in NOISE if word in noise], noise
    assert noise == ""


def test_names_of_the_package_resolve_on_first_use():
    import dcache

    assert dcache.apply.__module__ == "dcache.api.apply_cache" and dcache.Plan.__name__ == "Plan"
    assert {"apply", "Plan", "Handle", "methods", "MethodConfig"} <= set(dir(dcache))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dcache.nope  # noqa: B018


def test_python_dash_m_dcache_is_the_command_line():
    """`python -m dcache` runs the same command line as the `dcache` script (no scripts folder on PATH needed)."""
    done = subprocess.run([sys.executable, "-m", "dcache", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python -m dcache" in done.stdout and "generate" in done.stdout and "estimate" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "dcache", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nope" in bad.stderr  # the script's own usage error, not a traceback


def test_version_names_dcache_torch_diffusers_and_python():
    """`dcache --version`: one line a bug report can quote, the versions read from the installed packages."""
    import platform
    from importlib.metadata import version

    import dcache

    out, _, _ = run(["--version"])
    assert out == (f"dcache {version('dcache')} (torch {version('torch')}, diffusers {version('diffusers')}, "
                   f"python {platform.python_version()})\n")
    assert version("dcache") == dcache.__version__  # the package's own constant and its metadata agree
