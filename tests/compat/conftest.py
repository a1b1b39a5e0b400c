"""Compatibility matrix (see COMPATIBILITY.md): makes compat_kit importable, pins one intra-op thread (tiny models on a
shared 2-core machine run ~10x faster without torch's thread pool), and registers the `long` marker: the
minutes-long checks (inductor's C++ codegen, the 500-generation soak), deselected unless `--run-long` is given (or
`-m long`). Tests marked `slow` run in `make test` like everywhere else."""

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_addoption(parser):
    try:
        parser.addoption("--run-long", action="store_true", default=False,
                         help="also run tests marked long (inductor codegen, the 500-generation soak)")
    except ValueError:  # registered by another conftest
        pass


def pytest_configure(config):
    config.addinivalue_line("markers", "long: minutes on a 2-core CPU (inductor codegen, 500-generation soak); run "
                                       "with --run-long or -m long")
    config.addinivalue_line("markers", "distributed: forks 2 gloo CPU processes (context parallel, ~5 s); "
                                       "deselect with -m 'not distributed'")


def pytest_collection_modifyitems(config, items):
    """Deselect the compat suite's long tests unless asked for (other folders keep their own rules)."""
    if config.getoption("--run-long", default=False) or "long" in (config.getoption("-m") or ""):
        return
    here = Path(_HERE)
    keep, drop = [], []
    for item in items:
        in_compat = Path(str(item.fspath)).resolve().is_relative_to(here)
        (drop if in_compat and item.get_closest_marker("long") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
