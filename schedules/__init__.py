"""Caching policies: one file per method (frozen config + schedule). Importing this package registers them all.

Every module in this folder is imported here, so a new method only adds its own file.
"""

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
