"""Search checkpoints are data, never pickles: a pickle planted in a search folder (under the name an older dcache
pickled to, or under the current checkpoint's name) is refused with an error that names the file and the fix, and
its payload never runs (the payload writes a marker file when unpickled)."""

from __future__ import annotations

import copy
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from state_fuzz import FUZZ, dead_pid, mutate

from dcache.schedules.disca import N_TIME_FEATURES
from dcache.schedules.tuning.search import disca as D
from dcache.schedules.tuning.search import ecad as E
from dcache.schedules.tuning.search import lemica as L
from dcache.schedules.tuning.search import router as R
from dcache.schedules.tuning.search.core import make_template
from dcache.files.state_file import StateFileError


class Payload:
    """Unpickling calls builtins.exec on a line that writes `marker`: what `pickle.load` / `torch.load(...,
    weights_only=False)` of an attacker's file does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(Payload(marker)))


def refused(call, path: Path, marker: Path) -> None:
    with pytest.raises(StateFileError) as info:
        call()
    message = str(info.value)
    assert str(path) in message and "delete it" in message, message
    assert not marker.exists(), "the pickle's payload ran"


@pytest.fixture(scope="module")
def template(tiny_pipe):
    import search_testkit

    return make_template(search_testkit.make_calibration(tiny_pipe))


@pytest.mark.parametrize("name", ["checkpoint.pkl", "checkpoint.safetensors"])
def test_ecad_resume_refuses_a_planted_pickle(calib, template, tmp_path, name):
    path, marker = tmp_path / "out" / name, tmp_path / "marker"
    plant(path, marker)
    refused(lambda: E.ecad_search(calib, tmp_path / "out", E.ECADConfig(pop_size=4, generations=1),
                                  template=template, progress=False, resume=True), path, marker)


@pytest.mark.parametrize("name", ["router.pt", "router.ckpt.safetensors"])
def test_router_resume_refuses_a_planted_pickle(calib, template, tmp_path, name):
    path, marker = tmp_path / "out" / name, tmp_path / "marker"
    plant(path, marker)
    refused(lambda: R.train_routers(calib, tmp_path / "out", R.RouterConfig(iterations=1), template=template,
                                    progress=False, resume=True), path, marker)


def _stream_data() -> dict[str, D.StreamData]:
    g = torch.Generator().manual_seed(0)
    terms, feats = torch.randn(2, 3, 2, 4, generator=g), torch.randn(3, N_TIME_FEATURES, generator=g)
    return {"h": D.StreamData(terms=terms, feats=feats, target=torch.randn(3, 2, 4, generator=g))}


@pytest.mark.parametrize("name", ["disca.ckpt.pt", "disca.ckpt.safetensors"])
def test_disca_resume_and_closed_loop_refuse_a_planted_pickle(tmp_path, name):
    path, marker = tmp_path / "out" / name, tmp_path / "marker"
    plant(path, marker)
    cfg = D.DisCaConfig(iterations=1, hidden=4, online_iterations=1)
    refused(lambda: D.train_predictor(_stream_data(), tmp_path / "out", cfg, progress=False, resume=True), path,
            marker)
    # the closed loop read the checkpoint even without a resume flag
    predictor = D.DisCaPredictor({"h": 4}, order=1, hidden=4, time_dim=cfg.time_dim)
    refused(lambda: D.finetune_online(None, [], [], predictor, tmp_path / "out", cfg, progress=False), path, marker)


def test_a_checkpoint_round_trips_and_a_truncated_one_names_the_file(calib, template, tmp_path):
    """The data checkpoint resumes (see test_search.py for the same front); cut in half it is refused, naming it."""
    cfg = E.ECADConfig(pop_size=4, generations=1, granularity="stack")
    E.ecad_search(calib, tmp_path, cfg, template=template, progress=False)
    ckpt = tmp_path / "checkpoint.safetensors"
    raw = ckpt.read_bytes()
    ckpt.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(StateFileError, match=r"checkpoint\.safetensors.*delete it"):
        E.ecad_search(calib, tmp_path, E.ECADConfig(pop_size=4, generations=2, granularity="stack"),
                      template=template, progress=False, resume=True)


# ------------------------------------------------------------------------------------------------ damaged contents
# A checkpoint that parses but holds other data than dcache wrote (hand-edited, another version, another search's
# file) is a StateFileError or ValueError naming the file (or its folder) and the fix, never a raw KeyError /
# TypeError / IndexError, and its sizes are checked before anything is built from them.

def _ecad_checkpoint(calib, template, out: Path) -> Path:
    E.ecad_search(calib, out, E.ECADConfig(pop_size=4, generations=1, granularity="stack"), template=template,
                  progress=False)
    return out / E.CHECKPOINT


def _edit(path: Path, edit) -> None:
    from dcache.files.state_file import load_state, save_state

    data = load_state(path, E.STATE_KIND, "fix")
    edit(data)
    save_state(path, data, E.STATE_KIND)


ECAD_EDITS = {
    "pop_size=-1": lambda d: d["settings"].__setitem__("pop_size", -1),
    "pop_size=10**7": lambda d: d["settings"].__setitem__("pop_size", 10**7),
    "20,000 x0 rows": lambda d: d.__setitem__("x0", np.zeros((20_000, d["x0"].shape[1]), dtype=bool)),
    "quality as a string": lambda d: next(iter(d["archive"].values())).__setitem__("quality", "30"),
    "archive entry of another genome": lambda d: d["archive"].__setitem__(
        "0" * 40, next(iter(d["archive"].values()))),
    "no x0": lambda d: d.pop("x0"),
    "generation as a string": lambda d: d.__setitem__("generation", "1"),
}


@pytest.mark.parametrize("case", sorted(ECAD_EDITS))
def test_a_damaged_ecad_checkpoint_names_the_file_and_the_fix(calib, template, tmp_path, case):
    ckpt = _ecad_checkpoint(calib, template, tmp_path)
    _edit(ckpt, ECAD_EDITS[case])
    with pytest.raises(StateFileError) as info:
        E.ecad_search(calib, tmp_path, E.ECADConfig(pop_size=4, generations=2, granularity="stack"),
                      template=template, progress=False, resume=True)
    assert str(ckpt) in str(info.value) and "delete it" in str(info.value), info.value


def test_pop_size_is_bounded_in_the_config():
    with pytest.raises(ValueError, match=f"pop_size=10000000 must be in 4..{E.MAX_POP_SIZE}"):
        E.ECADConfig(pop_size=10**7)


def test_a_damaged_disca_checkpoint_names_the_file(tmp_path):
    from dcache.files.state_file import load_state, save_state

    cfg = D.DisCaConfig(iterations=2, hidden=4, online_iterations=1)
    D.train_predictor(_stream_data(), tmp_path, cfg, progress=False, stop_after=1)
    ckpt = tmp_path / D.CHECKPOINT
    good = load_state(ckpt, D.STATE_KIND, "fix")
    adam = {"state": {0: {"exp_avg": torch.zeros(9)}}, "param_groups": good["optimizer"]["param_groups"]}
    for edit in (lambda s: s.__setitem__("iteration", "1"),
                 lambda s: s["model"].__setitem__(next(iter(s["model"])), torch.zeros(3, 3)),
                 lambda s: s.__setitem__("optimizer", adam)):
        state = copy.deepcopy(good)
        edit(state)
        save_state(ckpt, state, D.STATE_KIND)
        with pytest.raises(StateFileError, match="disca.ckpt.safetensors.*delete it"):
            D.train_predictor(_stream_data(), tmp_path, cfg, progress=False, resume=True)


RESUMES = {
    "disca": lambda calib, template, out: D.train_predictor(
        _stream_data(), out, D.DisCaConfig(iterations=1, hidden=4, online_iterations=1), progress=False, resume=True),
    "ecad": lambda calib, template, out: E.ecad_search(
        calib, out, E.ECADConfig(pop_size=4, generations=1, granularity="stack"), template=template, progress=False,
        resume=True),
    "router": lambda calib, template, out: R.train_routers(
        calib, out, R.RouterConfig(iterations=1), template=template, progress=False, resume=True, stop_after=0),
}


@pytest.mark.parametrize("method", sorted(RESUMES))
def test_a_killed_runs_temporary_files_are_removed_on_resume(calib, template, tmp_path, method):
    """kill -9 during a checkpoint write leaves dcache.files.atomic's temporary file; a resume removes it (its writer
    is gone), and keeps a live process's file and files of other names."""
    pid = dead_pid()
    stale = tmp_path / f".checkpoint.{pid}.0123abcd.tmp.safetensors"
    live = tmp_path / f".checkpoint.{os.getpid()}.0123abcd.tmp.safetensors"
    other = tmp_path / "notes.tmp"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    RESUMES[method](calib, template, tmp_path)
    assert not stale.exists() and live.exists() and other.exists()


# ------------------------------------------------------------------------------------------------ fuzzing
def _refused_or_done(call, folder: Path):
    try:
        return call()
    except (StateFileError, ValueError) as exc:
        assert str(folder) in str(exc), f"{type(exc).__name__} does not name the file: {exc}"
        return None


@pytest.fixture(scope="module")
def ecad_state(tiny_pipe, template, tmp_path_factory):
    import search_testkit
    from dcache.files.state_file import load_state

    ckpt = _ecad_checkpoint(search_testkit.make_calibration(tiny_pipe), template, tmp_path_factory.mktemp("ecad"))
    return load_state(ckpt, E.STATE_KIND, "fix")


@FUZZ
@given(data=st.data())
def test_fuzzed_ecad_checkpoints(calib, template, ecad_state, tmp_path_factory, data):
    from dcache.files.state_file import save_state

    out = tmp_path_factory.mktemp("fuzz")
    save_state(out / E.CHECKPOINT, mutate(data, ecad_state), E.STATE_KIND)
    front = _refused_or_done(lambda: E.ecad_search(calib, out, E.ECADConfig(pop_size=4, generations=1,
                                                                            granularity="stack"),
                                                   template=template, progress=False, resume=True), out)
    if front is not None:
        assert front["points"] and all(0 <= p["compute_ratio"] <= 1 for p in front["points"])


@pytest.fixture(scope="module")
def router_state(tiny_pipe, template, tmp_path_factory):
    import search_testkit
    from dcache.files.state_file import load_state

    out = tmp_path_factory.mktemp("router")
    R.train_routers(search_testkit.make_calibration(tiny_pipe), out, R.RouterConfig(iterations=2), template=template,
                    progress=False, stop_after=1)
    return load_state(out / R.CHECKPOINT, R.STATE_KIND, "fix")


@FUZZ
@given(data=st.data())
def test_fuzzed_router_checkpoints(calib, template, router_state, tmp_path_factory, data):
    from dcache.files.state_file import save_state

    out = tmp_path_factory.mktemp("fuzz")
    save_state(out / R.CHECKPOINT, mutate(data, router_state), R.STATE_KIND)
    shape = tuple(router_state["theta"].shape)
    done = _refused_or_done(lambda: R.train_routers(calib, out, R.RouterConfig(iterations=2), template=template,
                                                    progress=False, resume=True, stop_after=0), out)
    if done is not None:
        assert all(tuple(t.shape) == shape and torch.isfinite(t).all() for t in done.values())


@FUZZ
@given(data=st.data())
def test_fuzzed_disca_checkpoints(tmp_path_factory, data):
    from dcache.files.state_file import load_state, save_state

    out = tmp_path_factory.mktemp("disca")
    cfg = D.DisCaConfig(iterations=2, hidden=4, online_iterations=1)
    D.train_predictor(_stream_data(), out, cfg, progress=False, stop_after=1)
    state = load_state(out / D.CHECKPOINT, D.STATE_KIND, "fix")
    save_state(out / D.CHECKPOINT, mutate(data, state), D.STATE_KIND)
    result = _refused_or_done(lambda: D.train_predictor(_stream_data(), out, cfg, progress=False, resume=True), out)
    if result is not None:
        predictor, _ = result
        assert all(torch.isfinite(p).all() for p in predictor.parameters())


def test_dcache_search_prints_a_damaged_checkpoint_as_one_error_line(tmp_path):
    """The command line prints a checkpoint it refuses as `dcache eval` prints a record: one `error:` line naming
    the file and the fix, exit code 2, no traceback."""
    from typer.testing import CliRunner

    from dcache.pipelines.cli import app

    ckpt = tmp_path / "out" / E.CHECKPOINT
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"\x00" * 64)
    result = CliRunner().invoke(app, ["search", "--method", "ecad", "--steps", "4", "--prompts", "1", "--pop-size",
                                      "4", "--generations", "1", "--granularity", "stack", "--resume",
                                      "--no-progress", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "error:" in result.output, result.output
    assert str(ckpt) in result.output and "delete it" in result.output, result.output


def test_a_plans_folder_linked_out_of_the_output_folder_is_refused(calib, template, tmp_path):
    """The front's plans go to <out>/plans; a link there to another folder is refused, and nothing is written in it."""
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    elsewhere.mkdir()
    out.mkdir()
    (out / "plans").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="leads out of"):
        E.ecad_search(calib, out, E.ECADConfig(pop_size=4, generations=1, granularity="stack"), template=template,
                      progress=False)
    assert not list(elsewhere.iterdir())


# ------------------------------------------------------------------------------------------------ LeMiCa edges
@pytest.fixture(scope="module")
def edges_file(tiny_pipe, template, tmp_path_factory) -> Path:
    import search_testkit

    path = tmp_path_factory.mktemp("lemica") / "edges.json"
    L.edge_weights(search_testkit.make_calibration(tiny_pipe), template, 4, cache_path=path, progress=False)
    return path


EDGE_FILES = {
    "not JSON": '{"edges": ',
    "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "a list": "[1]",
    "a weight as a string": {"0-2": "0.5"},
    "a negative weight": {"0-2": -1.0},
    "an edge beyond the last step": {"0-99": 0.5},
    "not an edge": {"zero-two": 0.5},
}


@pytest.mark.parametrize("case", sorted(EDGE_FILES))
def test_a_damaged_lemica_edge_file_names_the_file_and_the_fix(calib, template, edges_file, tmp_path, case):
    """edges.json (the measured edges a rerun skips) holding anything but this search's edges with errors >= 0 is a
    StateFileError naming it, never a raw JSON / Key / Type error, and never a weight that steers the path."""
    import json

    path = tmp_path / "edges.json"
    content = EDGE_FILES[case]
    if isinstance(content, dict):
        data = json.loads(edges_file.read_text())
        data["edges"].update(content)
        content = json.dumps(data)
    path.write_text(content)
    with pytest.raises(StateFileError) as info:
        L.edge_weights(calib, template, 4, cache_path=path, progress=False)
    assert str(path) in str(info.value) and "delete it" in str(info.value), info.value


@FUZZ
@given(data=st.data())
def test_fuzzed_lemica_edge_files(calib, template, edges_file, tmp_path_factory, data):
    import json

    from state_fuzz import JSON_VALUES

    path = tmp_path_factory.mktemp("fuzz") / "edges.json"
    path.write_text(json.dumps(mutate(data, json.loads(edges_file.read_text()), JSON_VALUES)))
    weights = _refused_or_done(lambda: L.edge_weights(calib, template, 4, cache_path=path, progress=False),
                               path.parent)
    if weights is not None:
        n = template.num_steps
        expected = {(i, j) for i in range(n) for j in range(i + 1, min(n, i + 4) + 1)}
        assert set(weights) == expected and all(math.isfinite(w) and w >= 0 for w in weights.values())
