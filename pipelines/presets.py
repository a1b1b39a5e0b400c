"""Calibration shipped with dcache for the models it bundles (registered when dcache.pipelines is imported).

`assets/calibration.json` holds the bundled tiny model's MagCache ratios and TeaCache fit, written by
`dcache calibrate --method magcache --out pipelines/assets/calibration.json` (and `--method teacache`), so
`dcache.apply(load_tiny_pipeline(), "magcache")` works out of the box.
"""

from __future__ import annotations

from pathlib import Path

BUNDLED_CALIBRATION = Path(__file__).resolve().parent / "assets" / "calibration.json"


def register_bundled_calibration() -> bool:
    """Register the shipped tables; False when the file is absent (e.g. before the first calibration)."""
    if not BUNDLED_CALIBRATION.is_file():
        return False
    from dcache.schedules.calibrate import load_calibration

    load_calibration(BUNDLED_CALIBRATION, register=True)
    return True
