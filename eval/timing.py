"""Cost measurements: wall-clock latency (warm-up, device synchronisation, repeats; median and spread), process CPU
time of the same repeats, FLOPs of one generation (torch's FlopCounterMode) and peak accelerator memory.

    timing = measure(lambda: pipe(...), repeats=5, warmup=1, device="cuda")
    timing.median, timing.iqr, timing.samples, timing.cpu_samples, timing.peak_memory_bytes
    out, flops = count_flops(lambda: pipe(...))
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from dcache import quality


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for queued kernels on `device` (CUDA / XPU / MPS); a no-op on the CPU."""
    dev = torch.device(device) if device is not None else None
    kind = dev.type if dev is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev if dev is not None and dev.index is not None else None)
    elif kind == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.synchronize()
    elif kind == "mps" and torch.backends.mps.is_available():
        torch.mps.synchronize()


@dataclass
class Timing:
    """Seconds per timed repeat (after warm-up) and their summary; peak memory of the timed repeats (CUDA only).
    `cpu_samples`: process CPU seconds of the same repeats (all threads): on a CPU shared with other jobs it stays
    close to the work done, where wall-clock time grows with the load."""

    samples: list[float] = field(default_factory=list)
    warmup: int = 0
    peak_memory_bytes: int | None = None
    cpu_samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return quality.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else float("nan")

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    @property
    def iqr(self) -> float:
        """Interquartile range (q3 - q1); 0 with fewer than 2 samples."""
        if len(self.samples) < 2:
            return 0.0
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[2] - q[0]

    def summary(self) -> dict[str, Any]:
        s = self.samples
        return {"median_s": self.median, "mean_s": self.mean, "std_s": self.std, "iqr_s": self.iqr,
                "min_s": min(s) if s else float("nan"), "max_s": max(s) if s else float("nan"), "repeats": len(s),
                "warmup": self.warmup, "peak_memory_bytes": self.peak_memory_bytes}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **self.summary()}


def measure(fn: Callable[[], Any], *, repeats: int = 3, warmup: int = 1,
            device: str | torch.device | None = None) -> tuple[Any, Timing]:
    """Run fn `warmup` times untimed, then `repeats` times timed, each between two device synchronisations.
    Returns (last output, Timing). Peak memory is reset before the timed repeats (CUDA)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0.")
    out = None
    for _ in range(warmup):
        out = fn()
    cuda = _is_cuda(device)
    if cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    samples, cpu = [], []
    for _ in range(repeats):
        synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    return out, Timing(samples, warmup, peak, cpu)


def count_flops(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(output, total FLOPs) of one call of fn, counted by torch.utils.flop_counter.FlopCounterMode (matmuls,
    convolutions, attention: the ops that dominate a diffusion transformer; element-wise ops count as 0)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = fn()
    return out, float(counter.get_total_flops())


def _is_cuda(device: str | torch.device | None) -> bool:
    if device is None:
        return False
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


__all__ = ["measure", "count_flops", "synchronize", "Timing"]
