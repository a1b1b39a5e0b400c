"""Search checkpoints are data, never pickles: a pickle planted in a search folder (under the name an older dcache
pickled to, or under the current checkpoint's name) is refused with an error that names the file and the fix, and
its payload never runs (the payload writes a marker file when unpickled)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from dcache.schedules.disca import N_TIME_FEATURES
from dcache.schedules.tuning.search import disca as D
from dcache.schedules.tuning.search import ecad as E
from dcache.schedules.tuning.search import router as R
from dcache.schedules.tuning.search.core import make_template
from dcache.state_file import StateFileError


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
