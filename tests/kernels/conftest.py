"""Shared fixtures for the kernel tests.

Every op runs on both backends: TORCH (the plain-torch reference) and TRITON. Without a GPU the tests
run on CPU and the Triton cases use triton's interpreter, so TRITON_INTERPRET=1 is set here, before
any kernel is built (dcache.kernels builds its kernels lazily, and triton reads the variable when a
kernel is built). With a GPU they run on CUDA, natively; DCACHE_TEST_DEVICE=cpu|cuda overrides that.

The accuracy bound, elementwise:
    |kernel - ref32| <= 2 * |torch_same_dtype - ref32| + atol + eps(dtype) * scale
ref32 is the op on the fp32 upcast of the same inputs; torch_same_dtype is the torch reference on
the inputs as given. The last term allows one rounding of the result (scale = |ref32| unless a test
says otherwise): triton's CPU interpreter rounds fp32 -> bf16 by truncation (up to 1 ulp) where
torch and the GPU round to nearest (1/2 ulp), and on GPU Triton may fuse a multiply-add.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # never on a GPU machine: the rest of the session may use triton there
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dcache.kernels import Backend, use_backend  # noqa: E402
from dcache.kernels.backend import interpret_mode  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# [B, L, D]: a single element, one token with a large hidden, odd sizes that are no multiple of any
# block size, and a long sequence (4096 + 7 tokens) with a small hidden.
SHAPES = [(1, 1, 1), (2, 1, 3072), (1, 77, 130), (3, 333, 64), (2, 4096 + 7, 48)]
SHAPE_IDS = ["1x1x1", "2x1x3072", "1x77x130", "3x333x64", "2x4103x48"]

# Absolute slack for results that are (close to) zero, per result dtype.
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-5, torch.float16: 1e-5}

TEST_DEVICE = torch.device(os.environ.get("DCACHE_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """The tensors here are small: one intra-op thread is as fast, and does not spin against other work
    on a shared machine (two threads made some 20 ms tests take 1.5 s). Restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def device() -> torch.device:
    return TEST_DEVICE


@pytest.fixture(params=DTYPES, ids=DTYPE_IDS)
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=SHAPES, ids=SHAPE_IDS)
def shape(request) -> tuple[int, int, int]:
    return request.param


@pytest.fixture(params=SHAPES[:-1], ids=SHAPE_IDS[:-1])
def small_shape(request) -> tuple[int, int, int]:
    """SHAPES without the long sequence: for the variants of a test (the interpreter is slow)."""
    return request.param


@pytest.fixture(params=[Backend.TORCH, Backend.TRITON], ids=["torch", "triton"])
def backend(request):
    """Run the test body with this backend forced."""
    if request.param is Backend.TRITON:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        if TEST_DEVICE.type == "cpu" and not interpret_mode():
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (run on a GPU, or set it)")
    with use_backend(request.param):
        yield request.param


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def randn(shape, dtype, device, gen, scale=1.0):
    """Reproducible normal values, drawn on CPU in fp32 then moved and cast."""
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def assert_design_bound(got, same, ref32, scale=None, atol=None, what="result"):
    """|got - ref32| <= 2 |same - ref32| + atol + eps(got.dtype) * scale, elementwise (see module doc)."""
    assert got.shape == ref32.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref32.shape)}"
    got64, same64, ref64 = got.double(), same.double(), ref32.double()
    scale = ref64.abs() if scale is None else scale.double()
    atol = ATOL[got.dtype] if atol is None else atol
    err = (got64 - ref64).abs()
    bound = 2 * (same64 - ref64).abs() + atol + torch.finfo(got.dtype).eps * scale
    excess = err - bound
    worst = int(excess.flatten().argmax()) if excess.numel() else 0
    assert bool((excess <= 0).all()), (
        f"{what}: |kernel - ref32| exceeds the bound at flat index {worst}: "
        f"err {err.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g} "
        f"(kernel {got64.flatten()[worst].item():.6g}, ref32 {ref64.flatten()[worst].item():.6g}, "
        f"torch {same64.flatten()[worst].item():.6g})"
    )


def assert_rel_close(got, want, rtol=1e-4, atol=1e-6, what="stats"):
    """|got - want| <= rtol |want| + atol, elementwise: statistics against a float64 formula."""
    got64, want64 = got.double().cpu(), want.double().cpu()
    err = (got64 - want64).abs()
    assert bool((err <= rtol * want64.abs() + atol).all()), f"{what}: got {got64.tolist()}, want {want64.tolist()}"


@pytest.fixture
def design_bound():
    return assert_design_bound


@pytest.fixture
def rel_close():
    return assert_rel_close


@pytest.fixture
def rand():
    return randn
