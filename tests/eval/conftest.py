"""Fixtures for the eval tests: a random-weight copy of the bundled tiny model (same classes and config, saved with
save_pretrained, so `--model <folder>` loads it like any pipeline folder) and a random-weight digit classifier.

Random weights keep these tests independent of the trained assets: every assertion here is about the eval machinery
(metric values on known inputs, bookkeeping, files, resume, process-count independence), not image quality.
Everything runs on one CPU thread: CPU matmuls may round differently with another thread count, and the 2-process
equality test compares bit-exact numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:  # makes eval_testkit importable (pyproject's pythonpath holds tests/ only)
    sys.path.insert(0, _HERE)

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from dcache.pipelines.label_encoder import LabelEncoder
    from dcache.pipelines.tiny_pipeline import DigitFlowPipeline
    from dcache.pipelines.train_tiny import LABEL_ENCODER_CONFIG, SCHEDULER_CONFIG, TRANSFORMER_CONFIG

    torch.manual_seed(0)
    pipe = DigitFlowPipeline(FluxTransformer2DModel(**TRANSFORMER_CONFIG),
                             FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), LabelEncoder(**LABEL_ENCODER_CONFIG))
    path = tmp_path_factory.mktemp("tiny-random") / "pipe"
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def classifier_path(tmp_path_factory) -> Path:
    from dcache.pipelines.digit_classifier import DigitClassifier

    torch.manual_seed(1)
    clf = DigitClassifier().eval()
    path = tmp_path_factory.mktemp("clf") / "digit-classifier.safetensors"
    clf.save(path)
    return path


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    """A fresh copy of the output folder of the test module's `finished` fixture (a finished eval or batch run), for
    a test that damages it."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    return out
