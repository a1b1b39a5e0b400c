"""The device and dtype a command runs on when the user names none: the best accelerator there is.

    device, dtype = resolve_device("auto", "auto")   # ("cuda", "bfloat16") on a GPU machine, ("cpu", "float32") else
    describe(device, dtype)                          # "cuda (NVIDIA H100 80GB HBM3), bfloat16"

`auto` picks CUDA, else Apple's MPS, else the CPU, and the dtype large diffusion transformers are loaded in there:
bfloat16 on CUDA (what diffusers' model cards use), float32 on MPS and the CPU (bfloat16 matmuls are slow or
missing there). Every `dcache` command that loads a pipeline (generate, calibrate, search, eval, analyze) goes
through `resolve_device` and says what it picked.
"""

from __future__ import annotations

AUTO = "auto"
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_HELP = "auto (default: cuda, else mps, else cpu), cpu, cuda, cuda:1, mps"
DTYPE_HELP = "auto (default: bfloat16 on CUDA, float32 elsewhere), float32, bfloat16 or float16"


def best_device() -> str:
    """'cuda' when a CUDA GPU is visible, else 'mps' on Apple silicon, else 'cpu'."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def default_dtype(device: str) -> str:
    """bfloat16 on CUDA, float32 elsewhere."""
    return "bfloat16" if device.split(":")[0] == "cuda" else "float32"


def resolve_device(device: str | None = AUTO, dtype: str | None = AUTO) -> tuple[str, str]:
    """(device, dtype) with `auto` / None replaced by `best_device()` / `default_dtype(device)`; checks the names."""
    device = best_device() if device in (None, "", AUTO) else device
    if dtype in (None, "", AUTO):
        dtype = default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)} or {AUTO}.")
    return device, dtype


def describe(device: str, dtype: str) -> str:
    """'cuda (NVIDIA H100 80GB HBM3), bfloat16' / 'cpu (4 torch threads), float32': what a command prints."""
    import torch

    kind = device.split(":")[0]
    if kind == "cuda" and torch.cuda.is_available():
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        where = torch.cuda.get_device_name(index)
    elif kind == "cpu":
        threads = torch.get_num_threads()
        where = f"{threads} torch thread{'s' if threads != 1 else ''}"
    else:
        where = kind
    return f"{device} ({where}), {dtype}"


__all__ = ["resolve_device", "best_device", "default_dtype", "describe", "AUTO", "DEVICE_HELP", "DTYPE_HELP"]
