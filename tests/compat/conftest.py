"""Compatibility matrix (see COMPATIBILITY.md): makes compat_kit importable, pins one intra-op thread (tiny models on a
shared 2-core machine run ~10x faster without torch's thread pool), and registers the `slow` marker, deselected
unless `--run-slow` is given (or `-m slow`)."""

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_addoption(parser):
    try:
        parser.addoption("--run-slow", action="store_true", default=False,
                         help="also run tests marked slow (the long soak of the compat matrix)")
    except ValueError:  # registered by another conftest
        pass


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (compat soak); run with --run-slow or -m slow")
    config.addinivalue_line("markers", "distributed: forks 2 gloo CPU processes (context parallel, ~5 s); "
                                       "deselect with -m 'not distributed'")


def pytest_collection_modifyitems(config, items):
    """Deselect the compat suite's slow tests unless asked for (other folders keep their own rules)."""
    if config.getoption("--run-slow", default=False) or "slow" in (config.getoption("-m") or ""):
        return
    here = Path(_HERE)
    keep, drop = [], []
    for item in items:
        in_compat = Path(str(item.fspath)).resolve().is_relative_to(here)
        (drop if in_compat and item.get_closest_marker("slow") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
