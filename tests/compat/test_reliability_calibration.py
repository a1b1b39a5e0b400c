"""Calibration files are validated when read: a table that would fail inside a generation (an empty ratio list, a
string table) or silently switch caching off (NaN, infinite, zero or negative ratios, an empty TeaCache entry) is a
CalibrationError naming the file, the entry and the field, and the fix; oversized files are refused from their
size. Fuzzed: any field of a valid file replaced by any JSON value (or deleted) gives that error or a correct run."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from compat_kit import dcache_hook_count, make_pipeline, rel_error, scheduler_is_pristine, seeded
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dcache
from dcache.schedules.calibration_file import MAX_CALIBRATION_BYTES, CalibrationError, load_calibration
from dcache.schedules.tables import model_identity

STEPS = 4


def generate(pipe) -> torch.Tensor:
    return pipe([1, 7], num_inference_steps=STEPS, guidance_scale=2.0, generator=seeded(0))


@pytest.fixture(scope="module")
def setup():
    pipe = make_pipeline()
    uncached = generate(pipe)
    ident = model_identity(pipe.transformer)
    entry = {"model_identity": ident, "model_class": type(pipe.transformer).__name__, "num_steps": STEPS,
             "scheduler": type(pipe.scheduler).__name__, "resolution": None, "runs": 1, "provenance": {}}
    valid = {"format": "dcache.calibration", "version": 1, "entries": [
        {**entry, "method": "magcache", "table": {"cond": [1.0, 0.99, 0.98, 0.97], "uncond": [1.0, 0.99, 0.98, 0.9]}},
        {**entry, "method": "teacache", "table": {"coefficients": [0.0, 0.0, 0.0, 1.0, 0.0], "threshold": 0.3,
                                                  "x_range": [0.01, 1.0]}}]}
    return pipe, uncached, valid


def write(tmp_path, data) -> str:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    return str(path)


BAD_TABLES = {
    "empty ratios": ("magcache", {"cond": []}, "table.cond"),
    "string table": ("magcache", "1.0,0.9", "table"),
    "string ratios": ("magcache", {"cond": "0.9"}, "table.cond"),
    "NaN ratio": ("magcache", {"cond": [1.0, math.nan, 0.9, 0.9]}, "table.cond"),
    "infinite ratio": ("magcache", {"cond": [1.0, math.inf, 0.9, 0.9]}, "table.cond"),
    "zero ratio": ("magcache", {"cond": [1.0, 0.0, 0.9, 0.9]}, "table.cond"),
    "negative ratio": ("magcache", {"cond": [1.0, -0.5, 0.9, 0.9]}, "table.cond"),
    "bad uncond": ("magcache", {"cond": [1.0] * 4, "uncond": [True, 1.0]}, "table.uncond"),
    "empty teacache": ("teacache", {}, "table.coefficients"),
    "short coefficients": ("teacache", {"coefficients": [1, 2]}, "table.coefficients"),
    "NaN threshold": ("teacache", {"coefficients": [0, 0, 0, 1, 0], "threshold": math.nan}, "table.threshold"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_bad_tables_are_refused_at_load_naming_the_field(setup, tmp_path, case):
    pipe, _, valid = setup
    method, table, field = BAD_TABLES[case]
    data = copy.deepcopy(valid)
    data["entries"] = [dict(e, table=table) for e in data["entries"] if e["method"] == method]
    path = write(tmp_path, data)
    with pytest.raises(CalibrationError) as info:
        load_calibration(path)
    message = str(info.value)
    assert path in message and field in message and "recalibrate" in message, message
    with pytest.raises(CalibrationError):  # and through apply: nothing hooked
        dcache.apply(pipe, method, calibration=path)
    assert dcache_hook_count(pipe.transformer) == 0


def test_an_oversized_calibration_file_is_refused_from_its_size(tmp_path):
    path = tmp_path / "cal.json"
    with open(path, "wb") as f:
        f.truncate(MAX_CALIBRATION_BYTES + 1)
    with pytest.raises(CalibrationError, match=f"cal.json.*{MAX_CALIBRATION_BYTES:,}.*recalibrate"):
        load_calibration(path)


def test_deep_nesting_is_a_calibration_error(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CalibrationError, match="nested too deeply"):
        load_calibration(path)


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=8)
# where a value is replaced: (path of keys and indices into the file); entry 0 is MagCache's, entry 1 TeaCache's
PLACES = ([("format",), ("version",), ("entries",)]
          + [("entries", i, k) for i in (0, 1) for k in ("method", "model_identity", "model_class", "table",
                                                        "num_steps", "scheduler", "resolution", "runs", "provenance")]
          + [("entries", 0, "table", k) for k in ("cond", "uncond")] + [("entries", 0, "table", "cond", 2)]
          + [("entries", 1, "table", k) for k in ("coefficients", "threshold", "ret_steps", "ret_ratio",
                                                  "cutoff_steps", "x_range")]
          + [("entries", 1, "table", "coefficients", 3)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(place=st.sampled_from(PLACES), value=JSON, delete=st.booleans())
@example(place=("entries", 0, "table", "cond"), value=[], delete=False)
@example(place=("entries", 1, "table"), value={}, delete=False)
@example(place=("entries", 0, "table", "cond", 2), value=0.0, delete=False)
@example(place=("entries", 1, "table", "threshold"), value=None, delete=False)  # null = not calibrated
@example(place=("entries", 1, "table", "ret_steps"), value=None, delete=False)  # null = not calibrated
@example(place=("entries", 1, "table", "ret_ratio"), value=None, delete=False)  # null = not calibrated
@example(place=("entries", 1, "table", "cutoff_steps"), value=None, delete=False)  # null = not calibrated
@example(place=("entries", 1, "table", "x_range"), value=None, delete=False)  # null = not calibrated
def test_calibration_files(setup, tmp_path, place, value, delete):
    pipe, uncached, valid = setup
    data = copy.deepcopy(valid)
    node = data
    for key in place[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        node.pop(place[-1], None)
    else:
        node[place[-1]] = value
    path = write(tmp_path, data)
    try:
        load_calibration(path)
    except ValueError as exc:
        assert path in str(exc), f"{type(exc).__name__} does not name the file: {exc}"
        return
    for method in ("magcache", "teacache"):
        handle = None
        try:
            handle = dcache.apply(pipe, method, calibration=path)
            out = generate(pipe)
        except ValueError as exc:  # an entry that no longer matches this model: the file and what it lacks
            assert "calibrat" in str(exc) and path in str(exc), exc
            continue
        finally:
            if handle is not None:
                handle.remove()
            assert dcache_hook_count(pipe.transformer) == 0 and scheduler_is_pristine(pipe.scheduler)
        assert torch.isfinite(out).all() and rel_error(out, uncached) < 1.0
