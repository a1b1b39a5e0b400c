"""Fixtures of the benchmark scripts' tests: a script of benchmarks/ loaded by path (it is a script, not a module of
the package)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark("frontier") -> benchmarks/frontier.py as module dcache_benchmark_frontier, registered in
    sys.modules (dataclasses look their module up there); one module per script for the session."""

    def load(stem: str):
        name = f"dcache_benchmark_{stem}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{stem}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name]

    return load
