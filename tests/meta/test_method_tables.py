"""One file per method: what dcache needs to know about a method is declared on its config class (`MethodConfig`:
main_knob, title, calibrator, check_calibration_table, estimate_placeholder, search_seeds) and read through the
registry (dcache/methods.py), never from a table keyed by method names elsewhere.

A method's own files are the module of its config class and the module its calibrator names; every other source
file may not hold a dict literal (or `dict(...)` call) with a registered method or preset name as a key."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import dcache
from dcache.methods import calibrator, methods, search_seeds

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("dcache", "schedules", "pipelines", "eval", "kernels")


def method_files() -> set[Path]:
    """The files that belong to a registered method: its config's module and its calibrator's module."""
    files = set()
    for config_cls in methods().values():
        files.add(Path(sys.modules[config_cls.__module__].__file__).resolve())
        if config_cls.calibrator is not None:
            files.add(Path(sys.modules[calibrator(config_cls.method)[1].__module__].__file__).resolve())
    return files


def keyed_by(source: str, names: set[str]) -> list[tuple[int, list[str]]]:
    """(line, the names) of every dict literal or dict(...) call in `source` with one of `names` as a key."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            keys = [k.arg for k in node.keywords if k.arg in names]
        else:
            continue
        if keys:
            found.append((node.lineno, keys))
    return found


def test_the_scan_finds_a_method_table():
    source = ('A = {"magcache": 1, "other": 2}\nB = dict(teacache=3)\nC = {"threshold": 0.1}\n'
              'def f(method):\n    return {"bac": "BAC"}[method]\n')
    assert keyed_by(source, {"magcache", "teacache", "bac"}) == [(1, ["magcache"]), (2, ["teacache"]),
                                                                  (5, ["bac"])]


def test_no_method_name_table_outside_the_method_files():
    names = set(methods()) | set(dcache.presets())
    own = method_files()
    tables = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() in own:
                continue
            tables += [f"{path.relative_to(ROOT)}:{line} keyed by {keys}"
                       for line, keys in keyed_by(path.read_text(), names)]
    assert not tables, ("a table keyed by method names: declare the value on each method's config class "
                        "(dcache/config.py, MethodConfig) and read it through dcache.methods instead:\n"
                        + "\n".join(tables))


@pytest.mark.parametrize("name", sorted(methods()))
def test_what_a_method_declares_is_usable(name):
    config_cls = methods()[name]
    if config_cls.main_knob is not None:
        knob, grid = config_cls.main_knob
        assert grid and all(dcache.config_for(name, **{knob: value}) for value in grid)
    if config_cls.calibrator is not None:
        kind, function = calibrator(name)
        assert kind in ("plan", "table") and callable(function)
        # a table goes into calibration files, which check it with the method's own check
        assert (config_cls.check_calibration_table is not None) == (kind == "table")
    if config_cls.estimate_placeholder is not None:
        dcache.config_for(name, **config_cls.estimate_placeholder)
    for seed, (method, settings) in search_seeds().items():
        if method == name:
            assert settings and all(dcache.config_for(name, **s) for s in settings), seed

