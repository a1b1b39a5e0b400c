"""dcache uses its dependencies' private API only through dcache/compat/, where each use is documented and checked
against the installed versions (tests/compat/test_diffusers_contract.py, test_torch_contract.py,
test_accelerate_contract.py).

Read from the syntax tree of every module the dcache distribution installs (pyproject's package-dir: `dcache/`,
`schedules/`, `pipelines/`, `eval/`) outside dcache/compat/:
  * an import of a private module or name of a third-party package (a dotted part or an imported name with a leading
    underscore: `torch.utils._pytree`, `torch._C`, `from diffusers.x import _y`; and diffusers' internal
    `diffusers.hooks.hooks`);
  * a private attribute of a third-party module bound by an import (`torch._foreach_lerp_`, `torch.utils._pytree`);
  * the internals dcache relies on, as attributes, names or strings (`getattr(m, "_hf_hook")`), listed in INTERNALS.
`kernels/` (`dcache.kernels`) is left out: it sits below the core, imports only torch and triton, and cannot import
dcache.compat; the triton internals it uses are documented where it uses them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "dcache" / "compat"
BELOW_THE_CORE = {"dcache.kernels"}  # cannot import dcache.compat (see the module docstring)
# private attributes of objects dcache is handed (not modules) that it relies on, each behind a dcache.compat entry
INTERNALS = {
    # diffusers (dcache/compat/diffusers.py)
    "fn_ref", "_diffusers_hook", "_cache_config", "_parallel_config", "_flattened_mesh", "_is_stateful",
    "StateManager", "_getframe", "_modulate", "_name_or_path",
    # accelerate (dcache/compat/accelerate.py)
    "_hf_hook", "_old_forward",
    # torch tensors (dcache/compat/torch.py)
    "_version", "_base",
}
# (file, use): allowed where it stands
ALLOWED = {
    # read inline in a frame dynamo skips (torch.compiler.disable(recursive=False)), where a compat helper would be
    # traced by dynamo; dcache.compat.diffusers.original_forward documents the attribute
    ("dcache/runtime/hooks.py", "fn_ref"),
}


def scanned_files() -> list[Path]:
    """Every module the distribution installs, outside dcache/compat/ and the packages below the core."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    files = set()
    for package, folder in package_dirs.items():
        if package not in BELOW_THE_CORE:
            files.update(p for p in (ROOT / folder).rglob("*.py") if COMPAT not in p.parents)
    return sorted(files)


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return bool(top) and top != "dcache" and top not in sys.stdlib_module_names


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_module(name: str) -> bool:
    return _third_party(name) and (any(_private(p) for p in name.split(".")) or name == "diffusers.hooks.hooks")


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """(root name, attribute names from the root) of `a.b.c`; no root name for a chain on a call or subscript."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every private use in the module at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    bound: set[str] = set()  # names bound to a third-party module or name by an import
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name.split(".")[0]) for a in node.names if _third_party(a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _third_party(node.module):
            bound.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if _private_module(node.module) or (_third_party(node.module)
                                                and any(_private(a.name) for a in node.names)):
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _private_module(a.name)]
        elif isinstance(node, ast.Attribute):
            root, attrs = _chain(node)
            if node.attr in INTERNALS:
                found.append((node.lineno, node.attr))
            elif root in bound and _private(node.attr) and node.attr == attrs[-1] \
                    and not any(_private(a) for a in attrs[:-1]):  # the first private part of the chain, once
                found.append((node.lineno, ".".join([root, *attrs])))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in INTERNALS:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Name) and node.id in INTERNALS:
            found.append((node.lineno, node.id))
    return found


def test_only_the_compat_modules_use_private_api_of_dependencies():
    files = scanned_files()
    scanned = {p.relative_to(ROOT).parts[0] for p in files}
    assert {"dcache", "schedules", "pipelines", "eval"} <= scanned, scanned  # the scan found the packages
    bad = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{line}: {what}" for line, what in uses(path) if (rel, what) not in ALLOWED]
    assert not bad, "private API of a dependency outside dcache/compat/ (add a named function there that says since " \
                    "which version it holds and what breaks if it changes, with its contract test in " \
                    "tests/compat/):\n" + "\n".join(bad)


def test_the_guard_sees_each_kind_of_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from diffusers.hooks.hooks import StateManager\nimport torch._dynamo\n"
                      "from torch._C._dynamo.eval_frame import get_eval_frame_callback\n"
                      "from diffusers.models import _private\nx = getattr(m, '_cache_config', None)\n"
                      "y = hook.fn_ref.original_forward\nz = torch._dynamo.is_compiling()\n"
                      "from torch.utils._pytree import tree_map\nimport torch.utils._pytree as pytree\n"
                      "w = torch.utils._pytree.tree_flatten(x)\ntorch._foreach_lerp_(a, b, 0.5)\n"
                      "ok = hasattr(module, '_hf_hook') and module._old_forward\nv = t._version + t._base.numel()\n"
                      "from torch._subclasses.fake_tensor import FakeTensorMode\n"
                      "from diffusers.hooks import ModelHook\nimport torch.nn.functional as F\n"
                      "s = self._private_state + F.relu(x).sum()\nimport os\nos._exit\n")
    lines = sorted({line for line, _ in uses(sample)})
    assert lines == list(range(1, 15)), lines  # not 15 on: public API, dcache's own privates, the standard library
    assert (10, "torch.utils._pytree") in uses(sample) and (11, "torch._foreach_lerp_") in uses(sample)


def test_the_allowed_uses_are_still_there():
    # an allowance whose use is gone is dropped here, so that it cannot hide a new one
    stale = [(rel, name) for rel, name in ALLOWED if name not in {what for _, what in uses(ROOT / rel)}]
    assert not stale, f"allowed private uses no longer present (remove them from ALLOWED): {stale}"
