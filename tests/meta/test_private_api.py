"""The core uses diffusers' and torch's private API only through dcache/compat/, where each use is documented and
checked against the installed versions (tests/compat/test_diffusers_contract.py).

Read from the syntax tree of every core module outside dcache/compat/: an import from diffusers of a private module
or name (a leading underscore, or the internal `diffusers.hooks.hooks`), an import of `torch._C` / `torch._dynamo`,
`sys._getframe`, and the diffusers internals dcache relies on, as attributes or strings (`getattr(m, "...")`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "dcache"
COMPAT = CORE / "compat"
# diffusers internals dcache reads (dcache/compat/diffusers.py documents each)
INTERNALS = {"fn_ref", "_diffusers_hook", "_cache_config", "_parallel_config", "_flattened_mesh", "_is_stateful",
             "StateManager", "_getframe"}
# (file, name): read inline in a frame dynamo skips (torch.compiler.disable(recursive=False)), where a compat
# helper would be traced by dynamo; dcache.compat.diffusers.original_forward documents the attribute
ALLOWED = {("dcache/runtime/hooks.py", "fn_ref")}


def _private_module(name: str, package: str) -> bool:
    parts = name.split(".")
    return parts[0] == package and (any(p.startswith("_") for p in parts) or name == "diffusers.hooks.hooks")


def uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every private use in the module at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for package in ("diffusers", "torch"):
                if package == "torch" and not node.module.startswith(("torch._C", "torch._dynamo")):
                    continue
                if _private_module(node.module, package) or (
                        package == "diffusers" and node.module.split(".")[0] == "diffusers"
                        and any(a.name.startswith("_") for a in node.names)):
                    found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _private_module(alias.name, "diffusers") or alias.name.startswith(("torch._C", "torch._dynamo")):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Attribute) and node.attr in ("_C", "_dynamo") and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            found.append((node.lineno, f"torch.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in INTERNALS:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Name) and node.id in INTERNALS:
            found.append((node.lineno, node.id))
    return found


def test_only_the_compat_modules_use_private_diffusers_and_dynamo_api():
    bad = []
    for path in sorted(CORE.rglob("*.py")):
        if COMPAT in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{line}: {what}" for line, what in uses(path) if (rel, what) not in ALLOWED]
    assert not bad, "private diffusers / torch API outside dcache/compat/ (add an entry there, with its contract " \
                    "test in tests/compat/test_diffusers_contract.py):\n" + "\n".join(bad)


def test_the_guard_sees_each_kind_of_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from diffusers.hooks.hooks import StateManager\nimport torch._dynamo\n"
                      "from torch._C._dynamo.eval_frame import get_eval_frame_callback\n"
                      "from diffusers.models import _private\nx = getattr(m, '_cache_config', None)\n"
                      "y = hook.fn_ref.original_forward\nz = torch._dynamo.is_compiling()\n"
                      "from diffusers.hooks import ModelHook\n")
    assert sorted({line for line, _ in uses(sample)}) == [1, 2, 3, 4, 5, 6, 7]  # not line 8: public


def test_the_allowed_uses_are_still_there():
    # an allowance whose use is gone is dropped here, so that it cannot hide a new one
    stale = [(rel, name) for rel, name in ALLOWED if name not in {what for _, what in uses(ROOT / rel)}]
    assert not stale, f"allowed private uses no longer present (remove them from ALLOWED): {stale}"
