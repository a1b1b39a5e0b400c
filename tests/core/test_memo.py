"""Step-invariant modules outside the blocks (RoPE tables, `Adapter.invariants`) are computed once and replayed
(dcache.runtime.step_invariant): the transformer's output must stay bit-identical to the uncached forward, a hit needs
the very same input tensors, and an in-place change of those tensors must be seen."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

import dcache
from dcache import Action, Schedule
from dcache.model.families import adapter_for


def _load_zoo():
    if "dcache_test_zoo" not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "zoo.py"
        spec = importlib.util.spec_from_file_location("dcache_test_zoo", path)
        sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["dcache_test_zoo"]


ZOO = _load_zoo().ZOO
ID_ARGS = ("img_ids", "txt_ids")


class AllCompute(Schedule):
    def decide(self, ctx):
        return Action.COMPUTE


def _memo_families() -> list[str]:
    names = []
    for name, entry in sorted(ZOO.items()):
        try:
            adapter = adapter_for(entry.make_model())
        except Exception:
            continue
        if adapter.invariants:
            names.append(name)
    return names


MEMO_FAMILIES = _memo_families()


def _trajectory(entry, steps=3):
    """Per-step forward kwargs with the id tensors shared across steps, as a pipeline passes them."""
    first = entry.make_inputs(0)
    calls = []
    for step in range(steps):
        kwargs = entry.make_inputs(step)
        kwargs.update({k: first[k] for k in ID_ARGS if k in first})
        calls.append(kwargs)
    return calls


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out.sample if hasattr(out, "sample") else out


def test_the_families_with_rope_outside_the_blocks_declare_it():
    assert {"flux", "flux2", "wan", "hunyuan_video"} <= set(MEMO_FAMILIES), MEMO_FAMILIES


@pytest.mark.parametrize("name", MEMO_FAMILIES)
def test_memoised_forward_is_bit_identical_and_hits_from_the_second_call(name):
    torch.manual_seed(0)
    entry = ZOO[name]
    model = entry.make_model()
    calls = _trajectory(entry)
    with torch.no_grad():
        reference = [_first(model(**kw, return_dict=False)) for kw in calls]
        with dcache.apply(model, AllCompute(), num_steps=len(calls)) as handle:
            outputs = [_first(model(**kw, return_dict=False)) for kw in calls]
            hooks = handle.engine.memos
    assert hooks, f"{name}: no memo hook installed for {adapter_for(model).invariants}"
    assert all(h.hits >= len(calls) - 1 for h in hooks), [h.hits for h in hooks]
    for ref, out in zip(reference, outputs):
        assert torch.equal(ref, out)


def test_fresh_or_edited_ids_are_recomputed():
    entry = ZOO["flux"]
    model = entry.make_model()
    kw = entry.make_inputs(0)
    with torch.no_grad(), dcache.apply(model, AllCompute(), num_steps=4) as handle:
        model(**kw)
        (hook,) = handle.engine.memos
        model(**kw)
        assert hook.hits == 1
        kw["img_ids"].add_(1.0)  # the same tensor object, edited in place: a new version
        edited = _first(model(**kw, return_dict=False))
        assert hook.hits == 1
        fresh = dict(kw, img_ids=kw["img_ids"].clone() + 2.0)  # another tensor: no identity, no hit
        shifted = _first(model(**fresh, return_dict=False))
        assert hook.hits == 1
    with torch.no_grad():
        assert torch.equal(edited, _first(model(**kw, return_dict=False)))
        assert torch.equal(shifted, _first(model(**fresh, return_dict=False)))
    assert not torch.equal(edited, shifted)


def test_memoize_false_installs_nothing(tmp_path):
    entry = ZOO["flux"]
    model = entry.make_model()
    with dcache.apply(model, AllCompute(), num_steps=2, memoize=False) as handle:
        assert handle.engine.memos == []


def test_bad_invariant_key_names_the_choices():
    from dcache.model.adapters import Invariant

    with pytest.raises(ValueError, match="'inputs' or 'shapes'"):
        Invariant("pos_embed", key="values")
