"""Makes tests/search/search_testkit.py importable (pyproject's pythonpath only holds tests/); one intra-op thread
(tiny models on a shared 2-core machine); the tiny pipeline once per session."""

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import search_testkit  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_pipe():
    return search_testkit.tiny_pipe()


@pytest.fixture
def calib(tiny_pipe):
    return search_testkit.make_calibration(tiny_pipe)
