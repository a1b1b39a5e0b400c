"""Pipeline-level wrapping, the bundled tiny model, shipped calibration and the `dcache` CLI."""

from dcache.plugins import defer_registration

from .presets import register_bundled_calibration

# registered at the first registry lookup (dcache.apply, dcache.methods(), a table lookup), not at import: the
# calibration file loader imports the methods and torch, which `dcache --help` does not need
defer_registration(register_bundled_calibration)
