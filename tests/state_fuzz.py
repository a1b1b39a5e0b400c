"""Helpers for the tests of resume files: mutations for fuzzing (a loaded state, dicts of values, arrays, tensors,
with one field up to three levels deep replaced by an arbitrary value or deleted), and the id of a process that is
gone (the writer of a temporary file left by kill -9).

    state = mutate(data, loaded)   # data: hypothesis' st.data()
    stale = folder / f".name.{dead_pid()}.0123abcd.tmp.json"
"""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# what a damaged or hand-edited file can hold where a field was: every JSON type, sizes far too large or negative,
# arrays and tensors of other shapes and types
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10**8, 10**8), st.sampled_from([10**7, -1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.tuples(st.integers(0, 5), st.integers(0, 40)).map(lambda s: np.zeros(s, dtype=bool)),
    st.tuples(st.integers(0, 3), st.integers(0, 5)).map(lambda s: torch.zeros(s)),
    st.integers(0, 6).map(lambda n: np.zeros(n, dtype=np.uint8)))

# the same for JSON files (calibration files, batch markers): what json.dumps can write, paths that leave the folder
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10**8, 10**8), st.sampled_from([10**7, -1, 2**64, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
    st.sampled_from(["../../../../etc/hostname", "/etc/hostname", "images/../../x.png", "images/s9-p00000.png"]),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))

FUZZ = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def places(obj, prefix=(), depth=3) -> list[tuple]:
    """Every (key, key, ...) path into the dicts and lists of a loaded state, `depth` levels deep."""
    out = []
    if depth and isinstance(obj, (dict, list)):
        for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            out.append(prefix + (k,))
            out += places(v, prefix + (k,), depth - 1)
    return out


def mutate(data, state, values=VALUES):
    """A deep copy of `state` with one drawn place set to a value drawn from `values` (or deleted)."""
    state = copy.deepcopy(state)
    place = data.draw(st.sampled_from(places(state)), label="place")
    node = state
    for key in place[:-1]:
        node = node[key]
    if data.draw(st.booleans(), label="delete"):
        del node[place[-1]]
    else:
        node[place[-1]] = data.draw(values, label="value")
    return state


def dead_pid() -> int:
    """The id of a process that has exited (a child that printed it): what a killed writer's file name holds."""
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(out.stdout)
