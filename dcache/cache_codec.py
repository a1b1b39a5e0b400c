"""Low-precision caches: `dcache.apply(pipe, method, cache_dtype="bfloat16" | "float16" | "float8_e4m3fn")`.

A `CacheCodec` stores every cached unit tensor (residuals, module outputs, Taylor tables) in a narrower dtype and
restores it to the dtype it was computed in when the engine reads it:

    bfloat16 / float16:   stored = x.to(dtype)                         decode: stored.to(compute dtype)
    float8_e4m3fn:        s = absmax / 448  (fp32, 1 where absmax = 0)  stored = (x / s).to(float8), s beside it
                          decode: (stored.float() * s).to(compute dtype)
        cache_scale="tensor": one absmax per cached tensor (per Taylor row d_k: derivatives differ in magnitude)
        cache_scale="token":  one absmax per token (the last dim reduced: s is [..., L, 1])

A tensor no wider than the cache dtype (e.g. a bf16 model with cache_dtype="float16"), and any non-float tensor, is
kept as it is: a cache dtype never widens nor reinterprets. Taylor math stays fp32: at a computed step the table is
decoded to fp32, updated (dcache.kernels.taylor_update) and encoded again; at a forecast step it is decoded and
evaluated. That is the torch reference path on every backend (no fused Triton kernel reads the scaled formats).

The default (cache_dtype=None) builds no codec at all: `BranchState.history` makes a plain `UnitHistory`, so the
full-precision path runs exactly the code it ran before, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .cache_ops import ops_for
from .state import UnitHistory

CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}
CACHE_SCALES = ("tensor", "token")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Stored:
    """One cached tensor in its stored form: `data` in the cache dtype, `scale` (fp32, broadcastable) for fp8."""

    data: torch.Tensor
    scale: torch.Tensor | None
    dtype: torch.dtype  # the dtype it was computed in (restored on decode)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        scale = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.data.numel() * self.data.element_size() + scale


@dataclass(frozen=True)
class CacheCodec:
    dtype: torch.dtype
    scale: str | None = None  # "tensor" | "token" for float8, None otherwise

    @property
    def name(self) -> str:
        text = str(self.dtype).removeprefix("torch.")
        return f"{text}/{self.scale}" if self.scale else text

    def encode(self, x: torch.Tensor, lead: int = 0, dtype: torch.dtype | None = None) -> Stored:
        """x -> Stored. lead: leading dims that get their own per-tensor scale (1 for a Taylor table [K+1, ...]);
        dtype: the compute dtype `x` stands for (a Taylor table is encoded from its fp32 working copy)."""
        x = x.detach()
        dtype = dtype or x.dtype
        if not dtype.is_floating_point or dtype.itemsize <= self.dtype.itemsize:
            return Stored(x.to(dtype), None, dtype)  # never widened nor reinterpreted
        if self.scale is None:
            return Stored(x.to(self.dtype), None, dtype)
        if self.scale == "token" and x.dim() > lead:
            amax = x.abs().amax(dim=-1, keepdim=True).float()  # [..., L, 1]
        else:
            dims = tuple(range(lead, x.dim()))
            amax = x.abs().amax(dim=dims, keepdim=True).float() if dims else x.abs().float()
        scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
        return Stored((x.float() / scale).to(self.dtype), scale, dtype)

    def decode(self, stored: Stored, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored -> tensor in `dtype` (default: the dtype it was computed in)."""
        dtype = dtype or stored.dtype
        if stored.scale is None:
            return stored.data.to(dtype)
        return (stored.data.float() * stored.scale).to(dtype)

    def history(self, order: int) -> "CodedHistory":
        return CodedHistory(order, self)


def cache_codec(cache_dtype: Any = None, cache_scale: Any = None) -> CacheCodec | None:
    """The codec for apply's `cache_dtype` / `cache_scale`, or None (full precision: the cache keeps the compute
    dtype). Raises ValueError naming the field and its allowed values."""
    if cache_dtype is None:
        if cache_scale is not None:
            raise ValueError(f"cache_scale={cache_scale!r} needs cache_dtype='float8_e4m3fn' (the scale is what an "
                             f"8-bit cache stores beside each tensor); set cache_dtype or drop cache_scale.")
        return None
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

    def update(self, tensors: list[torch.Tensor], step: int) -> None:
        codec = self.codec
        if self.order == 0:
            self.tables = [codec.encode(t) for t in tensors]
            self.filled = 1
            self.last_step = step
            return
        shapes = [(self.order + 1, *x.shape) for x in tensors]
        if self.tables is None or [tuple(s.shape) for s in self.tables] != shapes:
            work = [x.new_zeros(shape, dtype=torch.float32) for x, shape in zip(tensors, shapes)]
            self.filled = 0
            self.last_step = None
        else:
            work = [codec.decode(s, torch.float32) for s in self.tables]
        dist = float(step - self.last_step) if self.last_step is not None else 1.0
        filled = self.filled
        for table, x in zip(work, tensors):  # fp32 tables: Taylor math as in full precision
            filled = ops_for(table).taylor_update(table, x.detach(), max(dist, 1.0), self.filled)
        self.filled = filled
        self.tables = [codec.encode(t, lead=1, dtype=x.dtype) for t, x in zip(work, tensors)]
        self.last_step = step

    def reuse(self) -> list[torch.Tensor]:
        if self.order == 0:
            return [self.codec.decode(s) for s in self.tables or []]
        return [self._row(s, 0) for s in self.tables or []]

    def forecast(self, step: int) -> list[torch.Tensor]:
        if self.order == 0 or self.filled <= 1:
            return self.reuse()
        ahead = float(step - (self.last_step or 0))
        out = []
        for s in self.tables or []:
            table = self.codec.decode(s, torch.float32)
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
        view.tables = [self.codec.decode(s) for s in self.tables] if self.tables is not None else None
        return view

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.tables or [])

