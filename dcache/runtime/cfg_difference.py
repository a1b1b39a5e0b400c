"""Forecasting the CFG difference: the unconditional branch served as the conditional one minus a forecast of
D = v_c - v_u, in call scope with split CFG (a schedule sets `cfg_difference = True`).

Why. The pipeline combines the branches as v = v_u + g (v_c - v_u) = g v_c - (g - 1) v_u, so errors e_c, e_u of the
two branches' cached outputs reach the sample as g e_c - (g - 1) e_u. Forecast from the same computed steps, the two
errors are correlated and mostly cancel; when the branches compute on different steps (an unconditional branch
with one keyframe fewer, the only way to reach odd call budgets) they stop cancelling, and at guidance 3 the
difference is amplified by 3 and 2. Serving the unconditional call at step i as

    Delta_u(i) = Delta_c(i) - D^(i)          Delta = v - x (call scope's cached quantity; both branches see one x)

with Delta_c(i) what the conditional branch produced at step i (computed, reused or forecast) and D^ the Taylor
forecast (the schedule's order) of D over the steps where *both* branches computed (or, with an L2P forecaster
whose table has `difference_weights`, its learned weights for D), gives the sample the error
g e_c - (g - 1)(e_c - e_D) = e_c + (g - 1) e_D: the conditional error enters once, and D, the guidance direction,
varies slowly over the steps.

Where it applies: the branches named "cond" and "uncond" (diffusers' cache_context names; the conditional call
runs first in every step). An unconditional call that is not computed uses the difference when the conditional
branch ran at the same step and D has a history; otherwise (e.g. the first steps) it falls back to its own cache.
Computed calls are untouched, so all-compute stays bit-identical. Memory: one D history ((order + 1) latent-sized
tensors) in the unconditional branch, and a reference to the conditional Delta of the running step.

Checked against the branches' own caches. Whether D is smoother than the branches themselves depends on the model
and the guidance: on a model it was not tuned on, a sparse keyframe placement forecasts D over gaps where it is
not, and the difference then costs 7 dB where the branches' own forecasts cancel. So the difference is served only
where this generation measured it better. At every step where both branches computed, each path's forecast is
checked against the truth before the caches learn it: with e_c, e_u the own forecasts' errors of the two branches
and e_D the error of D^, the sample errors would have been

    own caches:   g e_c - (g - 1) e_u          difference:   e_c + (g - 1) e_D

(g the pipeline's guidance scale, 3 where it does not say), and where the conditional call computed (e_c = 0)
(g - 1) e_u and (g - 1) e_D. (When both branches computed on the same steps the first pair is equal: the
difference pays only where the unconditional branch has fewer keyframes.) The squared norms of both cases are
summed over the generation;
the unconditional call is served through the difference only while its sum is the smaller one, else from its own
cache, and the handle says once that it fell back. Without such a step (uncond keyframes that are not a subset
of the cond ones) there is no evidence and the difference is not used either; that is said too. A pipeline
without separate "cond" / "uncond" calls (batched CFG, or no guidance) gives the difference nothing to act on;
that is said once too.

What the check cannot see. It scores the error of the calls the difference serves, and there it has been right
wherever it served (BENCHMARKS.md, "CFG difference: checked against its own baseline": +4 to +13 dB against a twin
that computes those calls). The finished sample can still come out worse: a served call's smaller error can lie
more along the error the earlier cached steps left in the sample than the own cache's larger one does, and that
alignment is measured only against the uncached trajectory, which a run never has. On tiny-motion at guidance 2 it
cost 0.5 dB (computing that call gives 31.3 dB, the own cache 29.8, the difference 29.3); at guidance 4 and 5 the
difference won there. A calibration run has the uncached trajectory: `dcache.apply(..., cfg_difference=True,
calibration_run=run)` runs it with and without the difference and keeps the closer (the target resolver's
choose_cfg_difference), which catches that case.
"""

from __future__ import annotations

import torch

from .call_runtime import CallRuntime
from .call_scope import CALL_UNIT
from .cache_state import BranchState, UnitHistory
from .call_state import CallState
from ..generations.records import GenerationRecord

REFERENCE, COUPLED = "cond", "uncond"


NO_BRANCHES = ("cfg_difference=True has no effect here: the pipeline does not run guidance as separate 'cond' and "
               "'uncond' transformer calls (batched CFG, or no guidance), so there is no unconditional call to serve "
               "through the difference. Use a pipeline with split CFG, or leave cfg_difference off.")

# The guidance scale assumed when the pipeline does not expose one (transformer-only loops): typical CFG.
ASSUMED_GUIDANCE = 3.0


class CfgDifference:
    def __init__(self, runtime: CallRuntime):
        self.runtime = runtime
        self._record: GenerationRecord | None = None  # the generation the scores below belong to
        self._own = self._difference = 0.0  # summed squared sample errors of each path at the checked steps
        self._checks = 0  # steps where both paths were scored
        self._served_unchecked = False  # an uncond call was served from its own cache before any check
        self._coupled_ran = False  # an unconditional call ran in this generation

    @staticmethod
    def couples(branch: str) -> bool:
        """Whether a branch's Delta is needed: the reference (cond) and the coupled (uncond) one."""
        return branch in (REFERENCE, COUPLED)

    def served(self, call: CallState, forecast: bool) -> torch.Tensor | None:
        """Delta_c(i) - D^(i) for an unconditional call that is not computed, or None (serve its own cache)."""
        if call.branch != COUPLED:
            return None
        reference = self._reference(call.step)
        history = call.bstate.cfg_difference
        if reference is None or history is None or history.tables is None or not history.matches([reference[1]]):
            return None
        self._new_generation()
        if self._checks == 0 or self._difference >= self._own:  # no evidence yet, or measured worse: own cache
            self._served_unchecked |= self._checks == 0
            if self._checks:
                self._say("fallback", f"cfg_difference measured worse than the branches' own caches in this "
                          f"generation (squared sample error {self._difference:.3g} vs {self._own:.3g} over "
                          f"{self._checks} step(s) where both branches computed): the unconditional calls are "
                          f"served from their own cache instead. Set cfg_difference=False to skip the check.")
            return None
        return reference[1] - self._forecast(history, forecast, call.step, difference=True)

    def note(self, call: CallState, delta: torch.Tensor, computed: bool) -> None:
        """After a call's Delta is known (before a computed one is cached): the conditional branch's becomes the
        step's reference; a computed unconditional call at a step where the conditional one computed scores both
        paths' forecasts of this step and adds D = Delta_c - Delta_u to the history."""
        bstate: BranchState = call.bstate
        if call.branch not in (REFERENCE, COUPLED):
            self._say("no_branches", NO_BRANCHES)
            return
        self._new_generation()
        steps = getattr(call.record, "num_steps", None) or 0
        last = bool(steps) and call.step >= steps - 1  # the generation's last step
        if call.branch == REFERENCE:
            bstate.cfg_reference = (call.step, delta, computed, self._own_error(call, delta) if computed else None)
            if not self._coupled_ran and last:  # guidance off: "cond" calls only
                self._say("no_branches", NO_BRANCHES)
            return
        self._coupled_ran = True
        if computed:
            self._check(call, bstate, delta)
        if last and self._served_unchecked and not self._checks:
            self._say("unchecked", "cfg_difference found no step after the first where both branches computed, "
                      "so it could not check the difference against the branches' own caches and did not use "
                      "it: give the 'uncond' branch keyframes that are a subset of the 'cond' ones (e.g. the cond "
                      "keyframes minus one, as keyframe-5x does), or set cfg_difference=False.")

    def _check(self, call: CallState, bstate: BranchState, delta: torch.Tensor) -> None:
        """A computed unconditional call: where the conditional call computed at the same step, score both paths'
        forecasts of this step and add D = Delta_c - Delta_u to the difference's history."""
        reference = self._reference(call.step)
        if reference is None or not reference[2] or reference[1].shape != delta.shape:
            return
        if bstate.cfg_difference is None:
            forecaster = getattr(self.runtime.schedule, "forecaster", None)
            depth = forecaster.depth if getattr(forecaster, "difference_weights", None) else 0
            bstate.cfg_difference = UnitHistory(self.runtime.order, depth=depth)  # depth: the values L2P combines
        history = bstate.cfg_difference
        e_c, e_u = reference[3], self._own_error(call, delta)
        if e_c is not None and e_u is not None and history.tables is not None and history.matches([delta]):
            e_d = self._forecast(history, self.runtime.order > 0, call.step, difference=True) - (reference[1] - delta)
            g = self._guidance()
            norm = lambda e: float(e.float().square().sum())
            # the conditional call served too, and the conditional call computed (its error 0)
            self._own += norm(g * e_c - (g - 1) * e_u) + (g - 1) ** 2 * norm(e_u)
            self._difference += norm(e_c + (g - 1) * e_d) + (g - 1) ** 2 * norm(e_d)
            self._checks += 1
        history.update([reference[1] - delta], call.step)

    def _own_error(self, call: CallState, delta: torch.Tensor) -> torch.Tensor | None:
        """What the branch's own cache would have served at this step, minus the computed Delta (None: no cache)."""
        own = call.bstate.units.get(CALL_UNIT)
        if own is None or own.tables is None or not own.matches([delta]):
            return None
        return self._forecast(own, self.runtime.order > 0, call.step) - delta

    def _forecast(self, history: UnitHistory, forecast: bool, step: int, difference: bool = False) -> torch.Tensor:
        """What `history` serves at `step`: the schedule forecaster's table where it has an entry (an L2P table,
        its `difference_weights` for D), else the Taylor table of the schedule's order (reuse at order 0)."""
        lookup = getattr(getattr(self.runtime.schedule, "forecaster", None), "lookup", None)
        if forecast and lookup is not None:
            served = lookup(history.plain(), step, difference=difference)
            if served is not None:
                return served[0]
        return history.read(forecast, step)[0]

    def _guidance(self) -> float:
        g = getattr(self.runtime.pipeline, "guidance_scale", None)
        return float(g) if isinstance(g, (int, float)) and not isinstance(g, bool) and g > 1 else ASSUMED_GUIDANCE

    def _new_generation(self) -> None:
        if self._record is not self.runtime.record:
            self._record = self.runtime.record
            self._own = self._difference = 0.0
            self._checks = 0
            self._served_unchecked = self._coupled_ran = False

    def _say(self, kind: str, message: str) -> None:
        self.runtime.health.note(f"cfg_difference_{kind}", message)

    def _reference(self, step: int) -> tuple | None:
        """The conditional branch's (step, Delta, computed, own-forecast error) if it ran at `step`, else None."""
        ref_state = self.runtime.branches.get(REFERENCE)
        ref = ref_state.cfg_reference if ref_state is not None else None
        return ref if ref is not None and ref[0] == step else None


__all__ = ["CfgDifference", "REFERENCE", "COUPLED"]
