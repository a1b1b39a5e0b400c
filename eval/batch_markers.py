"""The per-item markers of a batch generation (`<out>/.work/<item>.json`), checked before a rerun trusts them.

A marker says that an item's images are written and holds their manifest entries. Its `file` names are copied into
manifest.json, so a marker is used only when each entry is the one its item makes: the image name the item gives
(`images/s<seed>-p<index>.png` or `.gif`, never a path that climbs out of the folder), its prompt, seed and index,
and numbers of the right types. A marker that is not valid JSON or holds anything else is a MarkerError naming the
file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dcache.files.checks import is_count, is_number, same
from dcache.files.atomic import check_inside, read_json

MAX_MARKER_BYTES = 16 << 20  # one entry per image of an item (a few hundred bytes each)


class MarkerError(ValueError):
    """A batch marker that cannot be trusted; the message names the file and the fix."""


def image_names(item: Any) -> list[str]:
    """The file names (without suffix) of an item's images, one per prompt."""
    return [f"s{item.seed}-p{i:05d}" for i in item.prompt_indices]


def write_marker(marker: Path, fingerprint: str, entries: list[dict]) -> None:
    from dcache.files.atomic import atomic_write_text

    atomic_write_text(marker, json.dumps({"fingerprint": fingerprint, "entries": entries}))


def read_marker(marker: Path, fingerprint: str, out_dir: Path, item: Any) -> list[dict] | None:
    """The entries of a finished item; None when it must be (re)generated: no marker, a marker of other settings,
    or an image that is gone. MarkerError for a marker that is not one dcache wrote for this item."""
    if not marker.is_file():
        return None
    fix = f"delete {marker} (the rerun generates the item's images again) or pass a new --out"
    check_inside(out_dir, marker.relative_to(out_dir), "the batch marker", fix, MarkerError)  # a link out of --out
    done = read_json(marker, MAX_MARKER_BYTES, "batch marker", fix, MarkerError)
    if not isinstance(done, dict) or not isinstance(done.get("entries"), list):
        raise MarkerError(f"the batch marker {str(marker)!r} holds no list of entries; {fix}.")
    if not same(done.get("fingerprint"), fingerprint):
        return None
    entries = done["entries"]
    if len(entries) != len(item.prompts):
        raise MarkerError(f"the batch marker {str(marker)!r} holds {len(entries)} entries, its item makes "
                          f"{len(item.prompts)} images; {fix}.")
    for k, (entry, name) in enumerate(zip(entries, image_names(item))):
        problem = _entry_problem(entry, k, name, item)
        if problem:
            raise MarkerError(f"the batch marker {str(marker)!r}: entry {k} {problem}; {fix}.")
    files = [check_inside(out_dir, e["file"], "the image", fix, MarkerError) for e in entries]
    return entries if all(f.is_file() for f in files) else None


def _entry_problem(entry: Any, k: int, name: str, item: Any) -> str | None:
    if not isinstance(entry, dict):
        return "is not a table"
    if entry.get("file") not in (f"images/{name}.png", f"images/{name}.gif"):
        return f"names the file {str(entry.get('file'))[:80]!r}, the item's image is images/{name}.png (or .gif)"
    want = {"prompt": item.prompts[k], "prompt_index": item.prompt_indices[k], "seed": item.seed, "item": item.id,
            "batch_size": len(item.prompts)}
    wrong = [key for key, value in want.items() if not same(entry.get(key), value)]
    flops = entry.get("block_flops")
    if not (isinstance(flops, list) and len(flops) == 2 and all(is_number(f, 0.0) for f in flops)):
        wrong.append("block_flops")
    wrong += [key for key in ("batch_seconds", "seconds_per_image") if not is_number(entry.get(key), 0.0)]
    if not is_number(entry.get("compute_ratio"), 0.0, 1.0):
        wrong.append("compute_ratio")
    if not is_count(entry.get("process"), 0):
        wrong.append("process")
    return f"has other or invalid {wrong} than its item's" if wrong else None


__all__ = ["MarkerError", "read_marker", "write_marker", "image_names"]
