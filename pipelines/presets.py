"""Calibration shipped with dcache for the models it bundles (registered when dcache.pipelines is imported).

`assets/calibration.json` holds the bundled tiny model's MagCache ratios and TeaCache fit, and the calibrated plans of
ERTACache, ProfilingDiT, InvarDiff and BAC (28 steps; they replay at any step count), written by
`dcache calibrate --method magcache --out pipelines/assets/calibration.json` and the same with `--method teacache`,
`ertacache`, `profilingdit`, `invardiff`, `bac`, so `dcache.apply(load_tiny_pipeline(), NAME)` works out of the box for
every method.
"""

from __future__ import annotations

from pathlib import Path

BUNDLED_CALIBRATION = Path(__file__).resolve().parent / "assets" / "calibration.json"


def register_bundled_calibration() -> bool:
    """Register the shipped tables; False when the file is absent (e.g. before the first calibration)."""
    if not BUNDLED_CALIBRATION.is_file():
        return False
    from dcache.schedules.calibration_file import load_calibration

    load_calibration(BUNDLED_CALIBRATION, register=True)
    return True
