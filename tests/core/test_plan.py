"""Plan files: round trip, atomic writes, and a teaching error for every way a file can be wrong."""

from __future__ import annotations

import json

import pytest

from dcache import Plan, PlanError
from dcache.plans.plan import atomic_write_text, nearest_interp


def plan(**kw):
    base = dict(model_class="ToyTransformer", block_layout=[3, 3], granularity="stack", units=["stack"],
                num_steps=4, actions={"cond": ["C", "R", "C", "R"], "uncond": ["C", "C", "R", "R"]})
    base.update(kw)
    return Plan(**base)


def test_round_trip_is_exact(tmp_path):
    p = plan(extras={"k": [0.5, 0.25]}, provenance={"method": "x"})
    path = p.save(tmp_path / "a" / "p.json")
    assert Plan.load(path) == p
    assert not [f for f in path.parent.iterdir() if f.name.startswith(".")], "temporary file left behind"


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("format"), "not a dcache plan"),
    (lambda d: d.update(version=99), "plan version 99"),
    (lambda d: d.update(surprise=1), "unknown fields"),
    (lambda d: d.pop("units"), "incomplete"),
    (lambda d: d["actions"]["cond"].pop(), "has 3 rows but num_steps=4"),
    (lambda d: d["actions"]["cond"].__setitem__(1, "X"), "characters from 'C', 'R', 'F'"),
    (lambda d: d["actions"]["cond"].__setitem__(0, "R"), "step 0 must compute"),
    (lambda d: d.update(granularity="layer"), "granularity 'layer'"),
])
def test_bad_files_raise_plan_errors_that_say_what_to_do(tmp_path, edit, message):
    data = plan().to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_truncated_and_missing_files(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(plan().to_json()[:-20])
    with pytest.raises(PlanError, match="corrupted or truncated"):
        Plan.load(path)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")


def test_model_checks_name_the_mismatch():
    p = plan()
    with pytest.raises(PlanError, match="made for ToyTransformer but the model is Other"):
        p.check_model("Other", [3, 3], ("stack",))
    with pytest.raises(PlanError, match=r"block lists of sizes \[3, 3\]"):
        p.check_model("ToyTransformer", [3, 4], ("stack",))


def test_rows_by_branch_steps_and_interpolation():
    p = plan()
    assert p.row(1, "uncond", 4) == "C"
    with pytest.raises(PlanError, match="branches"):
        p.row(1, "other", 4)
    with pytest.raises(PlanError, match="made for 4 steps but the pipeline runs 8"):
        p.row(1, "cond", 8)
    stretched = plan(interpolate_steps=True)
    assert [stretched.row(i, "cond", 7) for i in range(7)] == nearest_interp(["C", "R", "C", "R"], 7)
    assert nearest_interp([1, 2, 3], 1) == [3]
    assert p.compute_ratio() == pytest.approx(4 / 8)


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "p.json"
    atomic_write_text(path, "old")

    with pytest.raises(TypeError):
        atomic_write_text(path, 123)  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["p.json"]
