"""The zoo's tiny Flux and its inputs for STEPS steps, shared by the cache-storage tests."""

import pytest
from zoo import ZOO

STEPS = 8  # the step count those tests run (each file's STEPS)


@pytest.fixture(scope="module")
def flux():
    entry = ZOO["flux"]
    return entry.make_model(), [entry.make_inputs(step) for step in range(STEPS)]
