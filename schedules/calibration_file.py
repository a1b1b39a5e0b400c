"""The calibration file: tables measured on a model (MagCache ratios, TeaCache coefficients, calibrated plans).

The policies read it at run time (`dcache.apply(pipe, "magcache", calibration="cal.json")`); the tuning layer
(`dcache.schedules.tuning`) writes it.

The file (JSON, written atomically, merged with what the file already holds):
{
  "format": "dcache.calibration", "version": 1,
  "entries": [{"method": "magcache", "model_identity": "FluxTransformer2DModel(num_layers=2,...)",
               "model_class": "FluxTransformer2DModel", "scheduler": "FlowMatchEulerDiscreteScheduler",
               "num_steps": 28, "resolution": [64, 32], "table": {...}, "runs": 1, "provenance": {...}}]
}
An entry is keyed by (method, model identity, scheduler, steps, resolution = the [tokens, width] entering the first
block); saving an entry with the same key replaces it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from dcache.files.checks import is_count
from dcache.files.atomic import read_json
from dcache.methods import calibrated_methods, method_class
from dcache.plans.plan import PLAN_FORMAT, Plan, PlanError, atomic_write_text

from .tables import model_identity, register_table

CALIBRATION_FORMAT = "dcache.calibration"
CALIBRATION_VERSION = 1
# A calibration file holds a few tables per model (a ratio or coefficient list per step count and resolution, and
# the profiled methods' action plans): kilobytes each, so thousands of entries fit in this. A larger file is refused
# from its size, before it is read.
MAX_CALIBRATION_BYTES = 64 << 20
MAX_TABLE_STEPS = 10_000  # one ratio per denoising step; diffusers' schedulers train on 1000 timesteps
RECALIBRATE = "recalibrate (dcache calibrate --method <method>) or delete the entry"


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file, the entry and field, and the fix."""


@dataclass
class CalibrationEntry:
    method: str  # the table kind: "magcache" | "teacache"
    model_identity: str
    model_class: str
    table: Any
    num_steps: int | None = None
    scheduler: str | None = None
    resolution: list[int] | None = None
    runs: int = 1
    provenance: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        return (self.method, self.model_identity, self.scheduler, self.num_steps,
                tuple(self.resolution) if self.resolution else None)


@dataclass
class CalibrationFile:
    entries: list[CalibrationEntry] = field(default_factory=list)
    source: str = "calibration"

    def find(self, method: str, *, model: nn.Module | None = None, identity: str | None = None,
             num_steps: int | None = None, resolution: Sequence[int] | None = None) -> CalibrationEntry | None:
        """The entry for (method, model); among several, the one matching num_steps / resolution best, else the one
        with the most steps (nearest-step interpolation loses least from the longest table)."""
        if identity is None and model is not None:
            identity = model_identity(model)
        found = [e for e in self.entries if e.method == method and (identity is None or e.model_identity == identity)]
        if not found:
            return None

        def score(e: CalibrationEntry) -> tuple:
            return (num_steps is not None and e.num_steps == num_steps,
                    resolution is not None and e.resolution is not None and list(e.resolution) == list(resolution),
                    -abs((e.num_steps or 0) - num_steps) if num_steps is not None else 0,
                    e.num_steps or 0)

        return max(found, key=score)

    def register(self, *, variant: str = "default") -> list[tuple[str, str]]:
        """Register every entry's table with `register_table(method, identity, table)`; returns (method, identity)."""
        done = []
        for e in sorted(self.entries, key=lambda e: e.num_steps or 0):  # the longest table ends up registered
            register_table(e.method, e.model_identity, e.table, variant=variant)
            done.append((e.method, e.model_identity))
        return done

    def to_dict(self) -> dict[str, Any]:
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
                "entries": [asdict(e) for e in self.entries]}

    def save(self, path: str | os.PathLike) -> Path:
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: Any, source: str = "calibration") -> "CalibrationFile":
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"{source} is not a dcache calibration file (missing \"format\": "
                             f"\"{CALIBRATION_FORMAT}\"); write one with calibrate_magcache / calibrate_teacache.")
        if data.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"{source} has calibration version {data.get('version')!r:.40}; this dcache reads "
                             f"version {CALIBRATION_VERSION}. Recalibrate or upgrade dcache.")
        if not isinstance(data.get("entries", []), list):
            raise CalibrationError(f"{source}: \"entries\" must be a list of calibration entries; the file is "
                                   f"corrupted or hand-edited. Recalibrate.")
        entries = []
        known = set(CalibrationEntry.__dataclass_fields__)
        for i, raw in enumerate(data.get("entries", [])):
            if not isinstance(raw, dict) or not {"method", "model_identity", "model_class", "table"} <= set(raw):
                raise ValueError(f"{source}: entry {i} lacks method / model_identity / model_class / table; the file "
                                 f"is corrupted or hand-edited. Recalibrate.")
            unknown = set(raw) - known
            if unknown:
                raise ValueError(f"{source}: entry {i} has unknown fields {sorted(unknown, key=str)}; it was written "
                                 f"by another version.")
            check_entry(raw, f"{source}: entry {i}")
            entries.append(CalibrationEntry(**raw))
        return cls(entries, source)


def load_calibration(path: str | os.PathLike, *, register: bool = False) -> CalibrationFile:
    """Read a calibration file; with register=True also register its tables for their model identities."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration file {str(path)!r} does not exist; write one with calibrate_magcache(...) or "
                         f"calibrate_teacache(..., path={str(path)!r}).")
    data = read_json(path, MAX_CALIBRATION_BYTES, "calibration file", "recalibrate", CalibrationError)
    cal = CalibrationFile.from_dict(data, source=f"calibration file {str(path)!r}")
    if register:
        cal.register()
    return cal


# ------------------------------------------------------------------------------------------------------------------
# Validation: every field and table checked when the file is read, so that a damaged or hand-edited file fails
# here, naming the file, the entry and the field, and never later inside a generation (an IndexError on an empty
# ratio list) or silently (a NaN or zero ratio, an empty TeaCache entry, which switch caching off).
# ------------------------------------------------------------------------------------------------------------------

def check_entry(raw: dict, where: str) -> None:
    """CalibrationError naming `where` (the file and entry), the field and the fix for any invalid field. A table
    is checked by its method's config (`MethodConfig.check_calibration_table`: the methods that calibrate a table,
    schedules/tuning/calibrate.py); the profiled methods' entries hold a plan (schedules/calibrated_plans.py) and
    are checked as plans."""
    fields: dict[str, tuple[bool, str]] = {
        "method": (isinstance(raw["method"], str), "a method name"),
        "model_identity": (isinstance(raw["model_identity"], str), "a string"),
        "model_class": (isinstance(raw["model_class"], str), "a string"),
        "num_steps": (raw.get("num_steps") is None or (is_count(raw["num_steps"], 1)
                                                       and raw["num_steps"] <= MAX_TABLE_STEPS),
                      f"an int in 1..{MAX_TABLE_STEPS} or null"),
        "scheduler": (raw.get("scheduler") is None or isinstance(raw["scheduler"], str), "a class name or null"),
        "resolution": (raw.get("resolution") is None or (isinstance(raw["resolution"], list) and len(
            raw["resolution"]) <= 8 and all(is_count(n) for n in raw["resolution"])), "a list of ints or null"),
        "runs": (is_count(raw.get("runs", 1), 1), "an int >= 1"),
        "provenance": (isinstance(raw.get("provenance", {}), dict), "a JSON object")}
    bad = [(name, what) for name, (ok, what) in fields.items() if not ok]
    if not bad:
        method, table = raw["method"], raw["table"]
        config_cls = method_class(method)
        table_check = config_cls.check_calibration_table if config_cls is not None else None
        if table_check is not None:
            bad = table_check(table)
        elif isinstance(table, dict) and table.get("format") == PLAN_FORMAT:
            try:
                Plan.from_dict(table, source=f"{where} (a {method} plan)")
            except PlanError as exc:
                raise CalibrationError(f"{exc} (the calibration entry is damaged: {RECALIBRATE})") from None
            except (TypeError, ValueError, RecursionError) as exc:
                raise CalibrationError(f"{where}: its {method} plan is invalid ({str(exc)[:160]}); "
                                       f"{RECALIBRATE}.") from None
        else:
            bad = [("method", f"one of {calibrated_methods('table')} or a profiled method with a plan table")]
    if bad:
        name, what = bad[0]
        shown = f"={raw[name]!r:.60}" if name in raw else ""
        raise CalibrationError(f"{where}: field {name}{shown} is invalid: it must be {what}. The file is corrupted "
                               f"or edited by hand; {RECALIBRATE}.")


def save_calibration(path: str | os.PathLike, entry: CalibrationEntry) -> Path:
    """Add `entry` to the file at `path` (replacing an entry with the same key), atomically."""
    path = Path(path)
    cal = load_calibration(path) if path.is_file() else CalibrationFile(source=str(path))
    cal.entries = [e for e in cal.entries if e.key() != entry.key()] + [entry]
    return cal.save(path)


__all__ = ["CALIBRATION_FORMAT", "CALIBRATION_VERSION", "CalibrationEntry", "CalibrationFile", "CalibrationError",
           "load_calibration", "save_calibration", "check_entry", "MAX_CALIBRATION_BYTES"]
