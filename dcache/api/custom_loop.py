"""Denoising loops that are not diffusers pipelines: explicit request, step and branch signals.

A serving engine (SGLang, vLLM-Omni, xDiT, ...) runs diffusers' transformer classes in a loop of its own, with no
diffusers scheduler for dcache to hook. Without signals dcache infers the step from the transformer's `timestep`
argument (a new value: the next step; a value back at the start: a new request), which reads the timestep on the
host every call and needs the step count fixed at `apply`. `handle.loop()` says it instead:

    handle = dcache.apply(transformer, "teacache")
    with handle.loop(num_steps=len(timesteps)) as loop:    # one request (or one batch of requests): a new generation
        for i, t in enumerate(timesteps):
            loop.step(i)                                    # step i begins; steps come 0, 1, 2, ... in order
            with loop.branch("cond"):                       # split CFG: one branch per call, any names
                v_cond = transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond, ...)[0]
            with loop.branch("uncond"):
                v_uncond = transformer(hidden_states=x, timestep=t, encoder_hidden_states=uncond, ...)[0]
            x = x + (sigmas[i + 1] - sigmas[i]) * (v_uncond + g * (v_cond - v_uncond))

Batched CFG (one call on [uncond; cond]) needs no branch: the call is its step's one branch. The block's end ends the
generation (the schedule is told whether every step ran; caches are freed). Inside a loop no timestep is read on the
host and the calls of a step are placed by the loop alone, so timesteps that repeat, that go up, or that differ per
sample all work. Each loop may have its own step count. One loop at a time per handle: a second loop (or a pipeline
call) on the same transformer takes the generation over, and the first loop's next step is refused, as for two
pipelines (dcache.runtime.concurrency).

With per-sample decisions (the default, dcache.runtime.lanes) every row of the loop's batch is at the loop's step and
decides on its own; requests at different steps share a batch without a loop (`handle.requests`, docs/serving.md). Not
with methods that act on the sampler's update (`acts_on_steps`: they rewrite x_{i+1} inside a diffusers scheduler's
`step`, which a custom loop does not call).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # a handle opens the loop over its engines
    from ..runtime.engine import Engine


class DenoisingLoop:
    """One generation of a custom loop (`handle.loop(num_steps)`): `step(i)` before step i's calls, `branch(name)`
    around each call of a split-CFG step. Use it as a context manager."""

    def __init__(self, engines: tuple[Engine, ...], num_steps: int, timesteps: Any = None):
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"handle.loop(num_steps={num_steps!r}): num_steps is the loop's number of denoising "
                             f"steps, a positive int (e.g. len(timesteps)).")
        self.engines = engines  # the handle's engine first, then its followers (a second expert)
        self.num_steps = num_steps
        self.timesteps = None if timesteps is None else tuple(float(t) for t in timesteps)
        if self.timesteps is not None and len(self.timesteps) != num_steps:
            raise ValueError(f"handle.loop(num_steps={num_steps}, timesteps=...) got {len(self.timesteps)} "
                             f"timesteps; pass one per step, or leave timesteps out.")
        self.record = None  # the generation record this loop opened (None until the block is entered)

    # -- the generation ------------------------------------------------------------------------------------------
    def __enter__(self) -> "DenoisingLoop":
        if self.record is not None:
            raise RuntimeError("a DenoisingLoop runs one generation; call handle.loop() again for the next one.")
        lead = self.engines[0]
        for engine in self.engines:
            if engine.schedule.acts_on_steps:
                raise ValueError(f"method {engine.schedule.name!r} acts on the sampler's update (it rewrites x_(i+1) "
                                 f"inside a diffusers scheduler's step), which a custom loop does not call; use it "
                                 f"through a diffusers pipeline, or a method that only caches transformer outputs.")
        with lead.guard.lock:
            for engine in self.engines:
                engine.open_generation(self.timesteps, self.num_steps)
            self.record = lead.tracker.record
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        lead = self.engines[0]
        with lead.guard.lock:
            if lead.tracker.record is not self.record:
                return False  # taken over by another loop or pipeline: that generation is not this loop's to end
            for engine in self.engines:
                rec = engine.tracker.record
                if exc_type is None and rec is not None and not rec.finished and rec.step == self.num_steps - 1:
                    engine.tracker.on_scheduler_step()  # the last step ran: the schedule hears a complete count
                engine.finish_generation()
        return False

    # -- steps and branches --------------------------------------------------------------------------------------
    def step(self, index: int) -> None:
        """Step `index` begins: 0 first, then each step once, in order (calling it again for the current step is a
        no-op)."""
        rec = self._open()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_steps:
            raise ValueError(f"loop.step({index!r}): a step index is an int in [0, {self.num_steps}) for this loop "
                             f"of num_steps={self.num_steps}.")
        if index == rec.step:
            return
        if index != rec.step + 1:
            raise ValueError(f"loop.step({index}) after step {rec.step}: steps begin in order, one at a time "
                             f"(0, 1, 2, ...); call loop.step(i) once at the top of each step i.")
        lead = self.engines[0]
        with lead.guard.lock:
            lead.guard.check_not_taken()
            lead.guard.refuse_foreign(rec, "a loop step")
            for engine in self.engines:
                engine.tracker.on_scheduler_step()

    @contextlib.contextmanager
    def branch(self, name: str) -> Iterator[None]:
        """The transformer calls inside belong to branch `name` of the current step (e.g. "cond" / "uncond"): each
        branch keeps its own cache. A step whose one call covers every branch (batched CFG) needs none."""
        self._open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"loop.branch({name!r}): a branch is named by a non-empty string, e.g. 'cond'.")
        trackers = [engine.tracker for engine in self.engines]
        before = [tracker.context_name for tracker in trackers]
        for tracker in trackers:
            tracker.context_name = name
        try:
            yield
        finally:
            for tracker, name_before in zip(trackers, before):
                tracker.context_name = name_before

    def _open(self):
        if self.record is None:
            raise RuntimeError("use the loop as a context manager: `with handle.loop(num_steps=N) as loop:`, then "
                               "loop.step(i) / loop.branch(name) inside the block.")
        if self.record.finished or self.engines[0].tracker.record is not self.record:
            raise RuntimeError("this loop's generation has ended (its block was left, or another loop or pipeline "
                               "call took the transformer over); open a new `handle.loop()`.")
        return self.record
