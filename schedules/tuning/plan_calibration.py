"""Calibrated plans of the profiled methods (ERTACache, ProfilingDiT, InvarDiff, BAC): make and save.

    plan = calibrate_plan("bac", pipe, run_fn, compute_ratio=0.4)     # calibrate_bac(...) with config overrides
    save_plan_calibration("bac.plan.json", "bac", plan, pipe.transformer)
    dcache.apply(pipe, "bac", calibration="bac.plan.json")             # or dcache.apply(pipe, plan)

The command line does the same: `dcache calibrate --method bac` (see pipelines/cli.py). Where a method finds the
plan at run time: schedules/calibrated_plans.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

import dcache
from dcache.methods import calibrator
from dcache.plans.plan import PLAN_FORMAT, Plan

from ..calibrated_plans import plan_method_title, read_json
from ..calibration_file import CALIBRATION_FORMAT, CalibrationEntry, save_calibration
from ..tables import model_identity


def calibrate_plan(method: str, target: Any, run_fn: Callable[[], Any] | Sequence[Callable[[], Any]], *,
                   num_steps: int | None = None, **overrides: Any) -> Plan:
    """The calibrated plan of a profiled method: its calibrate_<method>(target, run_fn, **overrides), where the
    overrides are fields of its config (e.g. compute_ratio=0.4 for BAC, threshold=0.2 for ERTACache). The
    function is the one the method's config declares (`calibrator = ("plan", "module:calibrate_<method>")`)."""
    plan_method_title(method)
    _, calibrate = calibrator(method)
    return calibrate(target, run_fn, num_steps=num_steps, **overrides)


def save_plan_calibration(path: str | Path, method: str, plan: Plan, model: nn.Module) -> str:
    """Write `plan` atomically: as a plan file ("plan"), or, when `path` already is a calibration file, as the
    file's `method` entry for `model` ("calibration"; merged with its other entries, an entry with the same method,
    model, scheduler, steps and resolution is replaced). Another kind of existing file is refused, not overwritten."""
    title, path = plan_method_title(method), Path(path)
    data = read_json(path, "the output file") if path.is_file() else {"format": PLAN_FORMAT}
    existing = data.get("format") if isinstance(data, dict) else None
    if existing == CALIBRATION_FORMAT:
        calibration = plan.provenance.get("calibration", {})
        entry = CalibrationEntry(method=method, model_identity=model_identity(model), model_class=plan.model_class,
                                 table=plan.to_dict(), num_steps=plan.num_steps, scheduler=plan.scheduler,
                                 # [tokens, width] entering the first block, as the MagCache / TeaCache entries
                                 resolution=plan.resolution[1:] if plan.resolution else None,
                                 runs=int(calibration.get("runs", 1)),
                                 provenance={"created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                             "dcache": dcache.__version__, "kind": "plan"})
        save_calibration(path, entry)
        return "calibration"
    if existing != PLAN_FORMAT:
        raise ValueError(f"{str(path)!r} exists and is neither a dcache plan nor a dcache calibration file; write the "
                         f"{title} plan to another file (--out) so that it is not overwritten.")
    plan.save(path)
    return "plan"


__all__ = ["calibrate_plan", "save_plan_calibration"]
