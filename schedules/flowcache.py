"""FlowCache (arXiv 2602.10825): an independent cache policy per chunk for chunked /
diffusion-forcing video generation (SkyReels-V2 DF, MAGI-1), where the chunks of one call sit at different
denoising stages.

    handle = dcache.apply(pipe.transformer, "flowcache", threshold=0.1, frames_per_chunk=causal_block_size)
    video = pipe(...)
    handle.remove()

Policy (per branch b and chunk c, state reset with every generation; dcache's formulation of "each chunk
accumulates the relative change of its own input and output", EasyCache-style):
    at a call where chunk c is active (its timestep changed since the previous call of b):
        eps[b, c] += k[b, c] * mean|x_c - x_c,prev| / mean|v_c,last|        (input change, rescaled to the output)
        chunk c votes REUSE if k[b, c] is known and eps[b, c] < threshold, else COMPUTE
    at a computed call, for every chunk: eps[b, c] = 0 and
        k[b, c] = mean|v_c - v_c,prev compute| / mean|x_c - x_c,prev compute|      (output / input change ratio)
x_c are the chunk's tokens entering the first block, v_c leaving the last block; inactive chunks (not started, or
finished) neither accumulate nor vote. The first `warmup_calls` calls of a branch always compute.

What the engine executes: a transformer call is computed or reused *as a whole* (STACK granularity). Chunks attend
to each other inside one call, so reusing one chunk while computing another would need token-range execution plus
cached K/V of the reused chunks (FlowCache's KV cache), which dcache does not do. So the call is REUSED only when
every active chunk votes REUSE; on every computed call all chunks are refreshed. The per-chunk votes are recorded:
`plan_extras()["flowcache"]["chunk_reuse_ratio"]` is the share of active chunk-calls the per-chunk policy would skip
with token-range execution, next to the whole-call reuse actually achieved (`call_reuse_ratio`).

Signals: with `frames_per_chunk > 0` the engine measures the per-chunk statistics through two signal providers of
this file (dcache.runtime.signal_providers): `flowcache_chunk_input` at the stack input before the decision (per chunk
mean|x_c - x_c,prev call| and active) and `flowcache_chunk_computed` after every computed call (per chunk the output
and input changes since the previous compute, and mean|v_c|), one vector each in the call's single host transfer.
Chunks are frame ranges of the frame-major tokens: frames = the latent's frames after temporal patching (the
transformer's `patch_size[0]`), per-frame timesteps from a 2-D `timestep` argument [B, F] (diffusion forcing). With
`frames_per_chunk = 0` (the default) the schedule runs the same policy on one chunk (the whole call) from the
engine's INPUT_DELTA / OUTPUT_DELTA / INPUT_DELTA_COMPUTED / OUTPUT_MEAN signals, i.e. EasyCache on the stack.

Diffusion-forcing pipelines (SkyReelsV2DiffusionForcingPipeline) deep-copy their scheduler per frame, so apply
FlowCache to the transformer (`dcache.apply(pipe.transformer, ...)`): steps are then tracked from the timestep
argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, Signal
from dcache import knob, register_method
from dcache.runtime.parallel import token_group
from dcache.runtime.signal_providers import ProviderView, SignalProvider, register_signal

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
    frames_per_chunk: int = knob(0, low=0, high=100_000, doc="latent frames per chunk (after temporal patching; "
                                                              "e.g. the pipeline's causal_block_size); 0: the whole "
                                                              "call is one chunk")

    def build(self, model: nn.Module) -> Schedule:
        if self.frames_per_chunk and token_group(model) is not None:
            raise ValueError("FlowCache's frames_per_chunk measures chunks as frame ranges of the whole token "
                             "sequence, but this transformer runs context parallel (each rank holds a shard of the "
                             "tokens). Use frames_per_chunk=0 (one chunk: the whole call, signals synced across "
                             "ranks), or apply FlowCache without context parallelism.")
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
    """What was measured for one chunk at one call (before the decision)."""

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


class FlowCacheSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset({Signal.INPUT_DELTA, Signal.OUTPUT_DELTA, Signal.INPUT_DELTA_COMPUTED, Signal.OUTPUT_MEAN})

    def __init__(self, config: FlowCacheConfig):
        super().__init__(config)
        self.policy = FlowCachePolicy(config)
        self.chunked = config.frames_per_chunk > 0
        if self.chunked:  # the per-chunk providers instead of the whole-call signals
            self.signals = frozenset({CHUNK_INPUT, CHUNK_COMPUTED})
        self._fed: dict[str, int | None] = {}  # branch -> the computed step whose chunk statistics were applied
        self.calls_reused = 0
        self.calls_total = 0
        self._history: list[float] = []  # chunk_reuse_ratio of finished generations

    def reset(self, generation: GenerationInfo) -> None:
        if self.policy.chunks:
            self._history.append(self.policy.chunk_reuse_ratio())
        self.policy.reset()
        self._fed = {}

    def decide(self, ctx: CallContext) -> Action:
        if self.chunked:
            observed = self._chunk_feedback(ctx)
        else:
            observed = {"all": ChunkObservation(ctx.signals.get(Signal.INPUT_DELTA), True)}
            self._engine_feedback(ctx)
        reuse, _ = self.policy.decide(ctx.branch, observed)
        self.calls_total += 1
        self.calls_reused += reuse
        return Action.REUSE if reuse else Action.COMPUTE

    def _chunk_feedback(self, ctx: CallContext) -> dict[Any, ChunkObservation]:
        """Chunk mode: the last computed call's per-chunk statistics (once per computed call: they stay in the
        signals until the next compute), then this call's per-chunk observations."""
        computed = ctx.signals.get(CHUNK_COMPUTED)
        if computed is not None and self._fed.get(ctx.branch) != ctx.last_compute_step:
            self._fed[ctx.branch] = ctx.last_compute_step
            n = len(computed) // 3  # [output changes, input changes, output means]
            for chunk in range(n):
                d_out, d_in = computed[chunk], computed[n + chunk]
                k = d_out / d_in if not math.isnan(d_in) and d_in > 0 else None
                self.policy.computed(ctx.branch, chunk, k, computed[2 * n + chunk])
        observed = ctx.signals.get(CHUNK_INPUT)
        if observed is None:  # no stack input seen (never in blocks scope): one active chunk, no change known
            return {0: ChunkObservation(None, True)}
        n = len(observed) // 2
        return {chunk: ChunkObservation(None if math.isnan(observed[chunk]) else observed[chunk],
                                        observed[n + chunk] > 0.5) for chunk in range(n)}

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
                              "chunked": self.chunked}}


# ----------------------------------------------------------------------------------------------------------------
# Per-chunk signals: two providers the engine measures (dcache.runtime.signal_providers)
# ----------------------------------------------------------------------------------------------------------------

def _temporal_patch(view: ProviderView) -> int:
    patch = getattr(getattr(view.model, "config", None), "patch_size", None)
    return patch[0] if isinstance(patch, (tuple, list)) else 1


def _chunk_slices(view: ProviderView, tokens: int) -> list[slice]:
    """Token slices of the chunks of `tokens` frame-major tokens ([B, L, D]): frames_per_chunk latent frames each,
    frames = the latent's frames after temporal patching."""
    fpc = view.schedule.config.frames_per_chunk
    hidden = view.arguments.get("hidden_states")
    frames = hidden.shape[2] // _temporal_patch(view) if isinstance(hidden, torch.Tensor) and hidden.ndim == 5 else 0
    frames = frames or 1
    per_token = tokens // frames
    return [slice(c * fpc * per_token, min(frames, (c + 1) * fpc) * per_token) for c in range(math.ceil(frames / fpc))]


def _chunk_timesteps(view: ProviderView, n: int) -> list[float] | None:
    """Each of the n chunks' timestep (its first frame's; one host read of the timestep argument), None: unknown."""
    fpc, timestep = view.schedule.config.frames_per_chunk, view.arguments.get("timestep")
    if isinstance(timestep, torch.Tensor) and timestep.ndim == 2:  # diffusion forcing: [B, F] per frame
        per_frame = [float(t) for t in timestep[0, ::_temporal_patch(view)].tolist()]
    elif isinstance(timestep, torch.Tensor) and timestep.numel():
        per_frame = [float(timestep.reshape(-1)[0])]
    else:
        return None
    if len(per_frame) == 1:
        return per_frame * n
    return [per_frame[min(c * fpc, len(per_frame) - 1)] for c in range(n)]


def _measure_chunk_input(view: ProviderView) -> torch.Tensor | None:
    """[2n]: per chunk mean|x_c - x_c,prev call| (NaN on the branch's first call), then active (1.0 / 0.0: the
    chunk's timestep changed since the branch's previous call)."""
    x = view.hidden
    chunks = _chunk_slices(view, x.shape[1])
    ts = _chunk_timesteps(view, len(chunks))
    prev = view.memory.get("previous")  # (x, chunk timesteps) of the branch's previous call
    view.memory["previous"] = (x, ts)
    if prev is not None and prev[0].shape == x.shape:
        deltas = torch.stack([(x[:, c] - prev[0][:, c]).abs().float().mean() for c in chunks])
    else:
        deltas = torch.full((len(chunks),), math.nan, device=x.device)
    active = [prev is None or ts is None or prev[1] is None or ts[i] != prev[1][i] for i in range(len(chunks))]
    return torch.cat([deltas, torch.tensor(active, dtype=torch.float32, device=x.device)])


def _measure_chunk_computed(view: ProviderView) -> torch.Tensor | None:
    """[3n] after a computed call: per chunk mean|v_c - v_c,prev compute|, mean|x_c - x_c,prev compute| (NaN until
    two computes), then mean|v_c|. The schedule divides on the host: k = output change / input change."""
    x, v = view.hidden, view.output
    chunks = _chunk_slices(view, v.shape[1])  # no timesteps: nothing here needs them (no host read)
    out_mean = torch.stack([v[:, c].abs().float().mean() for c in chunks])
    prev = view.memory.get("at_compute")  # (x, v) of the branch's previous computed call
    view.memory["at_compute"] = (x, v)
    if prev is not None and prev[1].shape == v.shape and prev[0].shape == x.shape:
        d_out = torch.stack([(v[:, c] - prev[1][:, c]).abs().float().mean() for c in chunks])
        d_in = torch.stack([(x[:, c] - prev[0][:, c]).abs().float().mean() for c in chunks])
    else:
        d_out = d_in = torch.full_like(out_mean, math.nan)
    return torch.cat([d_out, d_in, out_mean])


CHUNK_INPUT = register_signal(SignalProvider(
    "flowcache_chunk_input", _measure_chunk_input, phase="stack_input", vector=True,
    doc="FlowCache: per chunk of frames, mean|x_c - x_c,prev call| and whether the chunk is active"))
CHUNK_COMPUTED = register_signal(SignalProvider(
    "flowcache_chunk_computed", _measure_chunk_computed, phase="computed", vector=True,
    doc="FlowCache: per chunk of frames, the output/input change ratio k and mean|v_c| after a computed call"))


__all__ = ["FlowCacheConfig", "FlowCacheSchedule", "FlowCachePolicy", "ChunkObservation", "CHUNK_INPUT",
           "CHUNK_COMPUTED"]
