"""Suite-wide settings, so that `pytest` and `python -m pytest` behave the same from any directory.

- One intra-op thread, in this process and the ones tests start: the test models are tiny, so one thread is fastest
  (and fair on a 2-core CI).
- Import names: the package is imported as `dcache`, `dcache.kernels`, `dcache.schedules`, ... only. Neither the
  repository root nor tests/ stays on sys.path (`python -m pytest` puts the working directory there): the root's
  source folders (kernels/, schedules/, pipelines/, eval/) and tests/' folders of the same names would otherwise be
  importable as top-level `kernels`, `schedules`, ... and mask import mistakes (tests/meta/test_packaging.py checks).
- The suite's shared helpers tests/zoo.py, tests/toy_models.py, tests/real_pipelines.py and tests/state_fuzz.py are
  importable as `zoo`, `toy_models`, `real_pipelines` and `state_fuzz`.
- The longest test files run first (pytest_collection_modifyitems below), so that `make test`'s workers finish
  together.
"""

import functools
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
# ... and in every process a test starts (fresh interpreters, `accelerate launch`, pytest in pytest): torch's default
# of one OpenMP thread per core oversubscribes the CPU the other pytest worker (and any other job) is using, and its
# spin-waiting threads then slow the process many times over (measured: the plugin test's fresh process, 17 s on an
# idle core, took 73 s beside one busy process with its default 2 threads).
os.environ["OMP_NUM_THREADS"] = "1"

_TESTS = Path(__file__).resolve().parent
_HIDDEN = {_TESTS, _TESTS.parent}


def _hidden(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() in _HIDDEN
    except OSError:
        return False


sys.path[:] = [entry for entry in sys.path if not _hidden(entry)]


class _Helpers(importlib.abc.MetaPathFinder):
    """Finds the shared helpers by name when a test first imports them, not at start-up: zoo imports every model family
    and so diffusers (~5 s), which a pytest process that runs no zoo test (the fresh sessions of
    tests/meta/test_prompt_exit.py) need not pay."""

    NAMES = ("zoo", "toy_models", "real_pipelines", "state_fuzz")

    def find_spec(self, name, path=None, target=None):
        if path is None and name in self.NAMES:
            return importlib.util.spec_from_file_location(name, _TESTS / f"{name}.py")
        return None


sys.meta_path.insert(0, _Helpers())


# Leave as soon as the summary is printed (also after Ctrl-C, which ends in the same summary). Measured on one compile
# test: pytest's closing gc passes (5 x gc.collect over every tensor, graph and model the run kept) and the
# interpreter's teardown of torch, diffusers, triton and hypothesis took 10-25 s after the summary line, ~40 s after a
# whole suite, with nothing left to report. os._exit skips them with the session's exit status; the reports, the
# cache (--lf) and junit files are all written before this hook. DCACHE_TESTS_FULL_TEARDOWN=1 keeps the normal exit
# (e.g. for coverage tools that write at exit).
_SESSION_STATUS: list[int] = []


# Property tests (hypothesis) run a fixed, reproducible set of examples by default, so that CI and a developer see the
# same verdict for the same commit: a fresh clone with random examples once failed on a case no earlier run had drawn.
# To look for new failing cases, run with DCACHE_HYPOTHESIS=explore (random examples, several --hypothesis-seed
# values); every case found becomes an @example of its test.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("fixed", derandomize=True, print_blob=True)
_hypothesis_settings.register_profile("explore", derandomize=False, print_blob=True)
_hypothesis_settings.load_profile(os.environ.get("DCACHE_HYPOTHESIS", "fixed"))


# Longest files first. `make test` runs pytest-xdist with --dist loadfile --no-loadscope-reorder: each file goes to
# one worker, and a worker gets the next file in collection order when it is nearly done. Handing out the longest
# files first (longest-processing-time scheduling) keeps one worker from running a long file alone at the end while
# the other idles. Seconds per file, measured on one core: tests/file_seconds.json (rewrite it with
# `python tests/record_file_seconds.py junit.xml` after `pytest --junitxml=junit.xml`). A file it does not list
# counts as a median one. The sort is stable: the tests of a file keep their order.
_FILE_SECONDS = _TESTS / "file_seconds.json"


def pytest_collection_modifyitems(config, items):
    import json
    import statistics

    seconds = json.loads(_FILE_SECONDS.read_text()) if _FILE_SECONDS.is_file() else {}
    unknown = statistics.median(seconds.values()) if seconds else 0.0
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], unknown))


def pytest_sessionfinish(session, exitstatus):
    _SESSION_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _SESSION_STATUS and not os.environ.get("DCACHE_TESTS_FULL_TEARDOWN"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SESSION_STATUS[-1])


_BENCHMARKS = _TESTS.parent / "benchmarks"


# The process-wide calibration-table registry as it stands once dcache's own tables (published ones and the bundled
# model's shipped calibration) are registered. Tests that calibrate or register tables for a model (the bundled one
# included: `dcache calibrate` registers its result) would otherwise change what MagCache and TeaCache read in every
# later test of the run; it is put back after each test.
_TABLES_AT_START: dict = {}


def pytest_sessionstart(session):
    import dcache.pipelines  # noqa: F401  (defers the bundled model's shipped calibration to the first lookup)
    import dcache.schedules  # noqa: F401  (registers the published tables)
    from dcache.plugins import load_method_packages
    from dcache.schedules import tables

    load_method_packages()  # the first registry lookup: runs the deferred registrations

    _TABLES_AT_START.update(tables._TABLES)


def _restore_tables() -> None:
    tables = sys.modules.get("dcache.schedules.tables")
    if tables is not None and tables._TABLES != _TABLES_AT_START:
        tables._TABLES.clear()
        tables._TABLES.update(_TABLES_AT_START)


def pytest_runtest_teardown(item, nextitem):
    """Put the calibration tables back (above). Benchmark scripts loaded by tests/benchmarks put benchmarks/ on
    sys.path to import their siblings; take it off after each test, with any bare-named module it supplied
    (benchmarks/kernels.py would otherwise answer diffusers' probe for the Hugging Face `kernels` package)."""
    _restore_tables()
    sys.path[:] = [entry for entry in sys.path if not _is_benchmarks(entry)]
    for name in [n for n, m in sys.modules.items() if "." not in n and _is_benchmarks(getattr(m, "__file__", None))]:
        if name in ("kernels", "schedules", "pipelines", "eval"):
            del sys.modules[name]


@functools.lru_cache(maxsize=None)
def _is_benchmarks(entry) -> bool:
    """Whether a sys.path entry or a module's __file__ lies in benchmarks/. Remembered per string: the teardown above
    asks it of every top-level module after every test, and resolving each path anew cost 20-50 ms per test (a
    minute or more of a whole run's CPU)."""
    try:
        return entry is not None and Path(entry).resolve().is_relative_to(_BENCHMARKS)
    except (OSError, TypeError, ValueError):
        return False
