"""Makes tests/schedules/schedule_testkit.py importable (pyproject's pythonpath only holds tests/), and runs these
tests on one intra-op thread: the models are tiny, and on a shared 2-core machine torch's thread pool makes a tiny
forward ~10x slower than one thread (oversubscription)."""

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True, scope="module")  # module scope: before module-scoped model fixtures
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
