"""The backend switch: selection, restoring, resolution per tensor, clear errors, optional triton."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import dcache.kernels as K
from dcache.kernels import Backend


def test_set_get_and_use_backend_restore():
    assert K.get_backend() is Backend.AUTO
    with K.use_backend("torch") as chosen:
        assert chosen is Backend.TORCH and K.get_backend() is Backend.TORCH
        with K.use_backend(Backend.TRITON):
            assert K.get_backend() is Backend.TRITON
        assert K.get_backend() is Backend.TORCH
    assert K.get_backend() is Backend.AUTO
    K.set_backend("TORCH")
    try:
        assert K.get_backend() is Backend.TORCH
    finally:
        K.set_backend(Backend.AUTO)
    assert K.get_backend() is Backend.AUTO


def test_use_backend_restores_after_an_error():
    with pytest.raises(RuntimeError), K.use_backend("torch"):
        raise RuntimeError("boom")
    assert K.get_backend() is Backend.AUTO


@pytest.mark.parametrize("bad", ["cuda", "", 3, None])
def test_unknown_backend_is_a_value_error_listing_choices(bad):
    with pytest.raises(ValueError, match="'auto', 'torch', 'triton'"):
        K.set_backend(bad)
    assert K.get_backend() is Backend.AUTO


def test_auto_and_torch_pick_torch_on_cpu():
    x = torch.zeros(3)
    assert K.resolve(x) is Backend.TORCH
    with K.use_backend("torch"):
        assert K.resolve(x) is Backend.TORCH


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    x = torch.zeros(3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.triton_available(x)
    with K.use_backend("triton"):
        assert K.resolve(x) is Backend.TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not K.triton_available(x)
    with K.use_backend("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        K.residual_apply(x.view(1, 1, 3), x.view(1, 1, 3))


def test_backends_agree_on_every_op(device):
    # One call of each public op per backend: the dispatch reaches both implementations.
    g = torch.Generator().manual_seed(0)
    h, r = torch.randn(2, 9, 16, generator=g).to(device), torch.randn(2, 7, 16, generator=g).to(device)
    table = torch.randn(3, 2, 9, 16, generator=g).to(device)
    results = {}
    backends = ["torch"] + (["triton"] if K.triton_available(h) else [])
    for b in backends:
        with K.use_backend(b):
            t = table.clone()
            filled = K.taylor_update(t, h, 1, 2)
            results[b] = [
                K.residual_apply(h, r), K.axpy(h, r, 0.5), *K.residual_capture(h, h * 0.5, h * 0.25),
                K.rel_l1_stats(h, h * 0.9), K.rel_l1(h, h * 0.9), t, K.taylor_forecast(t, 2, filled),
            ]
    for got, want in zip(results[backends[-1]], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    """Run python code in a fresh process where `import triton` fails (as if it were not installed)."""
    prelude = "import sys; sys.modules['triton'] = None\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # so that a forced Triton reaches the import
    safe = ["-P"] if getattr(sys.flags, "safe_path", False) else []  # as this process: the checkout stays off sys.path
    return subprocess.run([sys.executable, *safe, "-c", prelude + code], capture_output=True, text=True, env=env,
                          timeout=300)


def test_import_and_torch_path_work_without_triton():
    proc = run_without_triton(
        "import torch, dcache.kernels as K\n"
        "assert not K.triton_available() and K.get_backend() is K.Backend.AUTO\n"
        "h = torch.ones(1, 3, 4)\n"
        "assert K.resolve(h) is K.Backend.TORCH\n"
        "assert torch.equal(K.residual_apply(h, h[:, 1:]),"
        " torch.tensor([1.0, 2.0, 2.0]).view(1, 3, 1).expand(1, 3, 4))\n"
        "K.set_backend('triton')\n"
        "try:\n"
        "    K.residual_apply(h, h)\n"
        "except ValueError as e:\n"
        "    print('ERROR:', e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "ERROR:" in proc.stdout and "pip install triton" in proc.stdout, proc.stdout


def test_inputs_that_require_grad_are_refused(backend, device):
    hidden = torch.ones(1, 4, 8, device=device, requires_grad=True)
    residual = torch.ones(1, 3, 8, device=device)
    with pytest.raises(ValueError, match="no_grad"):
        K.residual_apply(hidden, residual)
    with torch.no_grad():
        assert K.residual_apply(hidden, residual).sum().item() == 32 + 24
