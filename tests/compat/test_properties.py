"""Bad input, property-based (hypothesis): every registered method's config and the plan file format.

  * configs: a generated valid config round-trips through JSON exactly; a generated invalid value (wrong type,
    None where None is not the default, out of range, NaN / infinity, a name outside `choices`, an unknown field)
    raises ValueError / TypeError naming `Class.field=value` and what the field must be;
  * plan files: a generated valid plan round-trips through save / load exactly; a corrupted file (truncation, byte
    flips, a wrong or missing version, a field of the wrong JSON type, a missing or unknown field, wrong action
    letters) raises PlanError that says to re-export, never a raw JSONDecodeError / KeyError / TypeError; a plan for
    another model, block layout, unit count or step count names both sides of the mismatch;
  * saving is atomic: a failure anywhere in the write leaves the old file and no temporary file behind.

Examples per test are sized so the file runs in a few seconds (each example is microseconds of work).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from compat_kit import BLOCK_LAYOUT, NUM_BLOCKS, hook_names, make_transformer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcache
from dcache import Plan, PlanError
from dcache.methods import methods, presets

METHODS = sorted(methods())
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------------------- configs
# Element types of list-valued fields: the knob metadata says "a list", the method's check() says of what.
ELEMENTS = {
    ("profilingdit", "background_blocks"): st.lists(st.integers(0, 64), max_size=6),
    ("teacache", "coefficients"): st.lists(st.floats(-1e3, 1e3), min_size=5, max_size=5),
}
POSITIVE_RATIOS = st.lists(st.floats(1e-3, 10.0), min_size=1, max_size=12)  # magcache ratios / ratios_uncond
JUNK = st.one_of(st.text(max_size=8), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@dataclasses.dataclass(frozen=True)
class Knob:
    """What a config field accepts, read from its knob metadata the way MethodConfig validates it."""

    name: str
    kind: str  # "bool" | "int" | "float" | "str" | "seq" | "dict"
    nullable: bool
    low: float | None
    high: float | None
    choices: tuple | None


def knobs(cls) -> list[Knob]:
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        types = meta.get("types") or (type(default),)
        kind = ("bool" if bool in types else "seq" if tuple in types or list in types else "dict" if dict in types
                else "str" if str in types else "float" if float in types else "int")
        out.append(Knob(f.name, kind, default is None, meta.get("low"), meta.get("high"), meta.get("choices")))
    return out


def valid_value(method: str, k: Knob) -> st.SearchStrategy:
    if k.choices is not None:
        base = st.sampled_from(k.choices)
    elif k.kind == "bool":
        base = st.booleans()
    elif k.kind == "int":
        base = st.integers(int(k.low) if k.low is not None else -10**6, int(k.high) if k.high is not None else 10**6)
    elif k.kind == "float":
        lo = k.low if k.low is not None else -1e6
        hi = k.high if k.high is not None else 1e6
        base = st.floats(lo, hi, allow_nan=False)  # float knobs take ints too: 1 and 1.0 must both round-trip
        if math.ceil(lo) <= math.floor(hi):
            base = st.one_of(base, st.integers(math.ceil(lo), math.floor(hi)))
    elif k.kind == "str":
        base = st.text(max_size=12)
    elif k.kind == "seq":
        base = ELEMENTS.get((method, k.name), POSITIVE_RATIOS)
    else:
        base = st.dictionaries(st.text(max_size=6), st.floats(0.0, 1.0), max_size=3)
    return st.one_of(st.none(), base) if k.nullable else base


def invalid_value(k: Knob) -> st.SearchStrategy:
    """Values MethodConfig must reject for this knob, whatever the method's own check() adds."""
    bad = [] if k.nullable else [st.none()]
    if k.kind == "bool":
        bad += [st.integers(), st.text(max_size=5)]
    elif k.kind in ("int", "float"):
        bad += [st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2)]
        if k.kind == "int":
            bad.append(st.floats(allow_nan=False))  # 2.0 is not an int: a count must be written as one
        else:
            bad.append(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        if k.low is not None:
            bad.append(st.integers(max_value=int(k.low) - 1) if k.kind == "int"
                       else st.floats(max_value=k.low, exclude_max=True, allow_infinity=False))
        if k.high is not None:
            bad.append(st.integers(min_value=int(k.high) + 1) if k.kind == "int"
                       else st.floats(min_value=k.high, exclude_min=True, allow_infinity=False))
    elif k.kind == "str":
        bad += [st.integers(), st.floats(allow_nan=False), st.lists(st.text(max_size=3), max_size=2)]
        if k.choices is not None:
            bad.append(st.text(max_size=10).filter(lambda s: s not in k.choices))
    elif k.kind == "seq":
        bad += [st.text(max_size=5), st.integers(), st.just([1.0, float("nan")]), st.just([float("inf")])]
    else:  # a dict knob; a forecaster knob also takes a forecaster's name ('foca'), which hypothesis draws from the
        # string constants of the code it runs, so no name may stand for an invalid text
        from dcache.schedules.forecasters import FORECASTERS, TAYLOR

        names = {TAYLOR, *FORECASTERS}
        bad += [st.lists(st.integers(), max_size=2), st.text(max_size=5).filter(lambda s: s not in names),
                st.just({"ff": float("nan")})]
    return st.one_of(bad)


@pytest.mark.parametrize("method", METHODS)
@FAST
@given(data=st.data())
def test_valid_configs_round_trip_through_json_exactly(method, data):
    cls = methods()[method]
    values = {k.name: data.draw(valid_value(method, k), label=k.name)
              for k in knobs(cls) if data.draw(st.booleans(), label=f"set {k.name}")}
    try:
        config = cls.with_overrides(**values)
    except ValueError as exc:  # a cross-field rule (e.g. PAB window_low < window_high): still a teaching error
        assert re.search(rf"{cls.__name__}\.\w+=.* is invalid: it must be ", str(exc)), exc
        return
    text = config.to_json()
    again = dcache.config_from_dict(json.loads(text))
    assert again == config
    assert again.to_json() == text
    assert json.loads(text)["method"] == method


@pytest.mark.parametrize("method", METHODS)
@FAST
@given(data=st.data())
def test_invalid_config_values_name_the_field_and_what_it_must_be(method, data):
    cls = methods()[method]
    knob = data.draw(st.sampled_from(knobs(cls)), label="field")
    value = data.draw(invalid_value(knob), label="value")
    for build in (lambda: cls.with_overrides(**{knob.name: value}),
                  lambda: dcache.config_from_dict({"method": method, "version": 1, knob.name: value})):
        with pytest.raises((ValueError, TypeError)) as info:
            build()
        assert f"{cls.__name__}.{knob.name}=" in str(info.value)
        assert "is invalid: it must be " in str(info.value)


@pytest.mark.parametrize("method", METHODS)
@FAST
@given(name=st.text(min_size=1, max_size=12))
def test_unknown_config_fields_are_named_with_the_known_ones(method, name):
    cls = methods()[method]
    fields = {f.name for f in dataclasses.fields(cls)}
    if name in fields | {"method", "version"}:
        return
    with pytest.raises(ValueError) as info:
        dcache.config_from_dict({"method": method, name: 1})
    assert repr(name)[:77] in str(info.value)  # long names are cut to 80 characters
    assert "Its fields are" in str(info.value) and min(fields) in str(info.value)


@settings(max_examples=60, deadline=None)
@given(header=st.fixed_dictionaries({}, optional={
    "method": st.one_of(st.text(max_size=10), st.integers(), st.none()),
    "version": st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3))}))
def test_config_with_a_wrong_method_or_version_says_how_to_read_it(header):
    good_method = header.get("method", "fbcache") in methods()
    good_version = type(header.get("version", 1)) is int and header.get("version", 1) == 1
    if good_method and good_version:
        return
    with pytest.raises(ValueError, match="config_for|config_from_dict|Write configs with"):
        dcache.config_from_dict({"method": "fbcache", **header} if "method" not in header else header)


@settings(max_examples=60, deadline=None)
@given(name=st.text(max_size=16))
def test_unknown_method_names_list_the_known_ones(name):
    if name in methods() or name in presets():
        return
    with pytest.raises(ValueError, match="unknown cache method") as info:
        dcache.config_for(name)
    assert "magcache" in str(info.value) and "plan file" in str(info.value)


# ------------------------------------------------------------------------------------------------------------ plans
FIX = re.compile(r"re-export|Re-export")  # every file-level PlanError says how to get a good file


@st.composite
def plans(draw) -> Plan:
    layout = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3).filter(lambda lay: sum(lay) > 0))
    granularity = draw(st.sampled_from(["stack", "block", "module"]))
    units = {"stack": ["stack"], "block": [f"block{i}" for i in range(sum(layout))],
             "module": [f"block{i}.{m}" for i in range(sum(layout)) for m in ("attn", "ff")]}[granularity]
    steps = draw(st.integers(1, 10))
    row = st.text(alphabet="CRF", min_size=len(units), max_size=len(units))
    branches = draw(st.lists(st.sampled_from(["cond", "uncond", "cond_uncond"]), min_size=1, max_size=3,
                             unique=True))
    actions = {b: ["C" * len(units)] + draw(st.lists(row, min_size=steps - 1, max_size=steps - 1)) for b in branches}
    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                          st.text(max_size=6))
    json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(st.text(max_size=4), inner,
                                                                                 max_size=3)), max_leaves=6)
    # probe / tail blocks: stack plans only, leaving at least one middle block (Plan refuses anything else)
    stack = granularity == "stack"
    probe = draw(st.integers(0, min(2, sum(layout) - 1))) if stack else 0
    tail = draw(st.integers(0, min(2, sum(layout) - 1 - probe))) if stack else 0
    return Plan(model_class=draw(st.sampled_from(["FluxTransformer2DModel", "WanTransformer3DModel"])),
                block_layout=layout, granularity=granularity, units=units, num_steps=steps, actions=actions,
                probe_blocks=probe, tail_blocks=tail,
                forecast_order=draw(st.integers(0, 3)), scheduler=draw(st.one_of(st.none(), st.text(max_size=8))),
                resolution=draw(st.one_of(st.none(), st.lists(st.integers(1, 64), min_size=3, max_size=3))),
                interpolate_steps=draw(st.booleans()),
                extras=draw(st.dictionaries(st.text(max_size=6), json_value, max_size=3)),
                provenance=draw(st.dictionaries(st.text(max_size=6), json_value, max_size=3)))


_SCRATCH = Path(tempfile.mkdtemp(prefix="dcache-plan-properties-"))  # hypothesis forbids function-scoped tmp_path


def load_text(text: str | bytes) -> Plan:
    """Plan.load of a file holding `text`."""
    path = _SCRATCH / "plan.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return Plan.load(path)


def assert_loads_or_teaches(text: str | bytes) -> None:
    """A corrupted file either still holds a valid plan or fails with a PlanError saying to re-export."""
    try:
        load_text(text)
    except PlanError as exc:
        assert FIX.search(str(exc)), exc


@settings(max_examples=80, deadline=None)
@given(plan=plans())
def test_valid_plans_round_trip_through_a_file_exactly(plan):
    again = load_text(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()


@settings(max_examples=60, deadline=None)
@given(plan=plans(), data=st.data())
def test_truncated_plan_files_say_they_are_corrupted(plan, data):
    text = plan.to_json()
    cut = data.draw(st.integers(0, len(text) - 1), label="cut")
    with pytest.raises(PlanError, match="not valid JSON.*corrupted or truncated, re-export it"):
        load_text(text[:cut])


@settings(max_examples=120, deadline=None)
@given(plan=plans(), data=st.data())
def test_byte_flips_never_escape_as_raw_errors(plan, data):
    raw = bytearray(plan.to_json().encode())
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        i = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    assert_loads_or_teaches(bytes(raw))


JSON_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 50), st.floats(allow_nan=False),
                                  st.text(alphabet="CRFX", max_size=4)),
                        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                st.dictionaries(st.sampled_from(["cond", "x"]), inner, max_size=2)),
                        max_leaves=5)


@settings(max_examples=120, deadline=None)
@given(plan=plans(), data=st.data())
def test_fields_of_the_wrong_type_name_the_field(plan, data):
    d = plan.to_dict()
    name = data.draw(st.sampled_from([k for k in d if k != "format"]), label="field")
    d[name] = data.draw(JSON_ANY, label="value")
    try:
        load_text(json.dumps(d))
    except PlanError as exc:
        assert FIX.search(str(exc)), exc
        # a value of the wrong JSON type is reported under its own name; a well-typed one by what it contradicts
        right_type = {"model_class": str, "granularity": str, "num_steps": int, "block_layout": list, "units": list,
                      "actions": dict, "interpolate_steps": bool, "extras": dict, "provenance": dict}.get(name)
        if right_type is not None and type(d[name]) is not right_type:
            assert re.search(rf"\b{name}\b", str(exc)), exc


@settings(max_examples=60, deadline=None)
@given(plan=plans(), version=st.one_of(st.integers().filter(lambda v: v != 1), st.booleans(), st.just(1.0),
                                       st.text(max_size=3), st.none(), st.just("missing")))
def test_wrong_or_missing_version_says_what_this_dcache_reads(plan, version):
    d = plan.to_dict()
    if version == "missing":
        del d["version"]
    else:
        d["version"] = version
    with pytest.raises(PlanError, match=r"version.*this dcache reads (plan )?version 1") as info:
        load_text(json.dumps(d))
    assert FIX.search(str(info.value))


@settings(max_examples=60, deadline=None)
@given(plan=plans(), data=st.data())
def test_missing_and_unknown_fields_are_named(plan, data):
    d = plan.to_dict()
    required = ["model_class", "block_layout", "granularity", "units", "num_steps", "actions"]
    gone = data.draw(st.sampled_from(required), label="missing")
    del d[gone]
    with pytest.raises(PlanError, match=rf"incomplete: it has no \['{gone}'\].*re-export"):
        load_text(json.dumps(d))
    d = plan.to_dict()
    extra = data.draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in d), label="unknown")
    d[extra] = 1
    with pytest.raises(PlanError, match="unknown fields.*remove them or re-export"):
        load_text(json.dumps(d))


@settings(max_examples=60, deadline=None)
@given(plan=plans(), data=st.data())
def test_wrong_action_letters_name_the_letter_and_the_alphabet(plan, data):
    d = plan.to_dict()
    branch = data.draw(st.sampled_from(sorted(d["actions"])), label="branch")
    step = data.draw(st.integers(0, plan.num_steps - 1), label="step")
    row = list(d["actions"][branch][step])
    letter = data.draw(st.characters(exclude_characters="CRF", exclude_categories=["Cs"]), label="letter")
    row[data.draw(st.integers(0, len(row) - 1), label="unit")] = letter
    d["actions"][branch][step] = "".join(row)
    with pytest.raises(PlanError, match="characters from 'C', 'R', 'F' .compute, reuse, forecast.") as info:
        load_text(json.dumps(d))
    assert repr(letter) in str(info.value) and f"step {step}" in str(info.value)


@settings(max_examples=50, deadline=None)
@given(plan=plans(), other_layout=st.lists(st.integers(0, 4), min_size=1, max_size=3),
       other_steps=st.integers(1, 12))
def test_plans_for_another_model_layout_or_step_count_name_both_sides(plan, other_layout, other_steps):
    with pytest.raises(PlanError, match=f"made for {plan.model_class} but the model is OtherModel.*make a plan"):
        plan.check_model("OtherModel", plan.block_layout, tuple(plan.units))
    if other_layout != plan.block_layout:
        with pytest.raises(PlanError, match=re.escape(f"sizes {plan.block_layout} but the model has {other_layout}")):
            plan.check_model(plan.model_class, other_layout, tuple(plan.units))
    with pytest.raises(PlanError, match=f"addresses {len(plan.units)} units but the model exposes "
                                        f"{len(plan.units) + 1}"):
        plan.check_model(plan.model_class, plan.block_layout, tuple(plan.units) + ("extra",))
    branch = next(iter(plan.actions))
    if other_steps == plan.num_steps:
        assert plan.row(other_steps - 1, branch, other_steps) == plan.actions[branch][-1]
    elif plan.interpolate_steps:  # nearest-step mapping: every requested step gets one of the planned rows
        assert {plan.row(i, branch, other_steps) for i in range(other_steps)} <= set(plan.actions[branch])
    else:
        with pytest.raises(PlanError, match=f"made for {plan.num_steps} steps but the pipeline runs {other_steps}; "
                                            f"run with num_inference_steps={plan.num_steps}.*interpolate_steps=True"):
            plan.row(0, branch, other_steps)


@pytest.fixture(scope="module")
def transformer():
    return make_transformer()


@pytest.mark.parametrize("edit, message", [
    (dict(model_class="WanTransformer3DModel"), "made for WanTransformer3DModel but the model is FluxTransformer2D"),
    (dict(block_layout=[2, 4]), r"block lists of sizes \[2, 4\] but the model has \[2, 3\]"),
    (dict(granularity="block", units=[f"b{i}" for i in range(NUM_BLOCKS + 1)], actions={"cond": ["C" * 6] * 3}),
     f"addresses {NUM_BLOCKS + 1} units but the model exposes {NUM_BLOCKS}"),
])
def test_applying_a_plan_for_another_model_fails_and_leaves_it_unhooked(transformer, tmp_path, edit, message):
    base = dict(model_class="FluxTransformer2DModel", block_layout=BLOCK_LAYOUT, granularity="stack",
                units=["stack"], num_steps=3, actions={"cond": ["C", "R", "C"]})
    path = Plan(**{**base, **edit}).save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match=message):
        dcache.apply(transformer, path)
    assert hook_names(transformer) == {} and getattr(transformer, "_dcache_engine", None) is None, \
        "a failed apply left hooks behind"
    dcache.apply(transformer, Plan(**base).save(tmp_path / "good.json")).remove()  # and it is free for a good plan


# ------------------------------------------------------------------------------------------------ atomic saving
class Boom(Exception):
    pass


class _HalfWriter:
    """A file object that writes half of what it is given, then fails (a full disk, a killed process)."""

    def __init__(self, f):
        self._f = f

    def write(self, text):
        self._f.write(text[:len(text) // 2])
        self._f.flush()
        raise Boom("disk full")

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def failing(where: str):
    if where == "write":
        real = os.fdopen
        return mock.patch("os.fdopen", lambda *a, **k: _HalfWriter(real(*a, **k)))
    return mock.patch(f"os.{where}", side_effect=Boom(where))


@settings(max_examples=30, deadline=None)
@given(old=plans(), new=plans(), where=st.sampled_from(["write", "fsync", "replace"]), exists=st.booleans())
def test_a_failed_save_leaves_the_old_file_and_no_temporary_file(old, new, where, exists):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        if exists:
            old.save(path)
        before = path.read_bytes() if exists else None
        with failing(where), pytest.raises(Boom):
            new.save(path)
        assert sorted(os.listdir(folder)) == (["plan.json"] if exists else [])
        if exists:
            assert path.read_bytes() == before and Plan.load(path) == old
        new.save(path)  # and the next save goes through
        assert Plan.load(path) == new and os.listdir(folder) == ["plan.json"]
