"""Which scope a searched plan replays in: block scope, call scope, or whichever scores better on the calibration set.

A stack plan (one decision per call) can replay in block scope (a reused call forecasts the stack's residual and
recomputes the output head on it) or in call scope (`scope="call"`: the whole call's offset v - x is forecast and
nothing of the transformer runs). Which is better depends on the model and on the calibration set: on the bundled
model call scope costs ~1 dB at guidance 1.5 and wins ~2 dB at guidance 3 for the same LeMiCa plans. With a
calibration set at several guidance scales (scored by the worst scale) the better scope is the one that transfers.

`choose_scope` replays every plan of a written front in each candidate scope, keeps the best in the plan's
`extras["scope"]` (which `dcache.apply` replays in), and rewrites the front (plans, front.json, front.png,
summary.md) with the measured quality of the chosen scope.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from dcache.actions import Granularity
from dcache.plans.plan import Plan

from .core import Calibration, FrontPoint, Measured, Template, measure, write_front

SCOPES = ("blocks", "call")


def with_scope(plan: Plan, scope: str) -> Plan:
    """A copy of `plan` that replays in `scope` (recorded in extras, as `handle.plan()` records it)."""
    return dataclasses.replace(plan, extras={**plan.extras, "scope": scope})


def choose_scope(calib: Calibration, template: Template, out_dir: str | Path,
                 scopes: Sequence[str] = SCOPES) -> dict:
    """Rescore the front in `out_dir` (written by a search on `calib`) in each of `scopes`; keep the best per plan.

    Only stack plans can replay in call scope; block and module plans keep their scope. Returns the new front."""
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"scopes {list(scopes)} must be a non-empty subset of {list(SCOPES)}.")
    out = Path(out_dir)
    front = json.loads((out / "front.json").read_text())
    points = []
    for row in front["points"]:
        plan = Plan.load(out / row["plan"])
        searched = plan.extras.get("scope", "blocks")  # the scope the search measured the plan in (row's numbers)
        candidates = scopes if Granularity(plan.granularity) is Granularity.STACK else [searched]
        scored = []
        for scope in candidates:
            replay = with_scope(plan, scope)
            measured = (Measured(row["quality"], row["compute_ratio"], dict(row["metrics"])) if scope == searched
                        else measure(calib, template, replay))
            scored.append((measured, scope, replay))
        best, scope, replay = max(scored, key=lambda s: s[0].quality)  # ties: the first listed scope
        best.metrics = {**best.metrics, **{f"quality_{s}_scope": m.quality for m, s, _ in scored}}
        points.append(FrontPoint(Path(row["plan"]).name.removesuffix(".plan.json"), replay,
                                 Measured(best.quality, best.compute_ratio, best.metrics)))
    config = {**front.get("config", {}), "scopes": list(scopes)}
    return write_front(out, front["method"], points, others=front.get("evaluated"), config=config)
