"""Offline tuning: the code that runs a pipeline or model to produce what a runtime policy reads.

Profiling sessions (profiling.py), per-method calibration (calibrate.py: MagCache / TeaCache tables;
<method>_calibration.py: calibrated plans, made and saved by method name through plan_calibration.py), target
resolution (targets.py: `dcache.apply(speed= / quality=)`) and the plan searches (search/) live here, one layer
above the runtime policies (`dcache.schedules.<method>`: a frozen config and a Schedule that decides from numbers
only). Tuning may import the policies and the core; no policy imports tuning, and `import dcache.schedules` does not
load it. The package declares itself under the `dcache.methods` entry point (pyproject.toml), so the first registry
lookup imports it and targets.py registers the target resolver; the search subpackage is imported only where a
search runs.
"""

from . import targets  # noqa: F401  (registers dcache.apply's speed= / quality= resolver)
