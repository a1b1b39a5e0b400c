"""Cache state of one generation: per branch, per unit, the cached tensors and their forecast history.

A unit's history is a Taylor table per cached tensor: d_0 is the value at the last computed step, d_k its k-th
finite difference divided by the step distance. REUSE returns d_0; FORECAST evaluates
    y(step) = sum_k d_k * (step - last_step)^k / k!
With order 0 the table is the tensor itself (no copy). Memory is bounded: (order + 1) tensors per cached unit.

A schedule whose forecaster reads more than the Taylor table (dcache.runtime.forecast: `Forecaster.depth` > 0) also
gets the last `depth` computed values themselves, oldest first:
    samples = [(step, [tensor per cached stream]), ...]      # len(samples) <= depth, steps increasing
so memory is then (order + 1 + depth) tensors per cached unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dcache.runtime.cache_ops import ops_for  # the Taylor pair, backend chosen as for the engine's other ops

if TYPE_CHECKING:
    from ..generations.records import CallRecord
    from ..memory.cache_codec import CacheCodec
    from .call_output import PlainLayout
    from .call_scope import OutputLayout


# Taylor orders above this are refused before any table is allocated: order k keeps k + 1 tensors per cached unit
# (the methods' order knobs allow up to 8 too).
MAX_FORECAST_ORDER = 8


class UnitHistory:
    """Cached tensors of one unit in one branch (e.g. the [hidden, encoder] residuals of a block)."""

    def __init__(self, order: int, depth: int = 0, fit_bytes: int = 0):
        if type(order) is not int or not 0 <= order <= MAX_FORECAST_ORDER:  # noqa: E721 - bool is not an order
            raise ValueError(f"forecast_order={order!r} must be an int in 0..{MAX_FORECAST_ORDER} (the Taylor "
                             f"order of forecasts; order k keeps k + 1 cached tensors per unit).")
        self.order = order
        self.key: Any = None  # the unit's key in BranchState.units (read by a schedule's forecaster)
        # a module unit's output pytree: (spec, which leaves are the cached tensors) to rebuild it from `tables`
        self.layout: tuple[Any, list[bool]] | None = None
        self.tables: list[torch.Tensor] | None = None
        self.filled = 0
        self.last_step: int | None = None
        self.depth = depth  # computed values kept as they are, for a forecaster that reads them (see above)
        self.fit_bytes = fit_bytes  # bytes per element of one computed value its fit keeps (Forecaster.fit_bytes)
        self.samples: list[tuple[int, list[torch.Tensor]]] = []

    @property
    def samples(self) -> list[tuple[int, list[torch.Tensor]]]:
        """The last `depth` computed values [(step, [tensor per stream]), ...], oldest first."""
        return self._samples

    @samples.setter
    def samples(self, value: list[tuple[int, list[torch.Tensor]]]) -> None:
        # What a forecaster derived from the kept values alone (dcache.schedules.forecasters.base: fit) holds until
        # they change; every change assigns a new list, so stale fits are dropped here and nowhere else.
        self._samples = value
        self.fitted: dict[Any, Any] = {}

    def keep_sample(self, tensors: list[torch.Tensor], step: int) -> None:
        """Remember the computed values of `step` (copies: an order-0 table's buffers are rewritten in place)."""
        if self.depth == 0:
            return
        if self.samples and [t.shape for t in self.samples[-1][1]] != [t.shape for t in tensors]:
            self.samples = []  # a new layout (resolution, batch): the old values describe another trajectory
        self.samples = [s for s in self.samples if s[0] < step][-(self.depth - 1):] if self.depth > 1 else []
        self.samples.append((step, [t.detach().clone() for t in tensors]))

    def samples_bound(self) -> int:
        """Bytes the kept values reach once `depth` steps computed: depth x one step's values, plus what the
        forecaster's fit keeps per element (`fit_bytes`; from the first computed
        step on, so that a memory estimate after one call, dcache.memory.estimate and dcache.memory.budget, sees the
        peak)."""
        if not self.samples:
            return 0
        return sum((self.depth * t.element_size() + self.fit_bytes) * t.numel() for t in self.samples[-1][1])

    def update(self, tensors: list[torch.Tensor], step: int) -> None:
        self.keep_sample(tensors, step)
        if self.order == 0:
            self.tables = [t.detach() for t in tensors]
        else:
            if self.tables is None or [t.shape for t in self.tables] != [(self.order + 1, *x.shape) for x in tensors]:
                self.tables = [x.new_zeros((self.order + 1, *x.shape)) for x in tensors]
                self.filled = 0
                self.last_step = None
            dist = float(step - self.last_step) if self.last_step is not None else 1.0
            new_filled = self.filled
            for table, x in zip(self.tables, tensors):
                new_filled = ops_for(table).taylor_update(table, x.detach(), max(dist, 1.0), self.filled)
            self.filled = new_filled
        if self.order == 0:
            self.filled = 1
        self.last_step = step

    def reuse(self) -> list[torch.Tensor]:
        if self.order == 0:
            return list(self.tables or [])
        return [table[0] for table in self.tables or []]

    def forecast(self, step: int) -> list[torch.Tensor]:
        if self.order == 0 or self.filled <= 1:
            return self.reuse()
        ahead = float(step - (self.last_step or 0))
        return [ops_for(table).taylor_forecast(table, ahead, self.filled) for table in self.tables or []]

    def read(self, forecast: bool, step: int) -> list[torch.Tensor]:
        return self.forecast(step) if forecast else self.reuse()

    def matches(self, tensors: list[torch.Tensor | None]) -> bool:
        if self.tables is None:
            return False
        cached = self.reuse()
        return len(cached) == len(tensors) and all(
            t is None or (c.shape == t.shape and c.device == t.device) for c, t in zip(cached, tensors))

    def store_buffers(self) -> list[torch.Tensor]:
        """Tensors a fresh order-0 residual may be written into in place
        (dcache.runtime.unit_store.store_residuals)."""
        return self.reuse() if self.order == 0 and self.tables is not None else []

    def plain(self) -> "UnitHistory":
        """This history as a schedule's forecaster reads it (`tables` as tensors; dcache.memory.cache_codec
        decodes)."""
        return self

    @property
    def nbytes(self) -> int:
        kept = self.samples_bound()
        return kept + sum(t.numel() * t.element_size() for t in self.tables or [])


@dataclass
class BranchState:
    """Everything one branch (cond / uncond / ...) keeps across the steps of one generation."""

    units: dict[Any, UnitHistory] = field(default_factory=dict)  # stack segments, blocks or modules
    chained: set[int] = field(default_factory=set)  # STACK: lists whose segment continued the previous one's run
    last_compute_step: int | None = None
    # The stack's input, output and residual at the last computed call (kept while a "computed" signal is read).
    input_at_compute: torch.Tensor | None = None
    output_at_compute: torch.Tensor | None = None
    residual_at_compute: torch.Tensor | None = None
    pending_post: dict[str, torch.Tensor] = field(default_factory=dict)  # measured after a computed call
    post_values: dict[str, float] = field(default_factory=dict)  # last synced post signals
    pending_call: CallRecord | None = None  # the call the pending post signals belong to
    # call scope: how the last computed call's output is built (x + Delta: OutputLayout; reused whole: PlainLayout)
    call_layout: OutputLayout | PlainLayout | None = None
    codec: CacheCodec | None = None  # the codec of a low-precision cache (None: the compute dtype)
    depth: int = 0  # computed values each unit keeps for the schedule's forecaster (UnitHistory.samples)
    fit_bytes: int = 0  # bytes per element of one computed value its fit keeps (UnitHistory.fit_bytes)
    provided: dict[str, dict[str, Any]] = field(default_factory=dict)  # each signal provider's memory, by its name
    # call scope with a schedule's cfg_difference (dcache.runtime.cfg_difference): the conditional branch's (step,
    # Delta, computed) of the running step; the unconditional branch's history of D = Delta_c - Delta_u
    cfg_reference: tuple | None = None
    cfg_difference: UnitHistory | None = None

    def history(self, key: Any, order: int) -> UnitHistory:
        hist = self.units.get(key)
        if hist is None:
            hist = self.units[key] = UnitHistory(order) if self.codec is None else self.codec.history(order)
            hist.key, hist.depth, hist.fit_bytes = key, self.depth, self.fit_bytes
        return hist

    @property
    def nbytes(self) -> int:
        tensors = [self.input_at_compute, self.output_at_compute, self.residual_at_compute]
        histories = [h for h in (self.cfg_difference,) if h is not None]
        for memory in self.provided.values():  # a provider keeps tensors, tuples of them, or a history
            for value in memory.values():
                if isinstance(value, UnitHistory):
                    histories.append(value)
                    continue
                values = value if isinstance(value, tuple) else (value,)
                tensors += [t for t in values if isinstance(t, torch.Tensor)]
        extra = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return sum(h.nbytes for h in self.units.values()) + extra + sum(h.nbytes for h in histories)
