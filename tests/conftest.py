"""Suite-wide settings: the test models are tiny, so one intra-op thread is fastest (and fair on a 2-core CI)."""

import importlib.util
import pathlib
import sys

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def zoo():
    """tests/zoo.py's ZOO (name -> ZooEntry), loaded once under the name the other test modules use."""
    if "dcache_test_zoo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dcache_test_zoo", pathlib.Path(__file__).with_name("zoo.py"))
        sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["dcache_test_zoo"].ZOO
