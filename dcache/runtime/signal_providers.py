"""Signals: one registry of providers, for the built-in signals and for the ones a method brings with it.

A provider measures one signal; the engine calls the providers a schedule lists in its `signals` and no others, so the
core measures every signal without naming it. The built-in signals (`dcache.actions.Signal`) are providers registered
by dcache.runtime.built_in_signals; a method that decides from something else registers one from its own file:

    SHARPNESS = register_signal(SignalProvider("sharpness", measure_sharpness, doc="..."))

    class MySchedule(Schedule):
        signals = frozenset({SHARPNESS})        # the engine calls the provider only while a schedule lists it
        def decide(self, ctx):
            s = ctx.signals.get(SHARPNESS)      # None where the provider had no value (e.g. a branch's first call)

When the engine calls `provider.measure(view)` depends on the provider's `phase`:
  "call"          at every transformer call, before anything of the transformer runs: `view.arguments` are the
                  call's arguments (also available with scope="call");
  "stack_input"   at every call, when the block stack's input is known, before the decision: `view.hidden` is the
                  stack input [B, L, D] and `view.first_block` the stack's first block with its arguments (blocks
                  scope only; a provider with `latents=True` is measured in call scope too, on the call's latent
                  input x, with no first block);
  "probe_output"  at every call, after the probe blocks ran, before the decision: `view.residual` is the probe blocks'
                  residual (their output minus the stack input); `provider.keep(view)`, where given, refreshes the
                  provider's references after the decision of a call that computes;
  "computed"      after every computed call: `view.hidden` / `view.output` / `view.residual` are the stack's input,
                  output and output - input (in call scope the call's latent input x, output v and v - x), and
                  `view.last_hidden` / `last_output` / `last_residual` the same at the branch's previous computed call
                  (None before it); the value reaches the branch's *next* decision.
The view also carries the adapter, the model, the schedule (a provider reads its own method's knobs there), the step
and a per-branch `memory` dict that lives as long as the branch's cache (the provider keeps its references there;
their bytes count as the cache's "signals" memory). A provider returns a tensor on the model's device, shape [1]
(the value) or [2] (numerator, denominator: the value is num / max(den, 1e-12)), or None; a `vector` provider
returns shape [n] and the schedule reads a tuple of n floats (e.g. one value per chunk of a video's frames). All of
a call's signals reach the host in one transfer at the decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import torch

from ..actions import Signal

if TYPE_CHECKING:
    from ..model.adapters import Adapter
    from ..schedule import Schedule
    from .cache_ops import CacheOps

_BUILT_IN = {s.value: s for s in Signal}  # name -> Signal (without Enum's by-value lookup)
T = TypeVar("T")


@dataclass
class ProviderView:
    """One transformer call, as a signal provider sees it (see the phases above)."""

    args: tuple  # the positional arguments as passed
    adapter: Adapter  # the transformer's adapter (e.g. `adapter.latents`, `adapter.modulated_input`)
    schedule: Schedule  # the schedule that asked for the signal
    step: int
    num_steps: int | None
    timesteps: tuple[float, ...] | None
    memory: dict[str, Any]  # per branch and provider, kept across the branch's calls of one generation
    model: Any = None  # the transformer
    hidden: torch.Tensor | None = None  # phases "stack_input" and "computed": the stack input [B, L, D]
    output: torch.Tensor | None = None  # phase "computed": the stack output [B, L, D]
    residual: torch.Tensor | None = None  # phases "probe_output" and "computed": output - input [B, L, D]
    # phase "computed": the stack input, output and residual at the branch's previous computed call (None before it)
    last_hidden: torch.Tensor | None = None
    last_output: torch.Tensor | None = None
    last_residual: torch.Tensor | None = None
    first_block: tuple[Any, tuple, dict] | None = None  # phase "stack_input": (block, args, kwargs) of the first block
    ops: CacheOps | None = None  # the call's kernels (`ops.rel_l1(a, b)` -> [2])
    order: int = 0  # the Taylor order the engine keeps for the schedule's forecasts
    shared: dict[str, Any] = field(default_factory=dict)  # one dict for the providers measured at one point of a call
    bind: Callable[[], dict[str, Any]] | None = field(default=None, repr=False)  # binds `arguments` on first use
    count: Callable[[Callable[[], Any]], Any] | None = field(default=None, repr=False)

    @property
    def arguments(self) -> dict[str, Any]:
        """The transformer forward's arguments by name (bound once per call, on first use)."""
        return self.bind() if self.bind is not None else {}

    def counted(self, fn: Callable[[], T]) -> T:
        """fn(): work an uncached call never does (e.g. a block's AdaLN): its FLOPs count in the call's computed
        FLOPs, booked under the provider's `compute` key."""
        return self.count(fn) if self.count is not None else fn()


@dataclass(frozen=True)
class SignalProvider:
    name: str  # the key a schedule lists in `signals` and reads from `CallContext.signals`
    measure: Callable[[ProviderView], torch.Tensor | None]
    quiet: float = 1e-9  # the value that means "nothing changed" (dcache.memory.estimate's no-change simulation)
    doc: str = ""
    phase: str = "call"  # "call" | "stack_input" | "probe_output" | "computed" (see the module docstring)
    vector: bool = False  # True: the value is a tuple of floats (a tensor of shape [n]), not one number
    keep: Callable[[ProviderView], None] | None = None  # "probe_output": after the decision of a computed call
    latents: bool = False  # "stack_input": measured in call scope too, on the call's latent input
    compute: str | None = None  # the FLOP book key of the work `view.counted` runs (priced by dcache estimate)


_PROVIDERS: dict[str, SignalProvider] = {}
PHASES = ("call", "stack_input", "probe_output", "computed")


def register_signal(provider: SignalProvider) -> str:
    """Register (or replace, e.g. on a module reload) a provider; returns its name for the schedule's `signals`."""
    _check(provider)
    if provider.name in _BUILT_IN:
        raise ValueError(f"signal {provider.name!r} is measured by the engine (dcache.actions.Signal); give the "
                         f"provider another name.")
    _PROVIDERS[provider.name] = provider
    return provider.name


def register_built_in(provider: SignalProvider) -> Signal:
    """Register the provider of a built-in signal (dcache.runtime.built_in_signals); returns its `Signal`."""
    _check(provider)
    if provider.name not in _BUILT_IN:
        raise ValueError(f"{provider.name!r} is no member of dcache.actions.Signal; add it there first, or register "
                         f"the provider with register_signal.")
    _PROVIDERS[provider.name] = provider
    return _BUILT_IN[provider.name]


def _check(provider: SignalProvider) -> None:
    if not isinstance(provider, SignalProvider) or not isinstance(provider.name, str) or not provider.name:
        raise TypeError(f"register_signal takes a SignalProvider with a non-empty str name, not {provider!r}.")
    if provider.phase not in PHASES:
        raise ValueError(f"signal provider {provider.name!r} has phase={provider.phase!r}; use one of {PHASES} "
                         f"(before the call, at the stack input, after the probe blocks, or after a computed call).")


def provider(name: Signal | str) -> SignalProvider | None:
    return _PROVIDERS.get(signal_name(name))


def provider_names(phase: str | None = None) -> frozenset[str]:
    """Registered provider names, built-in signals included (of one phase, or all)."""
    return frozenset(n for n, p in _PROVIDERS.items() if phase is None or p.phase == phase)


def providers_for(signals: Iterable[Signal | str]) -> tuple[SignalProvider, ...]:
    """The providers of `signals`, in the order the engine measures them: the built-in signals in the order they were
    registered, then a method's own by name."""
    names = {signal_name(s) for s in signals}
    built_in = [p for n, p in _PROVIDERS.items() if n in names and n in _BUILT_IN]
    return tuple(built_in) + tuple(_PROVIDERS[n] for n in sorted(names - set(_BUILT_IN)) if n in _PROVIDERS)


def call_scope_names() -> frozenset[str]:
    """The signals scope="call" can measure: from the call's arguments, on its latent input, or after it computed."""
    return frozenset(n for n, p in _PROVIDERS.items()
                     if p.phase in ("call", "computed") or (p.phase == "stack_input" and p.latents))


def resolve_signal(signal: Any, where: str = "a schedule's `signals`") -> Signal | str:
    """A built-in `Signal`, or the name of a registered provider; anything else is refused with the fix."""
    name = signal.value if isinstance(signal, Signal) else signal
    if isinstance(name, str):
        if name in _BUILT_IN:
            return _BUILT_IN[name]
        if name in _PROVIDERS:
            return name
    known = sorted(_BUILT_IN) + sorted(set(_PROVIDERS) - set(_BUILT_IN))
    raise ValueError(f"{where} lists {signal!r}, which is neither a built-in signal nor a registered provider "
                     f"({', '.join(known)}); register it with dcache.runtime.signal_providers.register_signal in the "
                     f"file that defines the method, and import that file before applying.")


def signal_name(signal: Signal | str) -> str:
    return signal.value if isinstance(signal, Signal) else signal
