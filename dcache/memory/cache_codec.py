"""Low-precision caches: `dcache.apply(pipe, method, cache_dtype="bfloat16" | "float16" | "float8_e4m3fn")`.

A `CacheCodec` stores every cached unit tensor (residuals, module outputs, Taylor tables) in a narrower dtype and
restores it to the dtype it was computed in when the engine reads it:

    bfloat16:             stored = x.to(dtype)                         decode: stored.to(compute dtype)
    float16:              s = max(1, absmax / 65504)  (fp32, per tensor) stored = (x / s).to(float16), s beside it
                          decode: (stored.float() * s).to(compute dtype)
        an overflow guard, not a quantiser: s = 1 whenever the tensor fits float16's range (|x| <= 65504), where
        the stored bits equal a plain cast; a tensor beyond it (activations of 1e5 and more occur in large DiTs)
        is scaled into range instead of turning into infinity, and then NaN in every image it touches. No host
        read: s is computed and applied on the device.
    float8_e4m3fn:        s = absmax / 448  (fp32, 1 where absmax = 0)  stored = (x / s).to(float8), s beside it
                          decode: (stored.float() * s).to(compute dtype)
        cache_scale="tensor": one absmax per cached tensor (per Taylor row d_k: derivatives differ in magnitude)
        cache_scale="token":  one absmax per token (the last dim reduced: s is [..., L, 1])

A tensor no wider than the cache dtype (e.g. a bf16 model with cache_dtype="float16"), and any non-float tensor, is
kept as it is: a cache dtype never widens nor reinterprets. Taylor math stays fp32: at a computed step the table is
decoded to fp32, updated (dcache.kernels.taylor_update) and encoded again; at a forecast step it is decoded and
evaluated. That is the torch reference path on every backend (no fused Triton kernel reads the scaled formats).
A tensor kept as it is (an offload alone, or a cache dtype no narrower than the model's) is updated and forecast in
its own dtype instead, exactly as the plain history does: the same kernels see the same tables, so the outputs are
the plain cache's bit for bit on every backend (fp32 tables there rounded differently on CUDA's Triton kernels).

Offloaded caches: `dcache.apply(pipe, method, cache_device="cpu")` (alone or with a cache_dtype) keeps the stored
tensors in host memory. Encoding copies a tensor out of the compute device into a fresh host tensor (pinned when it
comes from CUDA, copied with non_blocking=True on the current stream); decoding copies it back to the device it was
computed on. On CUDA a read also starts the next unit's copy back on a side stream (`OffloadPrefetch`): units are
read in the order they were first cached (block 0, 1, ... of a branch, then the next branch), so while block i's
cached residual is applied, block i+1's is already in flight; the reader waits on the copy's event, never on the
whole device. On a CPU the same code path runs host to host (no pinning, no stream) and gives the on-device cache's
outputs bit for bit.

The default (cache_dtype=None, cache_device=None) builds no codec at all: `BranchState.history` makes a plain
`UnitHistory`, so the full-precision path runs exactly the code it ran before, bit for bit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.cache_ops import ops_for
from ..runtime.cache_state import UnitHistory

CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}
CACHE_SCALES = ("tensor", "token")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP16_MAX = 65504.0  # largest finite float16


@dataclass
class Stored:
    """One cached tensor in its stored form: `data` in the cache dtype (on the cache device), `scale` (fp32,
    broadcastable, beside `data`) for fp8."""

    data: torch.Tensor
    scale: torch.Tensor | None  # fp8 and float16 (dcache.memory.cache_codec's table), None otherwise
    dtype: torch.dtype  # the dtype it was computed in (restored on decode)
    home: torch.device | None = None  # the device it was computed on (restored on decode); None: data.device

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        """Where the tensor is used (the compute device), wherever it is stored."""
        return self.home if self.home is not None else self.data.device

    @property
    def offloaded(self) -> bool:
        return self.home is not None and self.home != self.data.device

    @property
    def nbytes(self) -> int:
        scale = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.data.numel() * self.data.element_size() + scale


@dataclass(frozen=True)
class CacheCodec:
    dtype: torch.dtype | None  # the stored dtype; None: the compute dtype (an offload-only codec)
    scale: str | None = None  # "tensor" | "token" for float8, None otherwise
    device: torch.device | None = None  # the cache device ("cpu": offloaded); None: where each tensor was computed
    prefetch: "OffloadPrefetch | None" = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        text = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "compute dtype"
        text = f"{text}/{self.scale}" if self.scale else text
        return f"{text} on {self.device}" if self.device is not None else text

    def encode(self, x: torch.Tensor, lead: int = 0, dtype: torch.dtype | None = None) -> Stored:
        """x -> Stored. lead: leading dims that get their own per-tensor scale (1 for a Taylor table [K+1, ...]);
        dtype: the compute dtype `x` stands for (a Taylor table is encoded from its fp32 working copy)."""
        x = x.detach()
        dtype = dtype or x.dtype
        if self.keeps(dtype):
            return self._place(Stored(x.to(dtype), None, dtype))  # never widened nor reinterpreted
        guard = self.dtype is torch.float16  # scaled only beyond the range (see the table above)
        if self.scale is None and not guard:
            return self._place(Stored(x.to(self.dtype), None, dtype))
        if self.scale == "token" and x.dim() > lead:
            amax = x.abs().amax(dim=-1, keepdim=True).float()  # [..., L, 1]
        else:
            dims = tuple(range(lead, x.dim()))
            amax = x.abs().amax(dim=dims, keepdim=True).float() if dims else x.abs().float()
        if guard:
            scale = torch.where(amax > _FP16_MAX, amax / _FP16_MAX, torch.ones_like(amax))
        else:
            scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
        return self._place(Stored((x.float() / scale).to(self.dtype), scale, dtype))

    def keeps(self, dtype: torch.dtype) -> bool:
        """True when a tensor computed in `dtype` is stored as it is (no cache dtype, or one no narrower): its
        history then does its Taylor math in `dtype`, on the same kernels as the plain history, so an offloaded cache
        gives the on-device cache's outputs bit for bit on every backend."""
        return self.dtype is None or not dtype.is_floating_point or dtype.itemsize <= self.dtype.itemsize

    def _place(self, stored: Stored) -> Stored:
        """Move an encoded tensor to the cache device: a fresh host copy (pinned for a CUDA source, so the copy back
        can be asynchronous); nothing to do without a cache device."""
        if self.device is None:
            return stored
        home = stored.data.device
        return Stored(_copy_to(stored.data, self.device), None if stored.scale is None else
                      _copy_to(stored.scale, self.device), stored.dtype, home)

    def decode(self, stored: Stored, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored -> tensor in `dtype` (default: the dtype it was computed in) on the device it was computed on."""
        dtype = dtype or stored.dtype
        if stored.offloaded:
            stored = _fetch(stored)
        if stored.scale is None:
            return stored.data.to(dtype)
        return (stored.data.float() * stored.scale).to(dtype)

    def history(self, order: int) -> "CodedHistory":
        hist = CodedHistory(order, self)
        if self.prefetch is not None:
            self.prefetch.add(hist)
        return hist


def _copy_to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of x on `device` that never aliases x (host to host too), asynchronous out of CUDA into pinned
    memory (ordered on the current stream, so a later copy back on that stream, or on one that waits for it, reads
    the finished data)."""
    pinned = x.device.type == "cuda" and device.type == "cpu"
    out = torch.empty(x.shape, dtype=x.dtype, device=device, pin_memory=pinned)
    return out.copy_(x, non_blocking=pinned)


def _fetch(stored: Stored) -> Stored:
    """The stored tensor copied back to its compute device (on the current stream)."""
    home = stored.home
    asynchronous = home.type == "cuda" and stored.data.is_pinned()
    data = stored.data.to(home, non_blocking=asynchronous)
    scale = None if stored.scale is None else stored.scale.to(home, non_blocking=asynchronous)
    return Stored(data, scale, stored.dtype)


class OffloadPrefetch:
    """Copies the next unit's offloaded tensors back to the GPU on a side stream while the current unit runs.

    Histories register in the order they are created, which is the order the engine first reads them in (block 0, 1,
    ... of the first branch, then of the next); reading one starts the copy of the one created after it. A copy is
    matched to the exact `Stored` objects it read, so a history updated after its prefetch is simply copied again."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)
        self._last: weakref.ref | None = None  # weak: a finished generation's histories are freed with their branch

    def add(self, hist: "CodedHistory") -> None:
        last = self._last() if self._last is not None else None
        if last is not None:
            last.next_history = hist
        self._last = weakref.ref(hist)

    def start(self, hist: "CodedHistory | None") -> None:
        """Start copying hist's stored tensors to their device (no-op when already done or nothing is offloaded)."""
        if hist is None or not hist.tables or hist.prefetched is not None:
            return
        tables = list(hist.tables)
        if not all(s.offloaded and s.home.type == "cuda" for s in tables):
            return
        current = torch.cuda.current_stream(tables[0].home)
        self.stream.wait_stream(current)  # the copies out of the device (current stream) come first
        with torch.cuda.stream(self.stream):
            fetched = [_fetch(s) for s in tables]
            event = torch.cuda.Event()
            event.record(self.stream)
        hist.prefetched = (tables, fetched, event)

    @staticmethod
    def take(hist: "CodedHistory") -> list[Stored] | None:
        """The prefetched copies of hist's current tables (the reader's stream waits for them), or None."""
        done, hist.prefetched = hist.prefetched, None
        if done is None or len(done[0]) != len(hist.tables or []) or any(
                a is not b for a, b in zip(done[0], hist.tables)):
            return None
        tables, fetched, event = done
        current = torch.cuda.current_stream(tables[0].home)
        current.wait_event(event)
        for f in fetched:  # the allocator must not reuse these while the current stream still reads them
            f.data.record_stream(current)
            if f.scale is not None:
                f.scale.record_stream(current)
        return fetched


CACHE_DEVICES = ("cpu",)


def cache_codec(cache_dtype: Any = None, cache_scale: Any = None, cache_device: Any = None) -> CacheCodec | None:
    """The codec for apply's `cache_dtype` / `cache_scale` / `cache_device`, or None (the cache keeps the compute
    dtype on the compute device). Raises ValueError naming the field and its allowed values."""
    device = _cache_device(cache_device)
    if cache_dtype is None:
        if cache_scale is not None:
            raise ValueError(f"cache_scale={cache_scale!r} needs cache_dtype='float8_e4m3fn' (the scale is what an "
                             f"8-bit cache stores beside each tensor); set cache_dtype or drop cache_scale.")
        return None if device is None else _with_device(CacheCodec(None), device)
    codec = _dtype_codec(cache_dtype, cache_scale)
    return codec if device is None else _with_device(codec, device)


def _cache_device(cache_device: Any) -> torch.device | None:
    if cache_device is None:
        return None
    name = str(cache_device) if isinstance(cache_device, torch.device) else cache_device
    if name not in CACHE_DEVICES:
        raise ValueError(f"cache_device={cache_device!r} is not a cache device; allowed values: "
                         f"{', '.join(repr(d) for d in CACHE_DEVICES)} (host memory) or None (the compute device).")
    return torch.device(name)


def _with_device(codec: CacheCodec, device: torch.device) -> CacheCodec:
    """Offload to `device`; with CUDA present, reads prefetch the next unit on a side stream."""
    prefetch = OffloadPrefetch(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() \
        else None
    return CacheCodec(codec.dtype, codec.scale, device, prefetch)


def _dtype_codec(cache_dtype: Any, cache_scale: Any) -> CacheCodec:
    if isinstance(cache_dtype, torch.dtype):
        cache_dtype = str(cache_dtype).removeprefix("torch.")
    if not isinstance(cache_dtype, str) or cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype={cache_dtype!r} is not a cache dtype; allowed values: "
                         f"{', '.join(repr(k) for k in CACHE_DTYPES)} (or None for the compute dtype).")
    dtype = CACHE_DTYPES[cache_dtype]
    if dtype is torch.float8_e4m3fn:
        scale = "tensor" if cache_scale is None else cache_scale
        if scale not in CACHE_SCALES:
            raise ValueError(f"cache_scale={cache_scale!r} is not a scale; allowed values: "
                             f"{', '.join(repr(s) for s in CACHE_SCALES)} (one absmax per tensor or per token).")
        return CacheCodec(dtype, scale)
    if cache_scale is not None:
        raise ValueError(f"cache_scale={cache_scale!r} applies to cache_dtype='float8_e4m3fn' only; "
                         f"cache_dtype={cache_dtype!r} stores no scale: drop cache_scale.")
    return CacheCodec(dtype)


class CodedHistory(UnitHistory):
    """A UnitHistory whose `tables` hold `Stored` tensors: order 0 one per cached tensor, order k one [k+1, *shape]
    table per cached tensor (a scale per row d_k). Reads return tensors in the compute dtype."""

    def __init__(self, order: int, codec: CacheCodec):
        super().__init__(order)
        self.codec = codec
        self.tables: list[Stored] | None = None  # type: ignore[assignment]
        self.next_history: CodedHistory | None = None  # offloaded on CUDA: the unit whose copy a read here starts
        self.prefetched: tuple | None = None  # (the tables copied, their device copies, the copy's event)

    def _on_device(self) -> list[Stored]:
        """The stored tables on the compute device: as they are, the prefetched copies, or copied back now. Reading
        an offloaded unit on CUDA starts the next unit's copy (OffloadPrefetch)."""
        tables = list(self.tables or [])
        prefetch = self.codec.prefetch
        if prefetch is None or not any(s.offloaded for s in tables):
            return [_fetch(s) if s.offloaded else s for s in tables]
        fetched = prefetch.take(self) if self.prefetched is not None else None
        prefetch.start(self.next_history)
        return fetched if fetched is not None else [_fetch(s) if s.offloaded else s for s in tables]

    def update(self, tensors: list[torch.Tensor], step: int) -> None:
        self.keep_sample(tensors, step)  # a forecaster's samples stay in the compute dtype
        codec = self.codec
        if self.order == 0:
            self.tables = [codec.encode(t) for t in tensors]
            self.filled = 1
            self.last_step = step
            return
        shapes = [(self.order + 1, *x.shape) for x in tensors]
        math = [x.dtype if codec.keeps(x.dtype) else torch.float32 for x in tensors]  # the plain history's dtype
        if self.tables is None or [tuple(s.shape) for s in self.tables] != shapes:
            work = [x.new_zeros(shape, dtype=dtype) for x, shape, dtype in zip(tensors, shapes, math)]
            self.filled = 0
            self.last_step = None
        else:
            work = [codec.decode(s, dtype) for s, dtype in zip(self._on_device(), math)]
        dist = float(step - self.last_step) if self.last_step is not None else 1.0
        filled = self.filled
        for table, x in zip(work, tensors):  # narrowed caches: fp32 tables, Taylor math as in full precision
            filled = ops_for(table).taylor_update(table, x.detach(), max(dist, 1.0), self.filled)
        self.filled = filled
        self.tables = [codec.encode(t, lead=1, dtype=x.dtype) for t, x in zip(work, tensors)]
        self.last_step = step

    def reuse(self) -> list[torch.Tensor]:
        if self.order == 0:
            return [self.codec.decode(s) for s in self._on_device()]
        return [self._row(s, 0) for s in self._on_device()]

    def forecast(self, step: int) -> list[torch.Tensor]:
        if self.order == 0 or self.filled <= 1:
            return self.reuse()
        ahead = float(step - (self.last_step or 0))
        out = []
        for s in self._on_device():
            table = self.codec.decode(s, s.dtype if self.codec.keeps(s.dtype) else torch.float32)
            out.append(ops_for(table).taylor_forecast(table, ahead, self.filled).to(s.dtype))
        return out

    def _row(self, s: Stored, k: int) -> torch.Tensor:
        scale = s.scale[k] if s.scale is not None else None
        return self.codec.decode(Stored(s.data[k], scale, s.dtype))

    def matches(self, tensors: list[torch.Tensor | None]) -> bool:
        if self.tables is None:
            return False
        skip = 0 if self.order == 0 else 1
        return len(self.tables) == len(tensors) and all(
            t is None or (s.shape[skip:] == t.shape and s.device == t.device) for s, t in zip(self.tables, tensors))

    def store_buffers(self) -> list[torch.Tensor]:
        return []  # residuals are computed in the compute dtype, then encoded: no stored buffer to write into

    def plain(self) -> UnitHistory:
        """A full-precision copy for a schedule's own forecaster (it reads `tables` as tensors)."""
        view = UnitHistory(self.order)
        view.key, view.filled, view.last_step = self.key, self.filled, self.last_step
        view.depth, view.samples = self.depth, self.samples
        view.fitted = self.fitted  # a forecaster's fits outlive the per-call view (they belong to the samples)
        view.tables = [self.codec.decode(s) for s in self._on_device()] if self.tables is not None else None
        return view

    @property
    def nbytes(self) -> int:
        kept = self.samples_bound()
        return kept + sum(s.nbytes for s in self.tables or [])

