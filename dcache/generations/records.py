"""Generation records: which step and branch each transformer call belongs to, and every decision taken.

Step tracking, in order of preference:
  1. pipeline use: the engine wraps the scheduler *instance*'s `set_timesteps` (a new record starts, the number of
     steps and the timesteps are known) and `step` (the step index advances);
  2. transformer-only use: a call whose timestep differs from the previous call's starts a new step; a timestep
     that goes back up (noisier), a step count that reaches `num_steps`, or a call after one that raised (an
     interrupted generation), starts a new record.
A pipeline object other than the one dcache was applied to, sharing its transformer (`Pipeline(**pipe.components)`
with a new scheduler), is found from the call stack at its first call and its scheduler is tracked instead.
Branch: the diffusers `cache_context` name when the pipeline sets one, else the call's order within its step.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..actions import Signal


@dataclass
class CallRecord:
    step: int
    branch: str
    actions: str  # one character per unit
    signals: dict[str, float] = field(default_factory=dict)  # filled when flushed (one host sync per call at most)
    flops_total: float = 0.0  # what the call's units cost uncached (FlopBook; 0 when counting is off)
    flops_computed: float = 0.0  # what it spent: computed units, and a signal's own compute (the modulated probe)


@dataclass
class GenerationRecord:
    num_steps: int | None
    timesteps: tuple[float, ...] | None
    calls: list[CallRecord] = field(default_factory=list)
    step: int = 0
    calls_in_step: int = 0
    last_timestep: float | None = None
    direction: int | None = None  # +1 / -1 once the timestep has moved (transformer-only tracking)
    finished: bool = False
    aborted: bool = False  # a transformer call raised (Ctrl-C, an error): the generation never completed
    input_shape: tuple[int, ...] | None = None  # hidden states entering the first block, for plans and stats
    owner: tuple[int, str] | None = None  # (ident, name) of the thread that started it (dcache.runtime.concurrency)
    taken_by: tuple[int, str] | None = None  # the thread whose new generation ended this one while it was open
    # when it started (local time, ISO seconds): a plan exported from it records this, so that exporting the same
    # generation twice writes the same file
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def branches(self) -> list[str]:
        seen: dict[str, None] = {}
        for call in self.calls:
            seen.setdefault(call.branch, None)
        return list(seen)


def timestep_value(timestep: Any) -> float | None:
    """A python float that identifies the step of a timestep argument (scalar, per sample or per token).

    Costs one host sync per call; only used in transformer-only mode, where no scheduler tells the step.
    """
    if timestep is None:
        return None
    if isinstance(timestep, (int, float)):
        return float(timestep)
    if isinstance(timestep, torch.Tensor):
        flat = timestep.detach().reshape(-1)
        # Per-sample / per-token timesteps (Wan 2.2 TI2V, diffusion forcing): their mean moves with the step.
        return float(flat.float().mean()) if flat.numel() else None
    return None


class StepTracker:
    """Owns the current generation record and maps each call to (step, branch)."""

    def __init__(self, num_steps: int | None = None):
        self.fixed_num_steps = num_steps
        self.record: GenerationRecord | None = None
        self.records_started = 0
        self.scheduler_driven = False
        self._context = threading.local()  # diffusers' cache_context is per thread (dcache.runtime.concurrency)

    def __deepcopy__(self, memo: dict) -> "StepTracker":
        """Everything copied but the per-thread cache_context (thread-local state cannot be copied; no thread is
        inside a copy's generation)."""
        new = copy.copy(self)
        memo[id(self)] = new
        for key, value in vars(self).items():
            setattr(new, key, threading.local() if key == "_context" else copy.deepcopy(value, memo))
        return new

    @property
    def context_name(self) -> str | None:
        """The `cache_context` name the calling thread set (None: none)."""
        return getattr(self._context, "name", None)

    @context_name.setter
    def context_name(self, name: str | None) -> None:
        self._context.name = name

    # -- pipeline (scheduler) events --------------------------------------------------------------------------
    def on_set_timesteps(self, timesteps: tuple[float, ...] | None, num_steps: int | None = None) -> None:
        """A generation whose steps are signalled; num_steps: a custom loop's own count (dcache.api.custom_loop)."""
        self.scheduler_driven = True
        count = num_steps if num_steps is not None else len(timesteps) if timesteps else self.fixed_num_steps
        self.record = GenerationRecord(num_steps=count, timesteps=timesteps)
        self.records_started += 1

    def on_scheduler_step(self) -> bool:
        """Advance one step; True when the generation just finished."""
        rec = self.record
        if rec is None:
            return False
        rec.step += 1
        rec.calls_in_step = 0
        if rec.num_steps is not None and rec.step >= rec.num_steps:
            rec.finished = True
            return True
        return False

    # -- transformer calls ---------------------------------------------------------------------------------------
    def begin_call(self, timestep: Any) -> tuple[GenerationRecord, bool]:
        """Place a transformer call; returns (record, started_new_record)."""
        rec = self.record
        if not self.scheduler_driven:
            t = timestep_value(timestep)
            move = self._transformer_only_move(t)
            if move == "new":
                if rec is not None and not rec.finished:
                    rec.step += 1  # the step that ended it counts: a full count tells the schedule it completed
                rec = self._new_transformer_only_record()
            elif move == "next":
                rec.direction = 1 if t > rec.last_timestep else -1
                rec.step += 1
                rec.calls_in_step = 0
            rec.last_timestep = t
            return rec, move == "new"
        if rec is None or rec.finished:
            # A call outside set_timesteps/step bookkeeping (e.g. a second pipeline run without set_timesteps).
            rec = self._new_transformer_only_record()
            self.scheduler_driven = False
            rec.last_timestep = timestep_value(timestep)
            return rec, True
        return rec, False

    def starts_generation(self, timestep: Any) -> bool:
        """Whether a call with this timestep would start a new record (read-only: nothing moves)."""
        rec = self.record
        if self.scheduler_driven:
            return rec is None or rec.finished
        return self._transformer_only_move(timestep_value(timestep)) == "new"

    def _transformer_only_move(self, t: float | None) -> str:
        """'new' (a new record), 'next' (the next step of the open record) or 'same' (the same step)."""
        rec = self.record
        if rec is None or rec.finished:
            return "new"
        if t is None or rec.last_timestep is None or t == rec.last_timestep:
            return "same"
        # Time runs one way within a generation (down for most models, up for Lumina-style ones): a move against the
        # established direction, or a full count of steps, starts the next generation.
        direction = 1 if t > rec.last_timestep else -1
        turned = rec.direction is not None and direction != rec.direction
        if turned or (rec.num_steps is not None and rec.step + 1 >= rec.num_steps):
            return "new"
        return "next"

    def abort(self) -> None:
        """A transformer call raised (Ctrl-C, an error): its generation is over. In transformer-only use the next
        call then starts a new record: its timestep may equal the interrupted call's (an interrupt during step 0),
        which would otherwise continue the interrupted step as a third branch. A pipeline starts its next
        generation with set_timesteps anyway (and a call that raised may be retried by its caller)."""
        if self.record is not None and not self.scheduler_driven:
            self.record.finished = True

    def in_generation(self) -> bool:
        """A generation is open (started and not finished)."""
        return self.record is not None and not self.record.finished

    def branch_name(self, rec: GenerationRecord) -> str:
        name = self.context_name if self.context_name is not None else f"call{rec.calls_in_step}"
        rec.calls_in_step += 1
        return name

    def _new_transformer_only_record(self) -> GenerationRecord:
        self.record = GenerationRecord(num_steps=self.fixed_num_steps, timesteps=None)
        self.records_started += 1
        return self.record


__all__ = ["CallRecord", "GenerationRecord", "StepTracker", "timestep_value", "Signal"]
