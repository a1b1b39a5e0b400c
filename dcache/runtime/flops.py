"""Per-unit compute cost, counted from shapes by torch's FlopCounterMode the first time a unit runs on a shape.

Ideal speed-up = (block FLOPs of an uncached call) / (block FLOPs actually computed); module units carry their
own count, taken in the same pass. Counted once per (unit, input shape) for the engine's lifetime:
  * eager (the usual case): the counter wraps the unit's real first forward (`start` / `stop`), so it sees exactly
    what ran, through any other hooks (offloading, casting);
  * under torch.compile a dispatch mode around the real forward would stop dynamo from compiling the block, so the
    count runs in a separate eager pass on fake tensors (`count`); a forward that cannot run on fake tensors is left
    uncounted (stats then fall back to unit counts for it).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..compat.torch import fake_tensor_mode, tree_map


class FlopsUncounted(UserWarning):
    """A unit's forward could not run on fake tensors, so its FLOPs are not counted (stats fall back to unit counts
    for it: the ideal speed-up then weighs that unit as the average one)."""


def _batched(shape: Any) -> bool:
    """A tensor shape with a batch dimension (not a call signature of several shapes)."""
    return isinstance(shape, tuple) and len(shape) > 1 and isinstance(shape[0], int)


class FirstBlockReached(Exception):
    """Raised by the first block's hook in a lead-counting pass (FlopBook.count_lead): what ran before it counts."""


@contextmanager
def _faked(args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """A fake-tensor mode, and the arguments' tensors as fake ones in it."""
    with fake_tensor_mode() as fake:
        yield tree_map(lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


_BOOKS_PER_MODEL = 8  # books a model keeps: one per layout (stack, block, module units) and counting on / off


class FlopBook:
    @classmethod
    def for_model(cls, model: torch.nn.Module, layout: tuple, enabled: bool = True) -> "FlopBook":
        """The model's book, kept on the model across `dcache.apply` / `remove`: FLOPs depend on the architecture
        and the shapes only, and counting them costs a few tens of milliseconds per shape (a FlopCounterMode pass
        over every block), which would otherwise show in every re-applied run (an A/B timing loop). `layout`
        (block classes in order, module units) must match, else a new book is started. The model keeps one book per
        layout (the last _BOOKS_PER_MODEL): methods of other unit kinds, applied in turn (an A/B loop, `dcache
        estimate --cache all`), each find their own book instead of recounting every block."""
        books: list[FlopBook] = model.__dict__.setdefault("_dcache_flop_books", [])  # plain attribute: no submodule
        for book in books:
            if book.enabled == enabled and book.layout == layout:
                return book
        book = cls(enabled)
        book.layout = layout
        books.append(book)
        del books[:-_BOOKS_PER_MODEL]
        return book

    def __init__(self, enabled: bool = True):
        self.layout: tuple = ()
        self.enabled = enabled
        self.costs: dict[tuple[Any, tuple], float] = {}
        self.by_unit: dict[Any, float] = {}  # last known cost of each unit (any shape)
        # (unit, its input shape less the batch dimension) -> the cost of one row: a shape not counted yet at this
        # batch size (a sub-batch of per-sample lanes served before it ever computed) costs its rows' share
        self.per_row: dict[tuple[Any, tuple], float] = {}
        self.counting = False  # True while a counting pass runs (hooks then pass through)
        self.counting_blocks = False  # a whole-call counting pass (count_blocks): every block counts its own share
        self.counting_lead = False  # a pass that counts what runs before the first block (count_lead)
        self._open: list[tuple[Any, tuple, FlopCounterMode]] = []
        self.uncounted: dict[tuple[Any, tuple], str] = {}  # (unit, shape) -> why its count failed (tried once)

    def known(self, unit: Any, shape: tuple) -> bool:
        return (unit, shape) in self.costs

    def cost(self, unit: Any, shape: tuple) -> float | None:
        cost = self.costs.get((unit, shape))
        if cost is not None:
            return cost
        if _batched(shape):  # FLOPs are linear in the batch
            row = self.per_row.get((unit, tuple(shape[1:])))
            if row is not None:
                return row * shape[0]
        return self.by_unit.get(unit)

    def record(self, unit: Any, shape: tuple, flops: float) -> None:
        self.costs[(unit, shape)] = flops
        self.by_unit[unit] = flops
        if _batched(shape) and shape[0] > 0:
            self.per_row[(unit, tuple(shape[1:]))] = flops / shape[0]

    @torch.compiler.disable
    def count(self, unit: Any, shape: tuple, forward: Callable, args: tuple, kwargs: dict) -> None:
        """Count `forward(*args, **kwargs)` for `unit` (nested units open their own counters via `enter`)."""
        if not self.enabled or self.known(unit, shape) or (unit, shape) in self.uncounted:
            return
        self.counting = True
        try:
            try:
                with _faked(args, kwargs) as (fake_args, fake_kwargs):
                    flops = self._run(forward, fake_args, fake_kwargs)
            except Exception as exc:  # an op without a fake kernel, data-dependent shapes, ...: leave it uncounted
                why = _why(exc)
                self.uncounted[(unit, shape)] = why
                warnings.warn(f"dcache: the FLOPs of unit {unit!r} (input shape {shape}) are not counted: its forward "
                              f"cannot run on fake tensors ({why}). Stats weigh it as an average unit; the measured "
                              f"timing is unaffected. Pass count_flops=False to dcache.apply to skip counting.",
                              FlopsUncounted, stacklevel=2)
                return
        finally:
            self.counting = False
        self.record(unit, shape, flops)

    @torch.compiler.disable
    def count_blocks(self, forward: Callable, args: tuple, kwargs: dict, missing: list[tuple[Any, tuple]]) -> None:
        """Count every block of one transformer call `forward(*args, **kwargs)` in one pass on fake tensors (a call
        whose blocks ran in a compiled graph: no block ran where a counter could see it). The block hooks open a
        counter per block (`counting_blocks`); `missing`: the (unit, shape) keys the call needs, left uncounted
        (with a warning) when the pass fails."""
        if not self.enabled:
            return
        self.counting = self.counting_blocks = True
        try:
            with _faked(args, kwargs) as (fake_args, fake_kwargs):
                try:
                    forward(*fake_args, **fake_kwargs)
                finally:
                    while self._open:
                        self._open.pop()[2].__exit__(None, None, None)
        except Exception as exc:  # as in `count`: leave the blocks uncounted, say so once
            why = _why(exc)
            for key in missing:
                if key not in self.costs:
                    self.uncounted[key] = why
            warnings.warn(f"dcache: the FLOPs of the transformer's blocks are not counted: the call cannot run on "
                          f"fake tensors ({why}). Stats weigh every block as an average one; the measured timing is "
                          f"unaffected. Pass count_flops=False to dcache.apply to skip counting.",
                          FlopsUncounted, stacklevel=2)
        finally:
            self.counting = self.counting_blocks = False
        for key in missing:  # tried once, as `count` does
            if key not in self.costs:
                self.uncounted.setdefault(key, "the counting pass did not reach this block")

    @torch.compiler.disable
    def count_lead(self, unit: Any, shape: tuple, forward: Callable, args: tuple, kwargs: dict) -> None:
        """Count what one transformer call `forward(*args, **kwargs)` runs before its first block (the embedders), in
        a pass on fake tensors that ends where the first block's hook raises FirstBlockReached. A pass, not a counter
        around the real call: the blocks may be compiled, and dynamo must not meet a counter's dispatch mode there.
        Left uncounted (cost None) where the pass fails."""
        if not self.enabled or self.known(unit, shape) or (unit, shape) in self.uncounted:
            return
        self.counting = self.counting_lead = True
        try:
            with _faked(args, kwargs) as (fake_args, fake_kwargs):
                counter = FlopCounterMode(display=False)
                try:
                    with counter:
                        forward(*fake_args, **fake_kwargs)
                except FirstBlockReached:
                    pass
            self.record(unit, shape, float(counter.get_total_flops()))
        except Exception as exc:  # as in `count`, without a warning: this share is small and the rest is counted
            self.uncounted[(unit, shape)] = _why(exc)
        finally:
            self.counting = self.counting_lead = False

    def _run(self, forward: Callable, args: tuple, kwargs: dict) -> float:
        counter = FlopCounterMode(display=False)
        with counter:
            try:
                forward(*args, **kwargs)
            finally:  # nested module counters opened by hooks must close before the outer modes do
                while self._open:
                    self._open.pop()[2].__exit__(None, None, None)
        return float(counter.get_total_flops())

    def start(self, unit: Any, shape: tuple) -> FlopCounterMode | None:
        """Eager path: open a counter around the unit's real forward (None if already known); pair with `stop`."""
        if not self.enabled or self.known(unit, shape):
            return None
        counter = FlopCounterMode(display=False)
        counter.__enter__()
        return counter

    def stop(self, counter: FlopCounterMode | None, unit: Any, shape: tuple | None) -> None:
        """Close a counter from `start`; `unit` None discards the count (the forward raised)."""
        if counter is None:
            return
        counter.__exit__(None, None, None)
        if unit is not None:
            self.record(unit, shape, float(counter.get_total_flops()))

    def enter(self, unit: Any, shape: tuple) -> None:
        """Inside a counting pass: open a nested counter for an inner unit (a module)."""
        counter = FlopCounterMode(display=False)
        counter.__enter__()
        self._open.append((unit, shape, counter))

    def exit(self) -> None:
        unit, shape, counter = self._open.pop()
        counter.__exit__(None, None, None)
        self.record(unit, shape, float(counter.get_total_flops()))
