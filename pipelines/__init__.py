"""Pipeline-level wrapping, the bundled tiny model, shipped calibration and the `dcache` CLI."""

from .presets import register_bundled_calibration

register_bundled_calibration()
