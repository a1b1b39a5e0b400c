"""Whether a measured speed-up can be trusted: the spread of its repeats and how busy the machine was.

    spread([0.31, 0.30, 0.42])                 # {"min": 0.30, "median": 0.31, "max": 0.42, "repeats": 3}
    timing_warnings({"uncached": [...], "cached": [...]})   # ["uncached repeats disagree: ...", "load average ..."]

A speed-up is a ratio of two medians; it means little when the repeats behind a median disagree (relative spread
(max - min) / median above SPREAD_TOLERANCE) or when other jobs compete for the cores (1-minute load average above
half the cores: wall-clock time then also counts waiting for a core, where process CPU time does not).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence

SPREAD_TOLERANCE = 0.10  # (max - min) / median of the repeats above this: they disagree
LOAD_FRACTION = 0.5  # 1-minute load average above this fraction of the cores: a busy machine


def spread(samples: Sequence[float]) -> dict[str, float]:
    """min / median / max of the repeats (NaN when there are none) and their count."""
    if not samples:
        nan = float("nan")
        return {"min": nan, "median": nan, "max": nan, "repeats": 0}
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples), "repeats": len(samples)}


def relative_spread(samples: Sequence[float]) -> float:
    """(max - min) / median; 0 for fewer than two repeats."""
    if len(samples) < 2:
        return 0.0
    median = statistics.median(samples)
    return (max(samples) - min(samples)) / median if median > 0 else float("inf")


def load_average() -> tuple[float, int] | None:
    """(1-minute load average, CPU cores), or None where the OS has no load average (Windows)."""
    if not hasattr(os, "getloadavg"):
        return None
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except OSError:
        return None


def timing_warnings(samples: Mapping[str, Sequence[float]], *, tolerance: float = SPREAD_TOLERANCE,
                    load: tuple[float, int] | None | str = "measure") -> list[str]:
    """One sentence per reason not to trust the timing: repeats of a variant that disagree, a busy machine.

    samples: variant name -> wall-clock seconds of its repeats. load: (load average, cores), None to skip the
    check, or "measure" (default) to read it now."""
    out = []
    for name, values in samples.items():
        rel = relative_spread(values)
        if rel > tolerance:
            out.append(f"{name} repeats disagree: {min(values):.3f}-{max(values):.3f} s, a spread of {rel:.0%} of "
                       f"the median (more than {tolerance:.0%}); the speed-up is uncertain by about as much. Use more "
                       f"--repeats, or a machine without other jobs.")
    if load == "measure":
        load = load_average()
    if load is not None:
        avg, cores = load
        if avg > LOAD_FRACTION * cores:
            out.append(f"load average {avg:.1f} on {cores} cores: other jobs compete for the CPU, so wall-clock "
                       f"times are inflated unevenly; the CPU-time speed-up is closer to the work saved.")
    return out


__all__ = ["spread", "relative_spread", "load_average", "timing_warnings", "SPREAD_TOLERANCE", "LOAD_FRACTION"]
