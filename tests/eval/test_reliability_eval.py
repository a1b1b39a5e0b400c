"""The eval's work folder is data, never code, and its fingerprint means what it says.

  * a pickle planted as a record (under the current name or the `.pt` name older versions pickled to) is refused
    with an error naming the file and the fix, and its payload (a marker file written on unpickling) never runs;
  * a corrupt `cost.json` names the file and the fix;
  * resume fingerprints: a `./tiny` folder in the working directory does not change the bundled model's, a local
    model folder is fingerprinted by content (same sizes, other bytes: another model; moved: the same model).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from dcache.eval.runner import EvalConfig, _fingerprint, run_eval
from dcache.state_file import StateFileError

ITEM = "s0-p0-1"  # seed 0, prompts 0..1 (one batch)


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _config(out: Path, model=None) -> EvalConfig:
    return EvalConfig(model=model, methods=["fixed_interval:interval=2"], prompts="0,1", seeds=1, steps=2,
                      guidance=1.0, repeats=1, warmup=0, flops=False, metrics="psnr", out=str(out))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "out"
    run_eval(_config(out), progress=False)
    return out


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    return out


@pytest.mark.parametrize("name", [f"{ITEM}.safetensors", f"{ITEM}.pt"])
def test_a_pickle_planted_as_a_record_is_refused_and_never_runs(copy, tmp_path, name):
    work = copy / ".work" / "uncached"
    for record in work.glob(f"{ITEM}.*"):
        record.unlink()
    marker = tmp_path / "marker"
    (work / name).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(StateFileError) as info:
        run_eval(_config(copy), progress=False)
    assert str(work / name) in str(info.value) and "delete" in str(info.value) and "--out" in str(info.value)
    assert not marker.exists(), "the pickle's payload ran"


def test_a_corrupt_cost_file_names_the_file_and_the_fix(copy):
    [cost] = [p for p in (copy / ".work").glob("fixed_interval*/cost.json")]
    cost.write_text('{"flops_per_image": "unterminated')
    with pytest.raises(StateFileError) as info:
        run_eval(_config(copy), progress=False)
    assert str(cost) in str(info.value) and "delete it" in str(info.value)


def test_a_tiny_folder_in_the_working_directory_keeps_the_bundled_models_fingerprint(tmp_path, monkeypatch):
    cfg = _config(tmp_path / "out")
    args = (["0", "1"], [0], 10, ["psnr"], True)
    monkeypatch.chdir(tmp_path)
    before = _fingerprint(cfg, *args)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "weights.safetensors").write_bytes(b"x" * 8)
    assert _fingerprint(cfg, *args) == before
    assert _fingerprint(EvalConfig(model="tiny", out=cfg.out), *args) == _fingerprint(
        EvalConfig(model=None, out=cfg.out), *args)


def test_a_local_model_folder_is_fingerprinted_by_content(tmp_path):
    folder = tmp_path / "model"
    (folder / "transformer").mkdir(parents=True)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(bytes(range(64)))
    (folder / "model_index.json").write_text("{}")
    args = (["0"], [0], 1, ["psnr"], False)

    def fingerprint(path: Path) -> str:
        return _fingerprint(EvalConfig(model=str(path), out=str(tmp_path / "out")), *args)

    first = fingerprint(folder)
    weights.write_bytes(bytes(reversed(range(64))))  # retrained: same size, other bytes
    retrained = fingerprint(folder)
    assert retrained != first
    moved = tmp_path / "elsewhere"
    folder.rename(moved)
    assert fingerprint(moved) == retrained  # the content, not the path
