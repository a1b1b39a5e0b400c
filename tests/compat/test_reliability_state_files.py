"""Resume state files (dcache.files.state_file) and the JSON files dcache reads: genuine files are never mistaken for
pickles, and oversized files are refused from their size, before they are read."""

from __future__ import annotations

import pickle
import resource
import struct

import pytest
import torch
from compat_kit import make_transformer

import dcache
from dcache.files.state_file import MAX_STATE_BYTES, StateFileError, is_pickle, load_state, save_state


def test_every_header_size_loads_back(tmp_path):
    """The first byte of a safetensors file is its header length's lowest byte (a multiple of 8: safetensors pads
    the header): 0x80 (pickle's PROTO) or '(' (protocol 0-1's MARK) for some string lengths. Every header size from
    these 1024 string lengths must load back."""
    path, lows = tmp_path / "s.safetensors", set()
    for n in range(0, 1024):
        save_state(path, {"s": "a" * n, "t": torch.ones(2)}, kind="k")
        raw = path.read_bytes()
        lows.add(raw[0])
        assert load_state(path, "k", "fix")["s"] == "a" * n, n
    assert {0x80, ord("(")} <= lows  # the sizes that a first-byte test refused were covered


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickles_of_every_protocol_are_still_refused(tmp_path, protocol):
    path = tmp_path / "s.safetensors"
    path.write_bytes(pickle.dumps({"x": [1, 2]}, protocol=protocol))
    assert is_pickle(path.read_bytes())
    with pytest.raises(StateFileError, match="is a pickle"):
        load_state(path, "k", "delete it")


def test_a_safetensors_looking_pickle_prefix_is_judged_by_structure():
    """A header length whose low byte is 0x80 with a JSON object behind it is safetensors; the same 8 bytes with
    no JSON behind them (or a length past the end) is not."""
    header = b'{"__metadata__":{}}' + b" " * (0x80 - 19)
    assert not is_pickle(struct.pack("<Q", len(header)) + header)
    assert is_pickle(b"\x80\x04" + b"\x00" * 200)


def sparse(path, size: int):
    with open(path, "wb") as f:
        f.truncate(size)  # a hole: the size is real, no disk blocks or memory are used
    return path


def test_an_oversized_state_file_is_refused_before_it_is_read(tmp_path):
    path = sparse(tmp_path / "record.safetensors", MAX_STATE_BYTES + 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(StateFileError) as info:
        load_state(path, "eval record", "delete it")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert str(path) in str(info.value) and "delete it" in str(info.value)
    assert f"{MAX_STATE_BYTES:,}" in str(info.value)
    assert grown_kib < 64 * 1024, f"peak memory grew by {grown_kib} KiB while refusing"


def test_an_oversized_plan_is_refused_before_it_is_read(tmp_path):
    from dcache.plans.plan import MAX_PLAN_BYTES, Plan, PlanError

    path = sparse(tmp_path / "big.plan.json", MAX_PLAN_BYTES + 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for load in (Plan.load, lambda p: dcache.apply(make_transformer(), p, num_steps=2)):
        with pytest.raises(PlanError) as info:
            load(path)
        assert str(path) in str(info.value) and f"{MAX_PLAN_BYTES:,}" in str(info.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024


@pytest.mark.parametrize("content", ["[" * 100_000 + "]" * 100_000, '{"method": 1' + "0" * 5000 + "}"])
def test_apply_wraps_deep_nesting_and_huge_integers_in_a_plan_error(tmp_path, content):
    """dcache.apply reads plan and config files itself: nesting too deep for the parser and integers too long to
    convert are a PlanError naming the file, as Plan.load gives."""
    from dcache.plans.plan import PlanError

    path = tmp_path / "deep.json"
    path.write_text(content)
    with pytest.raises(PlanError, match="deep.json.*not valid JSON"):
        dcache.apply(make_transformer(), str(path), num_steps=2)
