"""The fixed cadence that FORA, TaylorSeer, fixed-interval and Δ-DiT share: which steps compute.

    warm-up steps 0 .. W-1 compute; after them every N-th step computes (the first right after the warm-up, or step
    0 when W = 0); the last `cutoff_steps` steps of a generation of known length compute too.

With W = 3, N = 4 over 12 steps: 0, 1, 2, 6, 10 compute (one full step, then N - 1 served from the cache).
`CadenceSchedule` is the schedule of a method that decides by this cadence alone.
"""

from __future__ import annotations

from dcache import Action, CallContext, MethodSchedule


def full_step(step: int, warmup_steps: int, interval: int) -> bool:
    """True where a fixed-interval schedule computes: the warm-up, then every `interval`-th step after it."""
    return step < warmup_steps or (step - max(warmup_steps, 1) + 1) % interval == 0


def cadence_computes(ctx: CallContext, warmup_steps: int, interval: int, cutoff_steps: int) -> bool:
    """`full_step` at the call's step, or one of the generation's last `cutoff_steps` steps."""
    n = ctx.num_steps
    return full_step(ctx.step, warmup_steps, interval) or (n is not None and ctx.step >= n - cutoff_steps)


class CadenceSchedule(MethodSchedule):
    """A method schedule that decides by the cadence of its config's `warmup_steps`, `interval` and `cutoff_steps`
    knobs alone: COMPUTE where `cadence_computes`, else the served action (REUSE, or FORECAST where it forecasts)."""

    signals = frozenset()

    def decide(self, ctx: CallContext) -> Action:
        c = self.config
        return Action.COMPUTE if cadence_computes(ctx, c.warmup_steps, c.interval, c.cutoff_steps) else self.served
