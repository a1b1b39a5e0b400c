"""The eval's work folder is data, never code, and its fingerprint means what it says.

  * a pickle planted as a record (under the current name or the `.pt` name older versions pickled to) is refused
    with an error naming the file and the fix, and its payload (a marker file written on unpickling) never runs;
  * a corrupt `cost.json` names the file and the fix;
  * a record is trusted only where it is found (its variant's folder, its item's name) and with every field the report
    reads; malformed records and cost files name the file and the fix; a `.work` or variant folder linked out of the
    output folder is refused; a resume removes the temporary files of a killed run;
  * resume fingerprints: a `./tiny` folder in the working directory does not change the bundled model's, a local
    model folder is fingerprinted by content (same sizes, other bytes: another model; moved: the same model).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from state_fuzz import FUZZ, dead_pid, mutate

from dcache.eval.runner import EvalConfig, _fingerprint, run_eval
from dcache.files.state_file import StateFileError

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


# ------------------------------------------------------------------------------------------------ record contents
# A record whose fingerprint matches is still checked: it must belong to the folder (variant) and the file name
# (item) it is found under, and hold every field the report reads, with its type and size.

def _record(out: Path, variant: str = "fixed_interval") -> Path:
    [path] = (out / ".work").glob(f"{variant}*/{ITEM}.safetensors")
    return path


def _edited(path: Path, edit) -> None:
    from dcache.files.state_file import load_state, save_state

    rec = load_state(path, "eval record", "fix")
    edit(rec)
    save_state(path, rec, "eval record")


def _refused_naming(out: Path, path: Path) -> None:
    with pytest.raises(StateFileError) as info:
        run_eval(_config(out), progress=False)
    assert str(path) in str(info.value) and "delete" in str(info.value), info.value


def test_a_record_of_another_item_is_refused(copy):
    path = _record(copy)

    def other_item(rec):
        rec["item"].update(id="s1-p0-1", seed=1, index=1)

    _edited(path, other_item)
    _refused_naming(copy, path)


def test_a_cached_record_placed_in_uncached_is_refused(copy):
    uncached = _record(copy, "uncached")
    shutil.copyfile(_record(copy), uncached)
    _refused_naming(copy, uncached)


RECORD_EDITS = {
    "no item": lambda r: r.pop("item"),
    "num_images as a string": lambda r: r.__setitem__("num_images", "2"),
    "no stats": lambda r: r.__setitem__("stats", None),
    "stats without flops": lambda r: r["stats"].pop("block_flops_total"),
    "a metric as a string": lambda r: r["metrics"].__setitem__("psnr", "30"),
    "seconds = -1": lambda r: r.__setitem__("seconds", [-1.0]),
    "frames_per_sample = 10**9": lambda r: r.__setitem__("frames_per_sample", 10**9),
}


@pytest.mark.parametrize("case", sorted(RECORD_EDITS))
def test_a_malformed_record_names_the_file_and_the_fix(copy, case):
    path = _record(copy)
    _edited(path, RECORD_EDITS[case])
    _refused_naming(copy, path)


def test_an_uncached_record_without_images_is_refused(copy):
    path = _record(copy, "uncached")
    _edited(path, lambda r: r.__setitem__("images", None))
    _refused_naming(copy, path)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"flops_per_image": "many", "measured_on": 1}',
                                  '{"flops_per_image": -5, "measured_on": "s0-p0-1"}'])
def test_a_malformed_cost_file_names_the_file_and_the_fix(copy, text):
    [cost] = [p for p in (copy / ".work").glob("fixed_interval*/cost.json")]
    cost.write_text(text)
    with pytest.raises(StateFileError) as info:
        run_eval(_config(copy), progress=False)
    assert str(cost) in str(info.value) and "delete it" in str(info.value)


# ------------------------------------------------------------------------------------------------ the folder itself
@pytest.mark.parametrize("link", [".work", "variant"])
def test_a_work_folder_linked_out_of_the_output_folder_is_refused(copy, tmp_path, link):
    """A symbolic link in place of `.work` or a variant folder would read records from, and write them to, another
    place; it is refused naming it, and nothing is written there."""
    elsewhere = tmp_path / "elsewhere"
    [vdir] = (copy / ".work").glob("fixed_interval*")
    moved = copy / ".work" if link == ".work" else vdir
    shutil.move(str(moved), str(elsewhere))
    moved.symlink_to(elsewhere, target_is_directory=True)
    before = sorted(p.name for p in elsewhere.rglob("*"))
    with pytest.raises(ValueError, match="leads out of"):
        run_eval(_config(copy), progress=False)
    assert sorted(p.name for p in elsewhere.rglob("*")) == before


def test_a_record_linked_out_of_the_output_folder_is_refused(copy, tmp_path):
    path = _record(copy)
    outside = tmp_path / "outside.safetensors"
    shutil.move(str(path), str(outside))
    path.symlink_to(outside)
    with pytest.raises(StateFileError, match="leads out of") as info:
        run_eval(_config(copy), progress=False)
    assert str(path) in str(info.value)


def test_a_killed_runs_temporary_files_are_removed_on_resume(copy):
    pid = dead_pid()
    stale = _record(copy).parent / f".{ITEM}.{pid}.0123abcd.tmp.safetensors"
    report = copy / f".results.{pid}.89abcdef.tmp.json"
    for p in (stale, report):
        p.write_bytes(b"half")
    run_eval(_config(copy), progress=False)
    assert not stale.exists() and not report.exists()


# ------------------------------------------------------------------------------------------------ fuzzing
@FUZZ
@given(data=st.data())
def test_fuzzed_records(finished, tmp_path_factory, data):
    """Any field of a record (or of its stats, item, metrics) replaced or deleted: a StateFileError naming the file,
    or a whole report (every image counted once, compute ratios in [0, 1]). A number changed within its range (a
    PSNR value, a duration) cannot be told from a measured one: the check is on types, sizes and where it belongs."""
    from dcache.files.state_file import load_state, save_state

    out = tmp_path_factory.mktemp("fuzz") / "out"
    shutil.copytree(finished, out)
    path = _record(out, data.draw(st.sampled_from(["uncached", "fixed_interval"]), label="variant"))
    save_state(path, mutate(data, load_state(path, "eval record", "fix")), "eval record")
    try:
        result = run_eval(_config(out), progress=False)
    except StateFileError as exc:
        assert str(path) in str(exc), exc
        return
    expected = json.loads((finished / "results.json").read_text())["variants"]
    assert set(result.results["variants"]) == set(expected)
    for label, row in result.results["variants"].items():
        assert row["num_images"] == expected[label]["num_images"] and 0 <= row["compute_ratio"] <= 1, label
    assert json.loads((out / "results.json").read_text())["variants"].keys() == expected.keys()


# ------------------------------------------------------------------------------------------------ one image
def test_fid_on_one_image_is_refused_before_any_generation(tmp_path, classifier_path):
    """A Frechet distance needs 2 images: an eval of one prompt and one seed with --metrics fid is refused before
    it generates anything (it used to fail after all the generation work)."""
    out = tmp_path / "out"
    cfg = dataclasses.replace(_config(out), prompts="3", metrics="psnr,fid", classifier=str(classifier_path))
    with pytest.raises(ValueError, match="fid needs at least 2 images.*--seeds 2"):
        run_eval(cfg, progress=False)
    assert not list(out.glob(".work/*/*.safetensors")), "records were generated before the refusal"


def test_auto_metrics_on_one_image_leave_fid_out_with_a_note(tmp_path, classifier_path):
    cfg = dataclasses.replace(_config(tmp_path / "out"), prompts="3", metrics="auto", classifier=str(classifier_path))
    result = run_eval(cfg, progress=False)
    assert "fid" not in result.results["metrics"]
    assert any("skipped fid" in note for note in result.results["notes"]), result.results["notes"]


@pytest.mark.parametrize("content, says", [(b"\xff\xfe not text", "different settings"),
                                           (b"0" * 10_000_000, "10,000,000 bytes")])
def test_a_malformed_work_fingerprint_is_one_clear_error(copy, content, says):
    """`.work/fingerprint.txt` (what a rerun compares its settings with) holding other bytes or megabytes: an error
    naming the folder and the fix, read with a size cap (no UnicodeDecodeError, no read of the whole file)."""
    marker = copy / ".work" / "fingerprint.txt"
    marker.write_bytes(content)
    with pytest.raises(ValueError) as info:
        run_eval(_config(copy), progress=False)
    assert type(info.value) is not UnicodeDecodeError and str(copy / ".work") in str(info.value), info.value
    assert "--out" in str(info.value) and says in str(info.value), info.value
