"""Calibrated plans of the profiled methods (ERTACache, ProfilingDiT, InvarDiff, BAC): where a method finds its plan.

    dcache.apply(pipe, "bac", calibration="bac.plan.json")             # or dcache.apply(pipe, plan)

Making and saving a plan runs the pipeline: dcache.schedules.tuning.plan_calibration (`calibrate_plan`,
`save_plan_calibration`), or on the command line `dcache calibrate --method bac` (see pipelines/cli.py).

Where a method finds its plan (`calibrated_plan`, called by each method's config.build), first match wins:
  1. `plan=FILE`: a plan file;
  2. `calibration=FILE`: a plan file, or a calibration file (format "dcache.calibration", e.g. the bundled
     pipelines/assets/calibration.json) holding an entry of that method for the model's identity (tables.py);
  3. the plan registered for the model's identity (the bundled model's are registered from that file).
`CalibratedPlanSchedule` is what each of those methods' configs builds from the plan.
Plans replay at any step count: a generation of M steps takes at step i the planned row round(i (N-1) / (M-1)) of
the N calibrated ones (Plan.interpolate_steps, nearest step), as MagCache maps its ratio table.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from torch import nn

import dcache.files.atomic
from dcache.methods import calibrated_methods, method_title
from dcache.plans.plan import MAX_PLAN_BYTES, PLAN_FORMAT, Plan, PlanSchedule

from .calibration_file import CALIBRATION_FORMAT, CalibrationFile
from .tables import known_identities, lookup_table, model_identity


class CalibrationMissing(ValueError):
    """A model has no calibration for a method. str() gives the `dcache calibrate` command and the Python calls;
    `cli_message` the command only (what the command line prints)."""

    def __init__(self, problem: str, command: str, python: str):
        self.command = command
        self.cli_message = f"{problem} Calibrate it once: {command}  (it prints how to generate with the result)"
        super().__init__(f"{problem} Calibrate it once from the command line: {command}; or in Python: {python}")


def plan_method_title(method: str) -> str:
    """The name messages use for a profiled method (one whose config declares a "plan" calibrator); a ValueError
    naming the profiled methods for another name."""
    plan_methods = calibrated_methods("plan")
    if method not in plan_methods:
        raise ValueError(f"{method!r} is not a profiled method with a calibrated plan; choose one of "
                         f"{plan_methods}.")
    return method_title(method)


def read_json(path: Path, what: str) -> Any:
    """The JSON value in `path` (a plan or a calibration file: at most MAX_PLAN_BYTES, checked before reading); a
    ValueError naming `what` and the file when it is larger or not valid JSON."""
    return dcache.files.atomic.read_json(path, MAX_PLAN_BYTES, what, "calibrate again (dcache calibrate)")


class CalibratedPlanSchedule(PlanSchedule):
    """The schedule of a profiled method: replays its calibrated plan under the method's name; the plans a run
    exports keep the calibrated plan's extras (per-step coefficients, a step action), so they replay the same."""

    method = ""  # the method's name: each subclass sets it

    def __init__(self, plan: Plan):
        super().__init__(plan)
        self.name = self.method

    def plan_extras(self) -> dict:
        return dict(self.plan.extras)


# ------------------------------------------------------------------------------------------------------------------
# Finding the plan of a model
# ------------------------------------------------------------------------------------------------------------------

def calibrated_plan(method: str, model: nn.Module, *, plan: str | None = None,
                    calibration: str | None = None) -> Plan:
    """The plan `method` replays on `model` (see the module docstring for the order); interpolates steps."""
    title = plan_method_title(method)
    if plan is not None and calibration is not None:
        raise ValueError(f"{title}: pass plan= or calibration=, not both (each names the file of a calibrated "
                         f"plan).")
    if plan is not None:
        found = Plan.load(plan)
    elif calibration is not None:
        found = _plan_from_file(method, Path(calibration), model)
    else:
        table = lookup_table(method, model)
        if table is None:
            identity = model_identity(model)
            raise CalibrationMissing(
                f"{title} replays a plan calibrated for the model, and none is registered for {identity} (known: "
                f"{', '.join(known_identities(method)) or 'none'}).", calibrate_command(method, model),
                f"plan = dcache.schedules.tuning.plan_calibration.calibrate_plan('{method}', pipe, run_fn) (run_fn "
                f"runs the pipeline once); plan.save('{method}.plan.json'); dcache.apply(pipe, '{method}', "
                f"calibration='{method}.plan.json') or dcache.apply(pipe, plan).")
        found = table if isinstance(table, Plan) else Plan.from_dict(
            table, source=f"the {title} plan registered for {model_identity(model)}")
    return found if found.interpolate_steps else dataclasses.replace(found, interpolate_steps=True)


def _plan_from_file(method: str, path: Path, model: nn.Module) -> Plan:
    title = plan_method_title(method)
    what = f"{title} calibration={str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{what} does not exist; write it with `{calibrate_command(method, model, str(path))}`.")
    data = read_json(path, what)
    kind = data.get("format") if isinstance(data, dict) else None
    if kind == PLAN_FORMAT:
        return Plan.from_dict(data, source=f"plan file {str(path)!r}")
    if kind != CALIBRATION_FORMAT:
        raise ValueError(f"{what} is neither a dcache plan nor a dcache calibration file; pass the file "
                         f"`dcache calibrate --method {method}` wrote.")
    entry = CalibrationFile.from_dict(data, source=f"calibration file {str(path)!r}").find(method, model=model)
    if entry is None:
        raise ValueError(f"{what} has no {title} entry for {model_identity(model)}; add one with "
                         f"`{calibrate_command(method, model, str(path))}`.")
    return Plan.from_dict(entry.table, source=f"the {title} entry of {str(path)!r}")


def model_source(model: nn.Module) -> tuple[str | None, bool]:
    """(hub id or pipeline folder the transformer was loaded from, whether that pipeline takes class labels).

    diffusers records where a model was loaded from (dcache.compat.diffusers.loaded_from): a pipeline's component gets
    '<pipeline folder>/transformer', from the hub '<cache>/models--org--name/snapshots/<rev>/transformer'."""
    # imported here: method files import this module, and `dcache methods` must start without diffusers
    from dcache.compat.diffusers import loaded_from

    where = loaded_from(model)
    if where is None:
        return None, False
    path = Path(where)
    for i, part in enumerate(path.parts[:-1]):
        if part.startswith("models--") and path.parts[i + 1] == "snapshots":
            return part[len("models--"):].replace("--", "/"), False
    for folder in (path.parent, path):
        index = folder / "model_index.json"
        if index.is_file():
            try:
                pipeline_class = json.loads(index.read_text()).get("_class_name")
            except (ValueError, AttributeError):
                pipeline_class = None
            # the digit pipeline (dcache.pipelines.tiny_pipeline) takes labels: its calibration needs no --prompt
            return str(folder), pipeline_class == "DigitFlowPipeline"
    if not path.exists() and where.count("/") == 1:  # a hub id: the transformer was loaded on its own
        return where, False
    return None, False


def calibrate_command(method: str, model: nn.Module, out: str | None = None) -> str:
    """The `dcache calibrate` command line that calibrates `method` for `model` (with its hub id or folder when
    diffusers recorded it, else a placeholder)."""
    source, labels = model_source(model)
    args = ["dcache calibrate", "--model", shlex.quote(source) if source else "<hub id or folder>",
            "--method", method]
    if not labels:
        args += ["--prompt", "'<a typical prompt>'"]
    if out is not None:
        args += ["--out", shlex.quote(out)]
    return " ".join(args)


__all__ = ["CalibrationMissing", "CalibratedPlanSchedule", "plan_method_title", "read_json", "calibrated_plan",
           "calibrate_command", "model_source"]
