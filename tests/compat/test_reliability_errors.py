"""Errors a user can act on: each names the problem, the file or field, and the fix, and comes before any work.

  * `--out` that is a file, sits under a file, or is a read-only folder: one line, exit code 2, for
    `dcache generate`, batch generation (`--prompts`) and `dcache eval`, before a model loads;
  * `--prompts ""` is an error, not the built-in prompts;
  * `dcache.apply(num_steps=...)`: an int >= 1 at apply time ("10", -3, 0, 2.5, True refused);
  * `speed=` / `quality=` parse (NaN refused) before the calibration run is asked for and before any sweep;
  * `--set threshold=nan` (and inf) says NaN / infinity are not allowed;
  * a plan whose unit names differ from the model's names the differing units;
  * `Pipeline(**pipe.components)` with its own scheduler is tracked like the pipeline dcache was applied to (its
    output, decisions and stats equal a handle applied to it directly).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from compat_kit import CompatPipeline, dcache_hook_count, make_pipeline, seeded
from typer.testing import CliRunner

import dcache
from dcache import PlanError
from dcache.pipelines.cli import app

runner = CliRunner()


def read_only_folder(tmp_path):
    """A folder this process cannot write to: permission bits, or (as root, who ignores them) /proc."""
    if os.geteuid() == 0:
        return "/proc"
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return str(folder)


@pytest.mark.parametrize("command", [["generate", "--steps", "2"], ["generate", "--prompts", "0,1", "--steps", "2"],
                                     ["eval", "--methods", "fora", "--steps", "2"]],
                         ids=["generate", "batch", "eval"])
@pytest.mark.parametrize("where", ["file", "under_a_file", "read_only", "names_a_file"])
def test_an_unusable_out_is_one_line_and_exit_code_2(tmp_path, command, where):
    file = tmp_path / "taken"
    file.write_text("x")
    out = {"file": str(file), "under_a_file": str(file / "sub"), "read_only": read_only_folder(tmp_path),
           "names_a_file": str(tmp_path / "cat.png")}[where]  # a file name where a folder is meant
    result = runner.invoke(app, command + ["--out", out])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"--out {out!r}" in lines[0] and "Traceback" not in result.output, result.output
    assert "pass a folder" in lines[0]
    assert file.read_text() == "x" and not (tmp_path / "cat.png").exists()


def test_empty_prompts_are_an_error_not_the_builtin_set(tmp_path):
    result = runner.invoke(app, ["generate", "--prompts", "", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--prompts is empty" in result.output, result.output
    assert not (tmp_path / "o" / "manifest.json").exists()


@pytest.mark.parametrize("value", ["10", -3, 0, 2.5, True])
def test_num_steps_is_checked_at_apply(value):
    pipe = make_pipeline()
    with pytest.raises(ValueError, match=f"num_steps={value!r} is invalid: it must be an int >= 1"):
        dcache.apply(pipe.transformer, "fbcache", num_steps=value)
    assert dcache_hook_count(pipe.transformer) == 0
    dcache.apply(pipe.transformer, "fbcache", num_steps=4).remove()


@pytest.mark.parametrize("target, needle", [(dict(speed="nanx"), "finite speed-up"), (dict(speed="inf"), "finite"),
                                            (dict(speed="fast"), "must look like '2x'"),
                                            (dict(quality="psnr>=nan"), "finite number of dB"),
                                            (dict(quality="ssim>=0.9"), "must look like 'psnr>=30'")])
@pytest.mark.parametrize("with_run", [True, False])
def test_targets_parse_before_the_calibration_run_and_the_sweep(target, needle, with_run):
    pipe = make_pipeline()
    runs = []
    run = (lambda: runs.append(1) or pipe([1], num_inference_steps=2, generator=seeded(0))) if with_run else None
    with pytest.raises(ValueError, match=needle):  # the target's own error, not "pass calibration_run"
        dcache.apply(pipe, "magcache", calibration_run=run, **target)
    assert runs == [] and dcache_hook_count(pipe.transformer) == 0


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-Infinity"])
def test_set_nan_says_nan_is_not_allowed(tmp_path, value):
    result = runner.invoke(app, ["generate", "--set", f"threshold={value}", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "NaN and infinity are not allowed" in result.output, result.output
    assert f"threshold={value}" in result.output


def test_a_plan_with_other_unit_names_names_them():
    pipe = make_pipeline()
    with dcache.apply(pipe, "fixed_interval", interval=2) as handle:
        pipe([1], num_inference_steps=3, generator=seeded(0))
        plan = handle.plan()
    block = dataclasses.replace(plan, granularity="block", units=[f"b{i}" for i in range(5)],
                                actions={b: [r * 5 for r in rows] for b, rows in plan.actions.items()})
    renamed = dataclasses.replace(block, units=["b0", "b1", "bX", "b3", "bY"])
    with pytest.raises(PlanError, match=r"differ from the model's at 2 of 5 places \(#2: plan 'bX' vs model 'b2', "
                                        r"#4: plan 'bY' vs model 'b4'\)"):
        dcache.apply(pipe, renamed)
    assert dcache_hook_count(pipe.transformer) == 0
    dcache.apply(pipe, block).remove()  # the same plan with the model's names fits


@pytest.mark.parametrize("method, settings", [("fixed_interval", {"interval": 4}), ("seacache", {})])
def test_a_scheduler_replaced_after_apply_is_tracked_from_its_first_generation(method, settings):
    """`pipe.scheduler = ...` between generations: the new scheduler's first generation gets the output, plan and
    stats of dcache applied with it from the start; the replaced scheduler and, after remove(), the new one are
    left unwrapped."""
    from compat_kit import scheduler_is_pristine
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = make_pipeline()

    def generate():
        return pipe([1, 7], num_inference_steps=6, guidance_scale=2.0, generator=seeded(0))

    with dcache.apply(pipe, method, **settings) as handle:
        generate()
        old, pipe.scheduler = pipe.scheduler, FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
        out, plan, stats = generate(), handle.plan().actions, handle.stats().to_dict()
    assert scheduler_is_pristine(old) and scheduler_is_pristine(pipe.scheduler)
    with dcache.apply(pipe, method, **settings) as handle:  # the reference: applied with the new scheduler
        reference, ref_plan, ref_stats = generate(), handle.plan().actions, handle.stats().to_dict()
    assert torch.equal(out, reference) and plan == ref_plan
    keys = ("calls", "units_computed", "num_steps", "per_step")
    assert {k: stats[k] for k in keys} == {k: ref_stats[k] for k in keys}


@pytest.mark.parametrize("method, settings", [("fixed_interval", {"interval": 4}), ("seacache", {})])
def test_a_pipeline_built_from_the_components_is_tracked_with_its_own_scheduler(method, settings):
    pipe = make_pipeline()
    components = {**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)}
    other = CompatPipeline(**components)
    other.set_progress_bar_config(disable=True)

    def generate(p):
        return p([1, 7], num_inference_steps=6, guidance_scale=2.0, generator=seeded(0))

    with dcache.apply(other, method, **settings) as handle:  # the reference: applied to `other` itself
        reference, plan, stats = generate(other), handle.plan().actions, handle.stats().to_dict()
    with dcache.apply(pipe, method, **settings) as handle:
        generate(pipe)
        out = generate(other)
        assert torch.equal(out, reference)
        assert handle.plan().actions == plan
        got = handle.stats().to_dict()
        assert {k: got[k] for k in ("calls", "units_computed", "num_steps", "per_step")} == \
            {k: stats[k] for k in ("calls", "units_computed", "num_steps", "per_step")}
        generate(pipe)  # and back to the pipeline it was applied to
        assert handle.plan().actions == plan


@pytest.mark.parametrize("remove_first", [True, False])
def test_a_deep_copy_of_a_hooked_pipeline_can_be_hooked_again(remove_first):
    """copy.deepcopy(pipe) while dcache is applied (a transformer per thread, say) copies the hooks too, owned by no
    handle; dcache.apply on the copy replaces them, before or after the original handle is removed, and the copy
    then behaves as a fresh pipeline: the same image and stats, bit-identical to the uncached one after remove()."""
    from compat_kit import scheduler_is_pristine

    pipe = make_pipeline()

    def generate(p):
        return p([1, 7], num_inference_steps=6, guidance_scale=2.0, generator=seeded(0))

    uncached = generate(pipe)
    handle = dcache.apply(pipe, "fixed_interval", interval=2)
    reference, stats = generate(pipe), handle.stats().to_dict()
    clone = copy.deepcopy(pipe)
    if remove_first:
        handle.remove()
    with dcache.apply(clone, "fixed_interval", interval=2) as again:
        assert torch.equal(generate(clone), reference)
        assert again.stats().to_dict()["per_step"] == stats["per_step"]
    assert dcache_hook_count(clone.transformer) == 0 and scheduler_is_pristine(clone.scheduler)
    assert torch.equal(generate(clone), uncached)
    if not remove_first:
        handle.remove()
    assert dcache_hook_count(pipe.transformer) == 0 and torch.equal(generate(pipe), uncached)
