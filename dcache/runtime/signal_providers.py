"""Signals that a method brings with it: a registry of providers, so the core measures them without naming them.

The engine measures the built-in signals (`dcache.actions.Signal`) itself. A method that decides from something
else registers a provider from its own file:

    SHARPNESS = register_signal(SignalProvider("sharpness", measure_sharpness, doc="..."))

    class MySchedule(Schedule):
        signals = frozenset({SHARPNESS})        # the engine calls the provider only while a schedule lists it
        def decide(self, ctx):
            s = ctx.signals.get(SHARPNESS)      # None where the provider had no value (e.g. a branch's first call)

When the engine calls `provider.measure(view)` depends on the provider's `phase`:
  "call"         at every transformer call, before anything of the transformer runs: `view.arguments` are the
                 call's arguments (also available with scope="call");
  "stack_input"  at every call, when the block stack's input is known, before the decision: `view.hidden` is the
                 stack input [B, L, D] (blocks scope only);
  "computed"     after every computed call: `view.hidden` / `view.output` are the stack's input and output (in
                 call scope the call's latent input x and output v); the value reaches the branch's *next* decision,
                 like the built-in post signals.
The view also carries the adapter, the model, the schedule (a provider reads its own method's knobs there), the step
and a per-branch `memory` dict that lives as long as the branch's cache (the provider keeps its references there;
their bytes count as the cache's "signals" memory). A provider returns a tensor on the model's device, shape [1]
(the value) or [2] (numerator, denominator: the value is num / max(den, 1e-12)), or None; a `vector` provider
returns shape [n] and the schedule reads a tuple of n floats (e.g. one value per chunk of a video's frames). All of
a call's signals reach the host in one transfer at the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..actions import Signal

_BUILT_IN = {s.value: s for s in Signal}  # name -> Signal (without Enum's by-value lookup)


@dataclass
class ProviderView:
    """One transformer call, as a signal provider sees it (see the phases above)."""

    arguments: dict[str, Any]  # the transformer forward's arguments by name
    args: tuple  # the positional arguments as passed
    adapter: Any  # the transformer's dcache.model.adapters.Adapter (e.g. `adapter.latents`)
    schedule: Any  # the schedule that asked for the signal
    step: int
    num_steps: int | None
    timesteps: tuple[float, ...] | None
    memory: dict[str, Any]  # per branch and provider, kept across the branch's calls of one generation
    model: Any = None  # the transformer
    hidden: torch.Tensor | None = None  # phases "stack_input" and "computed": the stack input [B, L, D]
    output: torch.Tensor | None = None  # phase "computed": the stack output [B, L, D]


@dataclass(frozen=True)
class SignalProvider:
    name: str  # the key a schedule lists in `signals` and reads from `CallContext.signals`
    measure: Callable[[ProviderView], torch.Tensor | None]
    quiet: float = 1e-9  # the value that means "nothing changed" (dcache.memory.estimate's no-change simulation)
    doc: str = ""
    phase: str = "call"  # "call" | "stack_input" | "computed" (when it is measured: see the module docstring)
    vector: bool = False  # True: the value is a tuple of floats (a tensor of shape [n]), not one number


_PROVIDERS: dict[str, SignalProvider] = {}
PHASES = ("call", "stack_input", "computed")


def register_signal(provider: SignalProvider) -> str:
    """Register (or replace, e.g. on a module reload) a provider; returns its name for the schedule's `signals`."""
    if not isinstance(provider, SignalProvider) or not isinstance(provider.name, str) or not provider.name:
        raise TypeError(f"register_signal takes a SignalProvider with a non-empty str name, not {provider!r}.")
    if provider.phase not in PHASES:
        raise ValueError(f"signal provider {provider.name!r} has phase={provider.phase!r}; use one of {PHASES} "
                         f"(before the call, at the stack input, or after a computed call).")
    if provider.name in _BUILT_IN:
        raise ValueError(f"signal {provider.name!r} is measured by the engine (dcache.actions.Signal); give the "
                         f"provider another name.")
    _PROVIDERS[provider.name] = provider
    return provider.name


def provider(name: str) -> SignalProvider | None:
    return _PROVIDERS.get(name)


def provider_names(phase: str | None = None) -> frozenset[str]:
    """Registered provider names (of one phase, or all)."""
    return frozenset(n for n, p in _PROVIDERS.items() if phase is None or p.phase == phase)


def resolve_signal(signal: Any, where: str = "a schedule's `signals`") -> Signal | str:
    """A built-in `Signal`, or the name of a registered provider; anything else is refused with the fix."""
    name = signal.value if isinstance(signal, Signal) else signal
    if isinstance(name, str):
        if name in _BUILT_IN:
            return _BUILT_IN[name]
        if name in _PROVIDERS:
            return name
    known = sorted(_BUILT_IN) + sorted(_PROVIDERS)
    raise ValueError(f"{where} lists {signal!r}, which is neither a built-in signal nor a registered provider "
                     f"({', '.join(known)}); register it with dcache.runtime.signal_providers.register_signal in the "
                     f"file that defines the method, and import that file before applying.")


def signal_name(signal: Signal | str) -> str:
    return signal.value if isinstance(signal, Signal) else signal
