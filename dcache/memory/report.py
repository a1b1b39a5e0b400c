"""Cache memory: what the cached tensors of a generation hold, by unit kind and by branch.

The engine keeps, per branch (cond / uncond / call0 ...), one `UnitHistory` per cached unit and a few reference
tensors for the signals its schedule reads (dcache.runtime.cache_state.BranchState). Their bytes are

    unit, order 0:   sum over cached tensors  numel * element_size
    unit, order k:   sum over cached tensors  (k + 1) * numel * element_size      (the Taylor table d_0 .. d_k)
    signals:         the references a signal is measured against (previous modulated input, probe residual,
                     input / output / residual at the last computed call, probe Taylor table, what signal
                     providers keep)

Every one of them is allocated at the branch's first call (which always computes) with the shapes it keeps for the
whole generation, so the peak of a generation is the sum at its end; `dcache.memory.estimate` reads the same sum after
one call per branch on meta tensors, which is why the estimate equals the measured figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..runtime.cache_state import BranchState

if TYPE_CHECKING:  # the engine reports with this module's breakdown
    from ..runtime.engine import Engine

# the order reports list them in; "controlnet": a cached ControlNet's samples (dcache.api.controlnet)
KINDS = ("stack", "block", "module", "call", "signals", "controlnet")


def unit_kind(key: Any, granularity: str) -> str:
    """The kind of a BranchState.units key: ("seg", list) -> stack, "call" -> call scope, int -> block or module
    (by granularity), (module unit, k) -> the k-th call of a shared module unit."""
    if key == "call":
        return "call"
    if isinstance(key, tuple):
        return "stack" if key and key[0] == "seg" else "module"
    return "module" if granularity == "module" else "block"


def branch_breakdown(branches: dict[str, BranchState], granularity: str) -> dict[str, dict[str, int]]:
    """{branch: {kind: bytes}} of the cached tensors held now (kinds with 0 bytes left out)."""
    out: dict[str, dict[str, int]] = {}
    for name, bstate in branches.items():
        kinds: dict[str, int] = {}
        for key, hist in bstate.units.items():
            kind = unit_kind(key, granularity)
            kinds[kind] = kinds.get(kind, 0) + hist.nbytes
        signals = bstate.nbytes - sum(h.nbytes for h in bstate.units.values())
        if signals:
            kinds["signals"] = signals
        out[name] = {k: v for k, v in kinds.items() if v}
    return out


@dataclass(frozen=True)
class MemoryReport:
    """Cache memory of a handle (`handle.memory()`) or of an estimate (`dcache.memory.estimate`).

    peak_bytes:   the most bytes cached tensors held at once (over every generation of the handle)
    live_bytes:   bytes held now (0 between generations: a generation frees its cache when it ends)
    by_branch:    {branch: {kind: bytes}} at the end of the last generation (or now, while one runs); kinds are
                  stack / block / module / call (cached unit tensors) and signals (signal references)
    """

    peak_bytes: int
    live_bytes: int
    by_branch: dict[str, dict[str, int]] = field(default_factory=dict)
    experts: dict[str, "MemoryReport"] = field(default_factory=dict)  # per expert (Wan 2.2's transformer_2)
    cache_device: str | None = None  # where the cached tensors live: None = the compute device, "cpu" = offloaded

    @property
    def device_bytes(self) -> int:
        """Peak bytes held on the compute device: all of them, or none when offloaded to host memory (a read copies
        one unit back at a time)."""
        return 0 if self.cache_device == "cpu" else self.peak_bytes

    @property
    def by_kind(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for kinds in self.by_branch.values():
            for kind, n in kinds.items():
                total[kind] = total.get(kind, 0) + n
        return {k: total[k] for k in KINDS if k in total}

    @property
    def breakdown_bytes(self) -> int:
        return sum(sum(k.values()) for k in self.by_branch.values())

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "live_bytes": self.live_bytes, "cache_device": self.cache_device,
                "by_branch": self.by_branch,
                "by_kind": self.by_kind, "experts": {k: r.to_dict() for k, r in self.experts.items()}}

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.by_kind.items()) or "nothing cached"
        branches = ", ".join(f"{b} {format_bytes(sum(k.values()))}" for b, k in self.by_branch.items())
        where = f" in {self.cache_device} memory (offloaded)" if self.cache_device else ""
        return (f"cache memory: peak {format_bytes(self.peak_bytes)}{where} (live {format_bytes(self.live_bytes)}); "
                f"by kind: {kinds}" + (f"; by branch: {branches}" if branches else ""))


def engine_report(engine: Engine) -> MemoryReport:
    """The report of a live engine: the running generation's breakdown if one runs, else the last one's."""
    live = engine.cache_bytes()
    if engine.branches:
        by_branch = branch_breakdown(engine.branches, engine.granularity.value)
    else:
        by_branch = dict(engine.memory_at_end)
    codec = engine.cache_codec
    device = str(codec.device) if codec is not None and codec.device is not None else None
    return MemoryReport(peak_bytes=max(engine.peak_cache_bytes, live), live_bytes=live, by_branch=by_branch,
                        cache_device=device)


def combine_reports(parts: dict[str, MemoryReport]) -> MemoryReport:
    """Experts of one pipeline: every expert's cache lives for the whole generation, so peaks add up; branches are
    named "<expert>/<branch>"."""
    by_branch = {f"{name}/{b}": kinds for name, r in parts.items() for b, kinds in r.by_branch.items()}
    return MemoryReport(peak_bytes=sum(r.peak_bytes for r in parts.values()),
                        live_bytes=sum(r.live_bytes for r in parts.values()), by_branch=by_branch,
                        experts=dict(parts), cache_device=next((r.cache_device for r in parts.values()), None))


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units: what a GPU's memory is counted in)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: Any, name: str = "max_cache_memory") -> int:
    """'4GiB' / '512 MB' / 1e9 -> bytes; a teaching error otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"{name}={text!r} is not a size; write e.g. '4GiB', '512MiB' or a number of bytes.")
    if isinstance(text, (int, float)):
        value = float(text)
    elif isinstance(text, str):
        s = text.strip().lower().replace(" ", "")
        digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(digits):] or "b"
        if unit not in _UNITS or not digits:
            raise ValueError(f"{name}={text!r} is not a size; write a number with a unit among "
                             f"B, KB, MB, GB, KiB, MiB, GiB (e.g. '4GiB' or '512MB').")
        try:
            value = float(digits) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a size; write e.g. '4GiB' or '512MB'.") from None
    else:
        raise ValueError(f"{name} must be a size such as '4GiB' or a number of bytes, not {type(text).__name__}.")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name}={text!r} must be a positive, finite size (e.g. '4GiB').")
    return int(value)
