"""A method from another package, in one file: declared under the `dcache.methods` entry point (dcache/plugins.py),
it is reachable everywhere a built-in method is, with nothing in dcache naming it.

The package is written to a temporary folder with its distribution metadata (`*.dist-info/entry_points.txt`) and
put on the path of a fresh Python process, which then uses the method through `dcache.apply`, `speed=`, `dcache
methods`, `dcache generate --cache`, `dcache estimate` and `dcache calibrate` (the calibrator its config declares)
on the bundled tiny model and reports what happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STEPS = 8
NAME = "stride_plugin"

# The whole method package: a config that declares its main knob and its calibrator (a plan of its own decisions,
# which it replays when given the file), and a schedule that computes every stride-th step (and the last one) and
# reuses the block stack's residual in between.
PLUGIN = '''
"""A cache method outside dcache: compute every `stride`-th step and the last one, reuse the stack in between."""

from dataclasses import dataclass

import dcache
from dcache import Action, Granularity, MethodConfig, Schedule, knob, register_method
from dcache.plans.plan import PlanSchedule


@register_method
@dataclass(frozen=True)
class StrideConfig(MethodConfig):
    """Stride: compute every `stride`-th step and the last step, reuse the block stack's residual in between."""

    method = "stride_plugin"
    title = "Stride"
    main_knob = ("stride", (1, 2, 3, 4))
    calibrator = ("plan", "dcache_stride_plugin:calibrate_stride")
    stride: int = knob(2, low=1, high=100, doc="compute every stride-th step (1 = never reuse)")
    calibration: str | None = knob(None, types=(str,), doc="a plan file of `dcache calibrate --method stride_plugin`")

    def build(self, model):
        if self.calibration is None:
            return StrideSchedule(self)
        from dcache.schedules.calibrated_plans import calibrated_plan

        schedule = PlanSchedule(calibrated_plan(self.method, model, calibration=self.calibration))
        schedule.name = self.method
        return schedule


class StrideSchedule(Schedule):
    granularity = Granularity.STACK
    signals = frozenset()
    name = "stride_plugin"

    def __init__(self, config):
        self.config = config

    def decide(self, ctx):
        last = ctx.num_steps is not None and ctx.step == ctx.num_steps - 1
        return Action.COMPUTE if ctx.step % self.config.stride == 0 or last else Action.REUSE

    def config_dict(self):
        return self.config.to_dict()


def calibrate_stride(target, run_fn, *, num_steps=None, **overrides):
    """The decisions of one run at these settings, as a plan."""
    runs = run_fn if isinstance(run_fn, (list, tuple)) else [run_fn]
    with dcache.apply(target, "stride_plugin", num_steps=num_steps, **overrides) as handle:
        runs[0]()
        return handle.plan()
'''

ENTRY_POINTS = """[dcache.methods]
stride = dcache_stride_plugin
"""

# What the fresh process does with the method; it prints one JSON object.
DRIVER = f'''
import json
import sys

import torch
from typer.testing import CliRunner

import dcache
from dcache.pipelines.bundled import load_tiny_pipeline
from dcache.pipelines.cli import app
from dcache.quality import psnr

out_dir = sys.argv[1]
report = {{"registered": "{NAME}" in dcache.methods()}}
pipe = load_tiny_pipeline()


def run(seed):
    return pipe(labels=[2, 5], num_inference_steps={STEPS}, generator=torch.Generator().manual_seed(seed),
                output_type="pt").images


uncached = run(0)
with dcache.apply(pipe, "{NAME}", stride=2) as handle:
    cached = run(0)
    stats, plan = handle.stats(), handle.plan()
report["apply"] = dict(compute_ratio=stats.compute_ratio, psnr=float(psnr(cached, uncached)), method=stats.method,
                       actions={{b: list(rows) for b, rows in plan.actions.items()}})

with dcache.apply(pipe, "{NAME}", speed="2x", calibration_run=lambda: run(1)) as handle:
    cached = run(0)
    stats = handle.stats()
target = handle.target
report["speed"] = dict(knob=target.knob, value=target.value, met=target.met, sweep=target.sweep,
                       stride=handle.config["stride"], compute_ratio=stats.compute_ratio,
                       psnr=float(psnr(cached, uncached)))

runner = CliRunner()
listed = runner.invoke(app, ["methods"])
report["methods"] = dict(exit_code=listed.exit_code, output=listed.output)
generated = runner.invoke(app, ["generate", "--cache", "{NAME}", "--prompt", "3", "--steps", "{STEPS}",
                                "--repeats", "0", "--out", out_dir])
report["generate"] = dict(exit_code=generated.exit_code, output=generated.output)
estimated = runner.invoke(app, ["estimate", "--cache", "{NAME}", "--steps", "{STEPS}", "--json"])
report["estimate"] = dict(exit_code=estimated.exit_code, output=estimated.output)
plan_file = out_dir + ".plan.json"
calibrated = runner.invoke(app, ["calibrate", "--method", "{NAME}", "--prompt", "3", "--steps", "{STEPS}", "--set",
                                 "stride=4", "--out", plan_file, "--no-progress"])
report["calibrate"] = dict(exit_code=calibrated.exit_code, output=calibrated.output, plan_file=plan_file)
replayed = runner.invoke(app, ["generate", "--cache", "{NAME}", "--set", "calibration=" + plan_file, "--prompt", "3",
                               "--steps", "{STEPS}", "--repeats", "0", "--out", out_dir + "-replay"])
report["replay"] = dict(exit_code=replayed.exit_code, output=replayed.output)
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("plugin")
    (root / "dcache_stride_plugin.py").write_text(PLUGIN)
    info = root / "dcache_stride_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dcache-stride-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    (root / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)}
    done = subprocess.run([sys.executable, str(root / "driver.py"), str(root / "generated")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    data["generated"] = json.loads((root / "generated" / "stats.json").read_text())
    if (root / "generated-replay" / "stats.json").is_file():
        data["replayed"] = json.loads((root / "generated-replay" / "stats.json").read_text())
    return data


def computed_steps(stride: int) -> list[int]:
    return [i for i in range(STEPS) if i % stride == 0 or i == STEPS - 1]


def test_the_entry_point_registers_the_method(report):
    assert report["registered"]
    assert report["methods"]["exit_code"] == 0
    assert any(line.split()[:1] == [NAME] for line in report["methods"]["output"].splitlines())


def test_apply_runs_its_decisions_and_reuses(report):
    applied = report["apply"]
    assert applied["method"] == NAME
    for branch in ("cond", "uncond"):  # the bundled pipeline's split CFG: each branch decides on its own
        rows = applied["actions"][branch]
        assert len(rows) == STEPS
        assert [i for i, row in enumerate(rows) if "C" in row] == computed_steps(2)
        assert all(set(row) == {"R"} for i, row in enumerate(rows) if i not in computed_steps(2))
    assert applied["compute_ratio"] == pytest.approx(len(computed_steps(2)) / STEPS)  # block FLOPs: 5 of 8 steps
    assert applied["psnr"] >= 35.0  # dB against the uncached images (42.4 measured)


def test_speed_target_sweeps_the_declared_main_knob(report):
    target = report["speed"]
    assert target["knob"] == "stride" and target["met"]
    assert [row["value"] for row in target["sweep"]] == [1, 2, 3, 4]
    fast = [row for row in target["sweep"] if row["ideal_speedup"] >= 2.0]
    chosen = next(row for row in target["sweep"] if row["value"] == target["value"])
    assert chosen in fast and chosen["psnr"] == max(row["psnr"] for row in fast)
    assert target["value"] == target["stride"] == 3  # 4 of 8 steps: the least reuse that reaches 2x
    assert target["compute_ratio"] == pytest.approx(0.5)
    assert target["psnr"] >= 30.0  # 36.0 measured


def test_generate_command_caches_with_it(report):
    assert report["generate"]["exit_code"] == 0, report["generate"]["output"]
    stats = report["generated"]
    assert stats["stats"]["method"] == NAME and stats["steps"] == STEPS
    assert stats["compute_ratio"] == pytest.approx(len(computed_steps(2)) / STEPS)  # the default stride 2
    assert float(stats["psnr_db"]) >= 35.0  # 41.4 measured


def test_estimate_command_sweeps_its_main_knob(report):
    assert report["estimate"]["exit_code"] == 0, report["estimate"]["output"]
    (row,) = json.loads(report["estimate"]["output"])
    assert row["method"] == NAME and row["memory"]["peak_bytes"] > 0
    low, high = row["ratio_range"]
    assert high == pytest.approx(1.0)  # stride 1 computes every call
    assert low == pytest.approx(len(computed_steps(4)) / STEPS)  # stride 4: 3 of 8 steps
    assert [value for value, _ in row["ratio_sweep"]] == [1, 2, 3, 4]



def test_calibrate_command_runs_its_declared_calibrator_and_the_plan_replays(report):
    calibrated = report["calibrate"]
    assert calibrated["exit_code"] == 0, calibrated["output"]
    assert f"calibrated {NAME}: a stack plan of {STEPS} steps" in calibrated["output"]
    assert f"--cache {NAME} --set calibration=" in calibrated["output"]
    assert report["replay"]["exit_code"] == 0, report["replay"]["output"]
    stats = report["replayed"]
    assert stats["stats"]["method"] == NAME
    # the plan holds the decisions of stride 4 (--set stride=4), not the default stride 2
    assert stats["compute_ratio"] == pytest.approx(len(computed_steps(4)) / STEPS)
    assert [step["cond"] for step in stats["stats"]["per_step"]] == [
        "C" if i in computed_steps(4) else "R" for i in range(STEPS)]
    assert float(stats["psnr_db"]) >= 28.0  # 34.1 measured
