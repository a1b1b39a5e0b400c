"""Guards: one import name (`dcache`), and the one-way import direction of DESIGN.md."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["kernels", "dcache", "schedules", "pipelines", "eval"]  # lower first
PACKAGE_OF = {"kernels": "dcache.kernels", "dcache": "dcache", "schedules": "dcache.schedules",
              "pipelines": "dcache.pipelines", "eval": "dcache.eval"}
# The CLI sits on top of everything; it may import any layer.
TOP_LEVEL_FILES = {Path("pipelines/cli.py")}


def test_only_dcache_is_importable(tmp_path):
    code = (
        "import importlib, sys\n"
        "import dcache, dcache.kernels, dcache.schedules, dcache.pipelines, dcache.eval\n"
        "bad = []\n"
        "for name in ['kernels', 'schedules', 'pipelines', 'tests']:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        bad.append(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"top-level names leak besides dcache: {out.stdout}"


def _imports(path: Path, package: str) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return found


def _layer_of(module: str) -> str | None:
    for folder, pkg in sorted(PACKAGE_OF.items(), key=lambda kv: -len(kv[1])):
        if module == pkg or module.startswith(pkg + "."):
            return folder
    return None


@pytest.mark.parametrize("folder", LAYERS)
def test_imports_point_down_only(folder):
    allowed = set(LAYERS[: LAYERS.index(folder) + 1])
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel in TOP_LEVEL_FILES:
            continue
        pkg = PACKAGE_OF[folder] + "".join("." + p for p in rel.parts[1:-1])
        for module in _imports(path, pkg):
            layer = _layer_of(module)
            if layer is not None and layer not in allowed:
                offenders.append(f"{rel} imports {module} ({layer} is above {folder})")
    assert not offenders, "\n".join(offenders)


def test_kernels_import_only_torch_triton_and_stdlib():
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for module in _imports(path, "dcache.kernels"):
            top = module.split(".")[0]
            assert top in {"torch", "triton", "dcache", "__future__"} or top in sys.stdlib_module_names, \
                f"{path.name} imports {module}"
