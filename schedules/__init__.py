"""Caching policies: one file per method (frozen config + schedule). Importing this package registers them all.

Every module file in this folder is imported here, so a new method only adds its own file. Subpackages are not:
the offline tuning layer (`dcache.schedules.tuning`: profiling, calibration, plan search) sits above the policies
and is imported on its own. `dcache.schedules.forecasters` (what a FORECAST serves besides Taylor) is imported here
first: its names are what plans' extras["forecaster"] and the methods' `forecaster` knobs look up.
"""

import importlib
import pkgutil

from . import forecasters  # noqa: F401 - registers the plan forecasters (dcache.runtime.forecast)

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_") and not _info.ispkg:
        importlib.import_module(f"{__name__}.{_info.name}")
