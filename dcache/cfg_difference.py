"""Forecasting the CFG difference: the unconditional branch served as the conditional one minus a forecast of
D = v_c - v_u, in call scope with split CFG (a schedule sets `cfg_difference = True`).

Why. The pipeline combines the branches as v = v_u + g (v_c - v_u) = g v_c - (g - 1) v_u, so errors e_c, e_u of the
two branches' cached outputs reach the sample as g e_c - (g - 1) e_u. Forecast from the same computed steps, the two
errors are correlated and mostly cancel; when the branches compute on different steps (an unconditional branch
with one keyframe fewer, the only way to reach odd call budgets) they stop cancelling, and at guidance 3 the
difference is amplified by 3 and 2. Serving the unconditional call at step i as

    Delta_u(i) = Delta_c(i) - D^(i)          Delta = v - x (call scope's cached quantity; both branches see one x)

with Delta_c(i) what the conditional branch produced at step i (computed, reused or forecast) and D^ the Taylor
forecast (the schedule's order) of D over the steps where *both* branches computed, gives the sample the error
g e_c - (g - 1)(e_c - e_D) = e_c + (g - 1) e_D: the conditional error enters once, and D, the guidance direction,
varies slowly over the steps.

Where it applies: the branches named "cond" and "uncond" (diffusers' cache_context names; the conditional call
runs first in every step). An unconditional call that is not computed uses the difference when the conditional
branch ran at the same step and D has a history; otherwise (e.g. the first steps) it falls back to its own cache.
Computed calls are untouched, so all-compute stays bit-identical. Memory: one D history ((order + 1) latent-sized
tensors) in the unconditional branch, and a reference to the conditional Delta of the running step.
"""

from __future__ import annotations

from typing import Any

import torch

from .state import BranchState, UnitHistory

REFERENCE, COUPLED = "cond", "uncond"


class CfgDifference:
    def __init__(self, engine: Any):
        self.engine = engine

    @staticmethod
    def couples(branch: str) -> bool:
        """Whether a branch's Delta is needed: the reference (cond) and the coupled (uncond) one."""
        return branch in (REFERENCE, COUPLED)

    def served(self, call: Any, forecast: bool) -> torch.Tensor | None:
        """Delta_c(i) - D^(i) for an unconditional call that is not computed, or None (serve its own cache)."""
        if call.branch != COUPLED:
            return None
        reference = self._reference(call.step)
        history = call.bstate.cfg_difference
        if reference is None or history is None or history.tables is None or not history.matches([reference[1]]):
            return None
        return reference[1] - history.read(forecast, call.step)[0]

    def note(self, call: Any, delta: torch.Tensor, computed: bool) -> None:
        """After a call's Delta is known: the conditional branch's becomes the step's reference; a computed
        unconditional call at a step where the conditional one computed adds D = Delta_c - Delta_u to the history."""
        bstate: BranchState = call.bstate
        if call.branch == REFERENCE:
            bstate.cfg_reference = (call.step, delta, computed)
            return
        if call.branch != COUPLED or not computed:
            return
        reference = self._reference(call.step)
        if reference is None or not reference[2] or reference[1].shape != delta.shape:
            return
        if bstate.cfg_difference is None:
            bstate.cfg_difference = UnitHistory(self.engine.order)
        bstate.cfg_difference.update([reference[1] - delta], call.step)

    def _reference(self, step: int) -> tuple | None:
        """The conditional branch's (step, Delta, computed) if it ran at `step`, else None."""
        ref_state = self.engine.branches.get(REFERENCE)
        ref = ref_state.cfg_reference if ref_state is not None else None
        return ref if ref is not None and ref[0] == step else None


__all__ = ["CfgDifference", "REFERENCE", "COUPLED"]
