"""Every number read from a plan file is bounded before anything is allocated (hypothesis).

A valid plan (FORECAST cells, Taylor order 1, carrying an untrained DisCa predictor, which forecasts exactly as
Taylor does) gets one numeric field replaced by a generated value: small and huge integers (10**6 ... 10**30),
negative ones, floats, NaN, booleans, null, strings. Loading it, applying it and generating with it must end in a
PlanError naming the field, or in a correct run (finite output within a relative error of 1.0 of the uncached
output); never another exception, never an allocation above 64 MiB (a dispatch mode refuses any tensor factory
call that asks for more, before it runs), and no dcache hook left on the model after a refusal.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from compat_kit import dcache_hook_count, make_pipeline, rel_error, seeded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dcache
from dcache import PlanError

STEPS = 4
LIMIT_BYTES = 64 << 20


class AllocationTooLarge(BaseException):
    """BaseException: no `except Exception` inside the code under test can swallow it."""


_FACTORIES = {"empty", "zeros", "ones", "full", "rand", "randn", "empty_strided", "new_zeros", "new_empty",
              "new_full", "new_ones", "new_empty_strided"}


class AllocationGuard(TorchDispatchMode):
    """Refuses a tensor factory call (torch.empty / zeros / new_zeros / ...) whose size exceeds LIMIT_BYTES, before
    it allocates; meta-device tensors (shapes only) are free."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _FACTORIES and str(kwargs.get("device", "")) != "meta":
            sizes = [a for a in args if isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a)]
            if sizes and math.prod(sizes[0]) * 8 > LIMIT_BYTES:
                raise AllocationTooLarge(f"{func} asked for {sizes[0]}")
        return func(*args, **kwargs)


def generate(pipe) -> torch.Tensor:
    return pipe([1, 7], num_inference_steps=STEPS, guidance_scale=2.0, generator=seeded(0))


@pytest.fixture(scope="module")
def setup():
    from dcache.schedules.disca import DisCaPredictor

    pipe = make_pipeline()
    uncached = generate(pipe)
    with dcache.apply(pipe, "fixed_interval", interval=2, forecast_order=1) as handle:
        generate(pipe)
        plan = handle.plan()
    layout = {k: getattr(plan, k) for k in ("model_class", "block_layout", "granularity", "units", "probe_blocks",
                                            "tail_blocks")}
    width = pipe.transformer.inner_dim
    predictor = DisCaPredictor({f"seg{i}.{j}": width for i in range(2) for j in range(2)}, order=1, hidden=4,
                               time_dim=8, layout=layout)
    plan = dataclasses.replace(plan, extras={**plan.extras, "forecaster": predictor.to_extras()})
    return pipe, uncached, plan.to_dict()


def numeric_paths(data: dict) -> list[tuple]:
    """Every number in the plan (the DisCa spec included), as a path of keys / indices."""
    spec = data["extras"]["forecaster"]
    paths = [(k,) for k in ("num_steps", "forecast_order", "probe_blocks", "tail_blocks", "version")]
    paths += [("block_layout", i) for i in range(len(data["block_layout"]))]
    paths += [("resolution", i) for i in range(len(data["resolution"] or []))]
    paths += [("extras", "forecaster", k) for k in ("order", "hidden", "time_dim", "version", "params")]
    paths += [("extras", "forecaster", "streams", k) for k in spec["streams"]]
    return paths


def write_with(plan: dict, keys: tuple, value, folder) -> str:
    """Set plan[keys[0]][keys[1]]... = value and write the plan to folder/plan.json."""
    target = plan
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    file = folder / "plan.json"
    file.write_text(json.dumps(plan))
    return str(file)


VALUES = st.one_of(st.integers(-3, 12), st.sampled_from([10**6, 10**9, 2**62, 2**63, 10**30]),
                   st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_numbers_give_a_plan_error_or_a_correct_run(setup, tmp_path, data):
    pipe, uncached, valid = setup
    plan = copy.deepcopy(valid)
    path_ = data.draw(st.sampled_from(numeric_paths(plan)), label="field")
    value = data.draw(VALUES, label="value")
    file = write_with(plan, path_, value, tmp_path)
    handle = None
    try:
        with AllocationGuard():
            handle = dcache.apply(pipe, file)
            out = generate(pipe)
    except PlanError:
        return  # (the finally clause checks that the model is clean)
    finally:
        if handle is not None:
            handle.remove()
        assert dcache_hook_count(pipe.transformer) == 0
    assert torch.isfinite(out).all() and out.shape == uncached.shape
    assert rel_error(out, uncached) < 1.0, (path_, value)


@pytest.mark.parametrize("field, value", [("forecast_order", 1_000_000), ("probe_blocks", 10**9),
                                          (("extras", "forecaster", "hidden"), 10**7)])
def test_huge_sizes_are_refused_naming_the_field(setup, tmp_path, field, value):
    pipe, _, valid = setup
    plan = copy.deepcopy(valid)
    if field == "forecast_order":  # without the predictor (which must agree with it): Taylor tables of that order
        del plan["extras"]["forecaster"]
    keys = field if isinstance(field, tuple) else (field,)
    file = write_with(plan, keys, value, tmp_path)
    with AllocationGuard(), pytest.raises(PlanError, match=keys[-1]):
        with dcache.apply(pipe, file):
            generate(pipe)
    assert dcache_hook_count(pipe.transformer) == 0


def test_thousands_of_predictor_streams_are_refused_before_their_nets_are_built(setup, tmp_path, monkeypatch):
    """A small plan can list 50,000 DisCa streams (each a net to build: minutes and gigabytes before the weights are
    found not to fit); the count is bounded first, so no net of theirs is ever built."""
    from dcache.schedules import disca

    pipe, _, valid = setup
    plan = copy.deepcopy(valid)
    plan["extras"]["forecaster"]["streams"] = {f"seg{i}.0": 4 for i in range(2000)}
    file = write_with(plan, ("extras", "forecaster", "order"), 1, tmp_path)
    built = []
    init = disca.StreamNet.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(disca.StreamNet, "__init__", counted)
    with pytest.raises(PlanError, match="streams"):
        dcache.apply(pipe, file)
    assert len(built) <= 1, f"{len(built)} stream nets were built before the refusal"
    assert dcache_hook_count(pipe.transformer) == 0
