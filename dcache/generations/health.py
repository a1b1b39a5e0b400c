"""A cache that says what it did: facts about each finished generation, and one warning per handle per kind.

After every generation the engine hands its record here (`HealthMonitor.end_generation`). The facts, also in
`handle.stats().health` for engines that log rather than read warnings:

    reuse_fraction     units served from the cache (reused or forecast) / all units, over the generation
    nothing_reused     True when every call computed every unit: the cache cost its overhead and saved nothing
    calibrating        the generation measured a calibration (a self-calibrating MagCache's first one computes every
                       step on purpose: no warning then)
    reused_after_warmup  fraction of the calls after each branch's first computed one served whole by plain reuse;
                       near 1 means the cache froze the image (quality drops; the threshold is too high). A forecast
                       moves with the step, so calls served by forecasting (keyframe, TaylorSeer, ...) do not count:
                       a keyframe plan that computes 4 of 28 steps is not frozen
    missing_branches   CFG branches earlier generations of this handle had and this one did not (a pipeline that
                       stopped setting cache_context names, or guidance switched off): decisions may differ
    non_finite_units   cached tensors that hold NaN or infinity at the generation's end ("branch/unit")
    non_finite_served  units whose cached value (or its forecast) held NaN or infinity when a call was to serve it:
                       that call computed the unit instead ("branch/unit", once each per generation)
    notes              what a method said about itself in the generation, by kind (e.g. "cfg_difference_fallback":
                       the CFG difference measured worse than the branches' own caches and was not served)

Warnings (`DCacheHealthWarning`, a UserWarning) are said once per handle and kind, with the knob to change. The
checks read the record the engine keeps anyway; only `non_finite_units` reads tensors: one reduction per cached
tensor and one host read per generation, at its end; `non_finite_served` is found by the decision
(dcache.runtime.decision: one reduction on each tensor about to be served).
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..actions import Action

if TYPE_CHECKING:
    from ..runtime.cache_state import BranchState
    from .records import GenerationRecord

_COMPUTE = Action.COMPUTE.value
_REUSE = Action.REUSE.value
# A generation that served at least this share of its post-warm-up calls whole by plain reuse is "all reused".
ALL_REUSED = 0.9
# Below this many calls after the warm-up there is too little evidence to call a cache frozen.
MIN_CALLS = 4
# Computed block FLOPs above this multiple of the uncached generation's, with something served: a costly cache.
COSTLY = 1.0 + 1e-6


_QUIET = threading.local()  # .depth > 0: inside quiet() on this thread


@contextmanager
def quiet():
    """No health warnings on this thread inside the block (the facts are still kept): for tools that run many
    settings on purpose, such as a speed= sweep or a plan search, where a setting that reuses nothing is expected."""
    _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.depth -= 1


class DCacheHealthWarning(UserWarning):
    """dcache's cache did nothing, did everything, lost a branch or held non-finite values (see
    dcache.generations.health)."""


@dataclass
class Health:
    reuse_fraction: float = 0.0
    nothing_reused: bool = False
    calibrating: bool = False
    reused_after_warmup: float = 0.0
    missing_branches: list[str] = field(default_factory=list)
    non_finite_units: list[str] = field(default_factory=list)
    non_finite_served: list[str] = field(default_factory=list)  # computed instead of serving a non-finite value
    notes: list[str] = field(default_factory=list)  # what a method said about itself (HealthMonitor.note), by kind

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite_check(branches: dict) -> list[str]:
    """'branch/unit' of every cached tensor with a NaN or an infinity; one host read for all of them."""
    names, flags = [], []
    for branch, bstate in branches.items():
        for unit, history in getattr(bstate, "units", {}).items():
            # plain histories hold tensors, low-precision ones dcache.memory.cache_codec.Stored (its .data)
            tensors = [getattr(t, "data", t) for t in getattr(history, "tables", None) or []]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            tensors = [t for t in tensors if t.is_floating_point() and t.numel() and t.device.type != "meta"]
            if tensors:
                names.append(f"{branch}/{unit}")
                # float8 has no isfinite kernel everywhere: widened first (a copy, once per generation)
                flags.append(torch.stack([~torch.isfinite(t if t.itemsize > 1 else t.float()).all()
                                          for t in tensors]).any())
    if not flags:
        return []
    bad = torch.stack(flags).tolist()
    return [name for name, b in zip(names, bad) if b]


class HealthMonitor:
    """Per engine (so per handle): the last generation's Health and the kinds already warned about."""

    def __init__(self, method: str = "", knob: Callable[[], str | None] = lambda: None, warn: bool = True):
        self.method = method
        self.knob = knob  # the method's main knob name, looked up lazily (dcache.methods.main_knob)
        self.warn = warn  # False: facts only (engines built for estimates, a ControlNet's follower)
        self.last = Health()
        self.last_record: GenerationRecord | None = None
        self._seen_branches: set[str] = set()
        self._warned: set[str] = set()
        self._calibrating = False  # the running generation measures a calibration (computes every step on purpose)
        self._notes: list[str] = []  # kinds noted during the running generation (note)
        self._non_finite_served: list[str] = []  # units recomputed in the running generation (served_non_finite)

    def start_generation(self, calibrating: bool) -> None:
        self._calibrating = bool(calibrating)
        self._notes = []
        self._non_finite_served = []

    def end_generation(self, record: GenerationRecord, branches: dict[str, BranchState]) -> Health:
        calls = record.calls
        if not calls or self.last_record is record or getattr(record, "aborted", False):
            return self.last  # an interrupted generation is no evidence about the cache: keep the last verdict
        self.last_record = record
        units = sum(len(c.actions) for c in calls)
        served = sum(1 for c in calls for a in c.actions if a != _COMPUTE)
        after = []  # per branch, the calls after its first fully computed one
        for branch in record.branches():
            own = [c for c in calls if c.branch == branch]
            first = next((i for i, c in enumerate(own) if set(c.actions) == {_COMPUTE}), None)
            after += own[first + 1:] if first is not None else []
        whole = sum(1 for c in after if set(c.actions) == {_REUSE})
        names = set(record.branches())
        health = Health(reuse_fraction=served / units if units else 0.0, nothing_reused=served == 0,
                        calibrating=self._calibrating,
                        reused_after_warmup=whole / len(after) if after else 0.0,
                        missing_branches=sorted(self._seen_branches - names),
                        non_finite_units=_finite_check(branches), notes=list(self._notes),
                        non_finite_served=list(self._non_finite_served))
        self._seen_branches |= names
        self.last = health
        if self.warn and not getattr(_QUIET, "depth", 0):
            total = sum(c.flops_total for c in calls)  # 0 where FLOPs are not counted (count_flops=False)
            flop_ratio = sum(c.flops_computed for c in calls) / total if total > 0 else None
            self._warn(health, len(calls), len(after), flop_ratio)
        return health

    def _warn(self, h: Health, calls: int, after: int, flop_ratio: float | None) -> None:
        knob = self.knob()
        name = f"dcache[{self.method}]" if self.method else "dcache"
        turn = f"its `{knob}`" if knob else "its main setting"
        if h.nothing_reused and not h.calibrating:
            self._once("nothing", f"{name} reused nothing in the last generation ({calls} calls, every unit "
                       f"computed): the cache costs its overhead and saves no time. Raise {turn} (or ask for a "
                       f"target: dcache.apply(pipe, {self.method!r}, speed='2x', calibration_run=...)).")
        elif after >= MIN_CALLS and h.reused_after_warmup >= ALL_REUSED:
            fix = f"Lower its `{knob}`" if knob else "Let it compute more steps"
            self._once("everything", f"{name} served {h.reused_after_warmup:.0%} of the calls after the first "
                       f"computed one entirely from the cache (plain reuse, no forecast): the image is mostly frozen "
                       f"from one step and its quality suffers. {fix} (or ask for quality='psnr>=30').")
        elif flop_ratio is not None and flop_ratio > COSTLY and not h.calibrating:  # something served (above)
            self._once("costly", f"{name} computed {flop_ratio:.3f}x the block FLOPs of an uncached generation "
                       f"while serving {h.reuse_fraction:.0%} of its units from the cache: what it runs to decide "
                       f"(probe blocks; with per-sample decisions, the default, each row of a batch decides alone "
                       f"at batch 1) costs more than it skips, so it is slower than no cache. Raise {turn} to reuse "
                       f"more, or, for a batch whose samples move together, decide once per call: "
                       f"dcache.apply(pipe, {self.method!r}, decisions='batch').")
        if h.missing_branches:
            self._once("branches", f"{name}: the last generation had no {h.missing_branches} calls that earlier "
                       f"generations of this handle had (guidance switched off, or the pipeline stopped naming its "
                       f"CFG branches with cache_context): its decisions are made without them.")
        if h.non_finite_units:
            shown = ", ".join(h.non_finite_units[:4]) + (" ..." if len(h.non_finite_units) > 4 else "")
            self._once("non_finite", f"{name}: cached tensors hold NaN or infinity at the end of the generation "
                       f"({shown}); the outputs served from them are not finite. Check the model in this dtype "
                       f"without dcache, or use a wider cache_dtype (None keeps the compute dtype).")

    def served_non_finite(self, unit: str, step: int) -> None:
        """A call was to serve `unit` ("branch/unit") from a cached value (or its forecast) holding NaN or infinity,
        and computed it instead (dcache.runtime.decision): kept in the generation's Health and warned once per
        handle."""
        if unit not in self._non_finite_served:
            self._non_finite_served.append(unit)
        if self.warn and not getattr(_QUIET, "depth", 0):
            knob = self.knob()
            name = f"dcache[{self.method}]" if self.method else "dcache"
            forecast = f"a forecast that diverges: lower its `{knob}`" if knob else "a forecast that diverges"
            self._once("non_finite_served", f"{name}: the cached value of {unit} held NaN or infinity when step "
                       f"{step} was to serve it, so that call computed it instead (and will wherever it happens "
                       f"again; handle.stats().health.non_finite_served lists the units). Causes: the model "
                       f"overflows in this dtype (check it without dcache), a low-precision cache (use a wider "
                       f"cache_dtype, or None to keep the compute dtype), or {forecast}.")

    def note(self, kind: str, message: str) -> None:
        """A method's own fact about the running generation (e.g. cfg_difference fell back): kept in the
        generation's Health.notes and warned once per handle and kind, like the checks above."""
        if kind not in self._notes:
            self._notes.append(kind)
        if self.warn and not getattr(_QUIET, "depth", 0):
            self._once(kind, message)

    def _once(self, kind: str, message: str) -> None:
        warn_once(self._warned, kind, message, stacklevel=4)


def warn_once(said: set[str], kind: str, message: str, stacklevel: int = 2) -> None:
    """`message` as a DCacheHealthWarning unless `kind` is already in `said` (then added) or this thread is inside
    quiet(): one warning per owner of `said` and kind (a handle's monitor, a forecaster)."""
    if kind in said or getattr(_QUIET, "depth", 0):
        return
    said.add(kind)
    warnings.warn(message, DCacheHealthWarning, stacklevel=stacklevel + 1)


__all__ = ["DCacheHealthWarning", "Health", "HealthMonitor", "quiet", "warn_once"]
