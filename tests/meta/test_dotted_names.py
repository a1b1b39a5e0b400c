"""Every dotted name the documents and the source's comments give resolves: `dcache.runtime.engine.Engine`,
`dcache.apply`, and `Engine.begin_call` where `Engine` is a class dcache defines.

A renamed module or method otherwise leaves docs and comments pointing at nothing (a comment citing
`Engine._sync_signals` after it was gone). Scanned: the markdown documents, and the comments and docstrings of the
installed packages' source. Quoted whole names such as "dcache.plan" are file-format identifiers, not modules, and
are skipped.
"""

from __future__ import annotations

import ast
import functools
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", "BENCHMARKS.md", "COMPATIBILITY.md", "SUPPORT.md",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
SOURCE_FOLDERS = ["dcache", "schedules", "kernels", "pipelines", "eval"]
DOTTED = re.compile(r"(?<![\w.\"'/])dcache(?:\.[A-Za-z_]\w*)+(?![\w-])")
QUOTED = re.compile(r"[\"'](dcache\.[\w.-]+)[\"']")


def resolves(dotted: str) -> bool:
    """The longest importable module prefix, then attributes (or submodules) for the rest."""
    parts = dotted.rstrip(".").split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
                continue
            try:
                obj = importlib.import_module(f"{obj.__name__}.{name}")
            except (ImportError, AttributeError):
                return False
        return True
    return False


def _prose(path: Path) -> str:
    """A source file's comments and docstrings (string expressions standing alone), one per line."""
    text = path.read_text()
    pieces = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
              if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            pieces.append(node.value.value)
    return "\n".join(pieces)


@functools.lru_cache(maxsize=1)
def _texts() -> dict[str, str]:
    texts = {doc: (ROOT / doc).read_text() for doc in DOCUMENTS}
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            texts[str(path.relative_to(ROOT))] = _prose(path)
    return texts


def test_the_resolver_tells_modules_attributes_and_missing_names_apart():
    assert resolves("dcache.runtime.engine.Engine.begin_call") and resolves("dcache.apply")
    assert not resolves("dcache.runtime.engine.Engine.no_such_member") and not resolves("dcache.no_such_module")


@functools.lru_cache(maxsize=1)
def _identifiers() -> frozenset[str]:
    """File-format and entry-point names the source quotes whole ("dcache.plan", "dcache.methods"): not modules."""
    found = set()
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            found.update(QUOTED.findall(path.read_text()))
    return frozenset(found)


@pytest.mark.parametrize("where", sorted(_texts()))
def test_every_dotted_dcache_name_resolves(where):
    text = _texts()[where]
    missing = sorted({m.group(0).rstrip(".") for m in DOTTED.finditer(text)
                      if m.group(0) not in _identifiers() and not resolves(m.group(0))})
    assert not missing, f"{where} names {missing}, which do not exist: update the text to the current name"


MEMBER = re.compile(r"(?<![\w.])([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)\.(_{0,2}[a-z][a-z0-9_]*)(?![\w(-])")


@functools.lru_cache(maxsize=1)
def _class_members() -> dict[str, set[str]]:
    """Class name -> every name its body (and its bases' bodies, by name) defines, for classes dcache defines once."""
    bodies: dict[str, list[ast.ClassDef]] = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bodies.setdefault(node.name, []).append(node)

    def own(node: ast.ClassDef) -> set[str]:
        names = set()
        for item in ast.walk(node):
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(item.name)
            elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and \
                    item.value.id in ("self", "cls"):
                names.add(item.attr)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
            elif isinstance(item, ast.Assign):
                names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        return names

    members: dict[str, set[str]] = {}
    for name, nodes in bodies.items():
        if len(nodes) != 1:
            continue  # a name two modules define: ambiguous in prose
        node, seen = nodes[0], set()
        stack = [node]
        while stack:
            cls = stack.pop()
            members.setdefault(name, set()).update(own(cls))
            for base in cls.bases:
                base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if base_name in bodies and len(bodies[base_name]) == 1 and base_name not in seen:
                    seen.add(base_name)
                    stack.append(bodies[base_name][0])
            if any(not (isinstance(b, ast.Name) and b.id in bodies) for b in cls.bases):
                members[name].add("*")  # a base dcache does not define: its members are not known here
    return members


@pytest.mark.parametrize("where", sorted(_texts()))
def test_every_class_member_the_text_names_exists(where):
    members = _class_members()
    missing = sorted({m.group(0) for m in MEMBER.finditer(_texts()[where])
                      if m.group(1) in members and "*" not in members[m.group(1)]
                      and m.group(2) not in members[m.group(1)]})
    assert not missing, f"{where} names {missing}, which its class does not define: update the text to the new name"
