"""Method packages: how methods, presets, forecasters and the target resolver reach the core.

The core names no method and imports nothing above it. A method package registers its configs (register_method),
presets (register_preset), plan forecasters (dcache.runtime.forecast.register_forecaster) and target resolver
(register_target_resolver) when it is imported, and declares itself under the `dcache.methods` entry point of its
distribution, e.g. in its pyproject.toml:

    [project.entry-points."dcache.methods"]
    my_methods = "my_package.methods"

The first registry lookup (dcache.methods(), config_for, dcache.apply with a name, a plan with a forecaster) imports
every package of that group once. dcache's own methods (the dcache.schedules package) are declared the same way.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable

ENTRY_POINT_GROUP = "dcache.methods"

_loaded = False  # the packages are being imported or have been
_imported = False  # every package has been imported
_DEFERRED: list[Callable[[], Any]] = []  # registrations that import the method packages, run at the first lookup


def defer_registration(register: Callable[[], Any]) -> None:
    """Run `register()` at the first registry lookup instead of now: a package that registers data for the methods
    (dcache.pipelines: the bundled model's calibration) stays cheap to import, so the `dcache` command starts
    without torch where it needs none (`dcache --help`)."""
    _DEFERRED.append(register)


def load_method_packages() -> None:
    """Import every package declared under the `dcache.methods` entry point group, once per process, then run the
    deferred registrations."""
    global _loaded, _imported
    if _loaded:
        if _imported:  # not while the packages are being imported: a registration may need all their methods
            _run_deferred()
        return
    _loaded = True  # set first: a package that looks up the registry while it is imported must not recurse
    try:
        for entry in _declared():
            try:
                entry.load()
            except Exception as error:
                raise ImportError(f"the method package {entry.value!r} (entry point {entry.name!r} of group "
                                  f"{ENTRY_POINT_GROUP!r}) failed to import: {error}. Fix or uninstall the "
                                  f"package that declares it.") from error
    except BaseException:
        _loaded = False  # the next lookup retries and reports the same error
        raise
    _imported = True
    _run_deferred()


def _run_deferred() -> None:
    while _DEFERRED:
        _DEFERRED.pop(0)()  # popped first: a registration that looks up the registry must not run itself again


def _declared() -> list[importlib.metadata.EntryPoint]:
    """Every entry point of the group, from every distribution's metadata on sys.path. Not deduplicated by
    distribution name as importlib.metadata.entry_points() is: that keeps the first metadata found, which can be a
    stale `dcache.egg-info` left in a checkout's root (first on sys.path when Python runs from there)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for dist in importlib.metadata.distributions():
        for entry in dist.entry_points:
            if entry.group == ENTRY_POINT_GROUP:
                found.setdefault(entry.value, entry)
    return list(found.values())


def no_methods_hint() -> str:
    """The fix when the registries are empty after loading: dcache's metadata is missing."""
    return (f"no method package declared itself under the {ENTRY_POINT_GROUP!r} entry point group, so dcache's "
            f"built-in methods are not registered: install dcache as a distribution (pip install dcache, or "
            f"pip install -e . in a checkout) rather than importing it from a bare source tree.")
