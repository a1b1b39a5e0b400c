"""The eval's resume files: one record per (variant, item) in `<out>/.work/<variant key>/<item>.safetensors` and one
`cost.json` per variant, each checked before a rerun trusts it.

A record is trusted only where it is found: it must name the variant of its folder and the item of its file name
(a record copied from another item, or a cached variant's record put in `uncached/`, would silently replace other
images and numbers in the report), and every field the report reads must have its type and size. Anything else is a
StateFileError naming the file and the fix; nothing is read back through pickle (dcache.files.state_file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dcache.files.checks import is_count, is_number, same
from dcache.files.atomic import check_inside, read_json
from dcache.files.state_file import StateFileError, load_state, refuse_legacy, save_state

RECORD = "eval record"
RECORD_SUFFIX = ".safetensors"  # dcache.files.state_file: JSON + tensors, never a pickle
MAX_COST_BYTES = 1 << 16  # cost.json holds two numbers; anything larger is not one dcache wrote
MAX_FRAMES = 100_000

# every field the report reads (cpu_seconds is optional: records of older versions lack it)
_FIELDS = ("frames_per_sample", "num_images", "seconds", "stats", "metrics", "features", "predictions", "images")
# the stats fields the report sums (counts) or reads (numbers)
_STAT_COUNTS = ("units_computed", "units_reused", "units_forecast", "calls_fully_computed", "calls", "cache_bytes")
_STAT_NUMBERS = ("block_flops_total", "block_flops_computed")


def record_fix(path: Path) -> str:
    return f"delete {path} (the rerun computes it again) or pass a new --out"


def save_record(rec: dict, path: Path) -> None:
    save_state(path, rec, RECORD)


def load_record(vdir: Path, item: Any, variant: str, fingerprint: str, cached: bool) -> dict | None:
    """The record of `item` (an eval Item) for the variant labelled `variant` in its folder `vdir`; None when there
    is none or it is of another run's settings (recomputed). StateFileError (naming the file and the fix) for a file
    that is not a record dcache wrote there: a pickle of an older dcache (`<item>.pt`, never opened), a record of
    another item or variant, a missing or mistyped field. `cached`: the variant caches (stats, no reference)."""
    path = vdir / f"{item.id}{RECORD_SUFFIX}"
    refuse_legacy(vdir / f"{item.id}.pt", RECORD, record_fix(vdir))
    if not path.is_file():
        return None
    out = vdir.parent.parent  # <out>/.work/<variant>/: a record linked out of <out> would read another file
    check_inside(out, path.relative_to(out), "the eval record", record_fix(path), StateFileError)
    rec = load_state(path, RECORD, record_fix(path))
    if not isinstance(rec, dict):
        raise StateFileError(f"{str(path)!r} does not hold an eval record; {record_fix(path)}.")
    if not same(rec.get("fingerprint"), fingerprint):
        return None
    problem = _belongs(rec, item, variant) or _fields(rec, cached)
    if problem:
        raise StateFileError(f"the eval record {str(path)!r} {problem}; {record_fix(path)}.")
    return rec


def _belongs(rec: dict, item: Any, variant: str) -> str | None:
    found = rec.get("item")
    want = {"index": item.index, "id": item.id, "seed": item.seed, "prompt_indices": list(item.prompt_indices),
            "prompts": list(item.prompts)}
    if not isinstance(found, dict) or not all(same(found.get(k), v) for k, v in want.items()):
        name = found.get("id") if isinstance(found, dict) else None
        return f"is the record of item {name!r}, not of {item.id!r} (copied or moved from another file)"
    if not same(rec.get("variant"), variant):
        return f"is a record of {rec.get('variant')!r}, found in the folder of {variant!r} (copied or moved)"
    return None


def _fields(rec: dict, cached: bool) -> str | None:
    """What is wrong with the record's fields (None: nothing); sizes are checked against num_images."""
    missing = [k for k in _FIELDS if k not in rec]  # None is a value ("no features"); a missing key is damage
    if missing:
        return f"lacks {missing}"
    frames = rec.get("frames_per_sample")
    if not is_count(frames, 0, MAX_FRAMES):
        return f"has frames_per_sample {frames!r}, not an int in 0..{MAX_FRAMES}"
    want = len(rec["item"]["prompts"]) * max(frames, 1)
    if not same(rec.get("num_images"), want):
        return f"has num_images {rec.get('num_images')!r}, its item makes {want}"
    for key in ("seconds", "cpu_seconds"):
        value = rec.get(key, [])
        if not isinstance(value, list) or not all(is_number(s, 0.0) for s in value):
            return f"has {key} {str(value)[:60]}, not a list of durations"
    if not rec.get("seconds"):
        return "has no timings (seconds)"
    stats = rec.get("stats")
    if cached:
        if not isinstance(stats, dict):
            return "has no stats (a cached variant's record holds them)"
        bad = [k for k in _STAT_COUNTS if not is_count(stats.get(k), 0)]
        bad += [k for k in _STAT_NUMBERS if not is_number(stats.get(k), 0.0)]
        steps = stats.get("per_step")
        if not isinstance(steps, list) or not all(isinstance(s, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in s.items()) for s in steps):
            bad.append("per_step")
        if not bad and stats["block_flops_computed"] > stats["block_flops_total"]:
            bad.append("block_flops_computed > block_flops_total")
        if not isinstance(stats.get("granularity"), str):
            bad.append("granularity")
        if bad:
            return f"has invalid stats {bad}"
    metrics = rec.get("metrics")
    videos = len(rec["item"]["prompts"])
    if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and len(v) == (videos if k == "temporal" else want) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) for k, v in metrics.items()):
        return "has metrics that are not lists of one number per image (temporal: per video)"
    predictions = rec.get("predictions")
    if predictions is not None and not (isinstance(predictions, list) and len(predictions) == want
                                        and all(is_count(p, 0) for p in predictions)):
        return "has predictions that are not one class index per image"
    features = rec.get("features")
    if features is not None and not (isinstance(features, torch.Tensor) and features.dim() == 2
                                     and features.shape[0] == want and features.is_floating_point()):
        return "has features that are not one float row per image"
    images = rec.get("images")
    if images is None and not cached:
        return "has no images (the uncached record is the reference)"
    if images is not None and not (isinstance(images, torch.Tensor) and images.dim() == 4
                                   and images.shape[0] == want and images.is_floating_point()):
        return "has images that are not a float tensor [num_images, C, H, W]"
    return None


def load_cost(path: Path) -> dict | None:
    """A variant's cost.json ({"flops_per_image": float | None, "measured_on": item id}); None when there is none."""
    if not path.is_file():
        return None
    fix = "delete it (the rerun measures it again) or pass a new --out"
    cost = read_json(path, MAX_COST_BYTES, "cost file", fix, StateFileError)
    if not isinstance(cost, dict):
        raise StateFileError(f"{str(path)!r} does not hold a JSON object; {fix}.")
    flops = cost.get("flops_per_image")
    if (flops is not None and not is_number(flops, 0.0)) or not isinstance(cost.get("measured_on"), str):
        raise StateFileError(f"the cost file {str(path)!r} needs flops_per_image (a number >= 0 or null) and "
                             f"measured_on (an item id); {fix}.")
    return {"flops_per_image": flops, "measured_on": cost["measured_on"]}


__all__ = ["RECORD", "RECORD_SUFFIX", "save_record", "load_record", "load_cost", "record_fix"]
