"""FlowCache (arXiv 2602.10825): an independent cache policy per chunk for chunked /
diffusion-forcing video generation (SkyReels-V2 DF, MAGI-1), where the chunks of one call sit at different
denoising stages.

    handle = dcache.apply(pipe.transformer, "flowcache", threshold=0.1)
    tap = attach_chunk_signals(handle, frames_per_chunk=causal_block_size)   # per-chunk signals (hooks)
    video = pipe(...)
    tap.remove(); handle.remove()

Policy (per branch b and chunk c, state reset with every generation; dcache's formulation of "each chunk
accumulates the relative change of its own input and output", EasyCache-style):
    at a call where chunk c is active (its timestep changed since the previous call of b):
        eps[b, c] += k[b, c] * mean|x_c - x_c,prev| / mean|v_c,last|        (input change, rescaled to the output)
        chunk c votes REUSE if k[b, c] is known and eps[b, c] < threshold, else COMPUTE
    at a computed call, for every chunk: eps[b, c] = 0 and
        k[b, c] = mean|v_c - v_c,prev compute| / mean|x_c - x_c,prev compute|      (output / input change ratio)
x_c are the chunk's tokens entering the first block, v_c leaving the last block; inactive chunks (not started, or
finished) neither accumulate nor vote. The first `warmup_calls` calls of a branch always compute.

What the engine can execute: a transformer call is computed or reused *as a whole* (STACK granularity): chunks
attend to each other inside one call, so reusing one chunk while computing another needs token-range execution
plus cached K/V of the reused chunks (FlowCache's KV-cache, not in the engine). So the call is REUSED only when every
active chunk votes REUSE; on every computed call all chunks are refreshed. The per-chunk votes are recorded: the
`plan_extras()["flowcache"]["chunk_reuse_ratio"]` is the share of active chunk-calls the per-chunk policy would
skip with token-range execution, next to the whole-call reuse actually achieved.

Signals: `attach_chunk_signals` (profiling helpers; forward hooks, one host sync per call) measures the per-chunk
statistics; without it the schedule runs the same policy on one chunk (the whole call) from the engine's
INPUT_DELTA / OUTPUT_DELTA / INPUT_DELTA_COMPUTED / OUTPUT_MEAN signals, i.e. EasyCache on the stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, Schedule, Signal, knob
from dcache import register_method

ENGINE_GAP = (
    "FlowCache needs (1) token-range units: COMPUTE for some chunks' tokens and REUSE for others within one call, "
    "with the K/V of reused chunks cached for the computed chunks' attention; (2) per-token-range signals (relL1 / "
    "mean|delta| of a chunk's tokens) from the engine; (3) step tracking for pipelines that deep-copy their "
    "scheduler per frame (SkyReelsV2DiffusionForcingPipeline: the copies' set_timesteps/step run the original "
    "scheduler's bound methods through the engine's instance wrappers), so today FlowCache is applied to the "
    "transformer (dcache.apply(pipe.transformer, ...)), where steps are tracked from the timestep argument.")


@register_method
@dataclass(frozen=True)
class FlowCacheConfig(MethodConfig):
    """FlowCache: an independent cache policy per chunk for chunked (diffusion-forcing) video generation.

    Paper: "FlowCache", https://arxiv.org/abs/2602.10825.

    Use it on chunked video pipelines (SkyReels-V2 DF, MAGI-1) whose chunks sit at different noise levels; on other
    models it behaves as one chunk.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "flowcache") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "flowcache"
    threshold: float = knob(0.1, low=0.0, high=100.0, doc="per-chunk accumulated estimated relative output change "
                                                           "below which the chunk votes to reuse")
    warmup_calls: int = knob(2, low=2, high=100_000, doc="first calls of each branch always computed (>= 2: the "
                                                          "output/input ratio k needs two computes)")
    max_consecutive: int = knob(3, low=1, high=100_000, doc="most consecutive reused calls of a branch")

    def check(self) -> None:
        from .tuning.profiling import check_finite

        check_finite(self)

    def build(self, model: nn.Module) -> Schedule:
        return FlowCacheSchedule(self)


@dataclass
class ChunkState:
    eps: float = 0.0  # accumulated estimated relative output change since the last compute
    k: float | None = None  # output change / input change between the last two computes
    out_mean: float | None = None  # mean|v| at the last compute
    active_calls: int = 0
    votes_reuse: int = 0


@dataclass
class ChunkObservation:
    """What the signal tap measured for one chunk at one call (before the decision)."""

    input_delta: float | None  # mean|x_c - x_c,prev call|
    active: bool


class FlowCachePolicy:
    """The per-(branch, chunk) state machine; pure numbers."""

    def __init__(self, config: FlowCacheConfig):
        self.config = config
        self.chunks: dict[tuple[str, Any], ChunkState] = {}
        self.calls: dict[str, int] = {}
        self.run: dict[str, int] = {}

    def reset(self) -> None:
        self.chunks, self.calls, self.run = {}, {}, {}

    def decide(self, branch: str, observed: dict[Any, ChunkObservation]) -> tuple[bool, dict[Any, bool]]:
        """(reuse the whole call?, per-chunk votes) for this call of `branch`."""
        n = self.calls.get(branch, 0)
        self.calls[branch] = n + 1
        votes: dict[Any, bool] = {}
        for chunk, obs in observed.items():
            st = self.chunks.setdefault((branch, chunk), ChunkState())
            if not obs.active:
                continue
            st.active_calls += 1
            if n < self.config.warmup_calls or st.k is None or not st.out_mean or obs.input_delta is None:
                votes[chunk] = False
                continue
            st.eps += st.k * obs.input_delta / st.out_mean
            votes[chunk] = st.eps < self.config.threshold
            st.votes_reuse += votes[chunk]
        reuse = (n >= self.config.warmup_calls and bool(votes) and all(votes.values())
                 and self.run.get(branch, 0) < self.config.max_consecutive)
        self.run[branch] = self.run.get(branch, 0) + 1 if reuse else 0
        if not reuse:
            for chunk in observed:
                self.chunks.setdefault((branch, chunk), ChunkState()).eps = 0.0
        return reuse, votes

    def computed(self, branch: str, chunk: Any, k: float | None, out_mean: float | None) -> None:
        """After a computed call: the chunk's refreshed output statistics."""
        st = self.chunks.setdefault((branch, chunk), ChunkState())
        st.eps = 0.0
        if k is not None and math.isfinite(k):
            st.k = k
        if out_mean is not None:
            st.out_mean = out_mean

    def chunk_reuse_ratio(self) -> float:
        active = sum(s.active_calls for s in self.chunks.values())
        return sum(s.votes_reuse for s in self.chunks.values()) / active if active else 0.0


class FlowCacheSchedule(Schedule):
    granularity = Granularity.STACK
    signals = frozenset({Signal.INPUT_DELTA, Signal.OUTPUT_DELTA, Signal.INPUT_DELTA_COMPUTED, Signal.OUTPUT_MEAN})

    def __init__(self, config: FlowCacheConfig):
        self.config = config
        self.name = config.method
        self.policy = FlowCachePolicy(config)
        self._pending: dict[str, dict[Any, ChunkObservation]] = {}  # set by the chunk tap before each decision
        self.chunked = False  # True once a chunk tap feeds observations
        self.calls_reused = 0
        self.calls_total = 0
        self._history: list[float] = []  # chunk_reuse_ratio of finished generations

    # -- chunk tap interface (numbers only) ---------------------------------------------------------------------
    def observe(self, branch: str, observed: dict[Any, ChunkObservation]) -> None:
        self.chunked = True
        self._pending[branch] = observed

    def observe_compute(self, branch: str, per_chunk: dict[Any, tuple[float | None, float | None]]) -> None:
        for chunk, (k, out_mean) in per_chunk.items():
            self.policy.computed(branch, chunk, k, out_mean)

    # -- Schedule ---------------------------------------------------------------------------------------------
    def reset(self, generation: GenerationInfo) -> None:
        if self.policy.chunks:
            self._history.append(self.policy.chunk_reuse_ratio())
        self.policy.reset()
        self._pending = {}

    def decide(self, ctx: CallContext) -> Action:
        observed = self._pending.pop(ctx.branch, None)
        if observed is None:
            observed = {"all": ChunkObservation(ctx.signals.get(Signal.INPUT_DELTA), True)}
            self._engine_feedback(ctx)
        reuse, _ = self.policy.decide(ctx.branch, observed)
        self.calls_total += 1
        self.calls_reused += reuse
        return Action.REUSE if reuse else Action.COMPUTE

    def _engine_feedback(self, ctx: CallContext) -> None:
        """Single-chunk mode: the post signals of the last computed call of this branch (delivered now)."""
        s = ctx.signals
        out_mean = s.get(Signal.OUTPUT_MEAN)
        d_out, d_in = s.get(Signal.OUTPUT_DELTA), s.get(Signal.INPUT_DELTA_COMPUTED)
        k = d_out / d_in if d_out is not None and d_in else None
        st = self.policy.chunks.get((ctx.branch, "all"))
        if out_mean is not None and (st is None or st.eps == 0.0):
            self.policy.computed(ctx.branch, "all", k, out_mean)

    def plan_extras(self) -> dict:
        ratios = self._history + ([self.policy.chunk_reuse_ratio()] if self.policy.chunks else [])
        return {"flowcache": {"chunk_reuse_ratio": ratios[-1] if ratios else 0.0,
                              "call_reuse_ratio": self.calls_reused / self.calls_total if self.calls_total else 0.0,
                              "chunked": self.chunked, "engine_gap": ENGINE_GAP}}

    def config_dict(self) -> dict:
        return self.config.to_dict()


def attach_chunk_signals(handle: Any, frames_per_chunk: int):
    """Per-chunk signals for a FlowCache handle (forward hooks); returns an object with `.remove()`."""
    from .tuning.profiling import ChunkSignalTap

    schedule = handle.engine.schedule
    if not isinstance(schedule, FlowCacheSchedule):
        raise TypeError(f"attach_chunk_signals needs a FlowCache handle, got {type(schedule).__name__}.")
    return ChunkSignalTap(handle.engine, schedule, frames_per_chunk)


__all__ = ["FlowCacheConfig", "FlowCacheSchedule", "FlowCachePolicy", "ChunkObservation", "attach_chunk_signals",
           "ENGINE_GAP"]
