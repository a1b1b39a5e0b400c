"""GPU tests: skipped on a machine without CUDA (CI has none). On a GPU machine run

    pytest tests/gpu tests/kernels        # tests/kernels runs its Triton cases natively on CUDA when there is one

(or `PYTHONPATH=SITE python -P -m pytest tests/gpu` with dcache's wheel installed into SITE, as benchmarks/gpu_all.sh
does on a machine without the dev environment: -P keeps the checkout's source folders from shadowing the install).

They check what only a GPU can: bf16 outputs on CUDA, inductor-compiled blocks under dcache, and the CUDA-stream
prefetch of an offloaded cache.
"""

import pytest
import torch

collect_ignore_glob: list[str] = []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (these tests check bf16 on CUDA, inductor and CUDA streams)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
