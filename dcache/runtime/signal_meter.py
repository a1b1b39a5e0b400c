"""Measuring the signals a schedule reads, and bringing them to the host once per call.

Every signal, built-in or a method's own, is a provider of dcache.runtime.signal_providers: the meter asks the
registry for those the schedule lists and calls each at its phase. Pre signals are measured on this call before the
decision: the "call" providers on the call's arguments (`measure_providers`), the "stack_input" ones on the stack
input (`on_stack_input`; call scope: those with `latents` on the latents, `on_latents`), the "probe_output" ones on
the probe blocks' residual (`on_probe_output`; their references refresh in `after_probe_decision`). The "computed"
providers are measured after a computed call (`measure_post`) and delivered with the branch's next decision. Every
value stays a device tensor ([1], or [2] = numerator and denominator) until `read`, which moves all of them in one
transfer (`flush` does the same for the post signals still pending when a generation ends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..actions import Signal
from .call_state import RESUMED, BlockSlot, CallState
from .parallel import sync_signals
from .signal_providers import ProviderView, SignalProvider, providers_for, resolve_signal
from .cache_state import BranchState
from .block_io import bind_arguments

if TYPE_CHECKING:  # the runtime builds its meter
    from .call_runtime import CallRuntime

_EPS = 1e-12


class SignalMeter:
    def __init__(self, runtime: CallRuntime):
        self.runtime = runtime
        self.refresh()

    def refresh(self) -> None:
        """Read the schedule's `signals` (a schedule may change them between generations: MagCache stops measuring
        once calibrated) and take their providers from the registry."""
        self.wanted = frozenset(resolve_signal(s) for s in self.runtime.schedule.signals)
        listed = providers_for(self.wanted)
        phase = {name: tuple(p for p in listed if p.phase == name) for name in
                 ("call", "stack_input", "probe_output", "computed")}
        self.providers = phase["call"]  # before the call
        self.stack_providers = phase["stack_input"]
        self.latent_providers = tuple(p for p in self.stack_providers if p.latents)  # call scope's stack input
        self.probe_providers = phase["probe_output"]
        self.post_providers = phase["computed"]
        self.vectors = frozenset(p.name for p in listed if p.vector)  # values read as tuples of floats
        # recorded with the call's decision
        self.pre = frozenset(resolve_signal(p.name) for p in listed if p.phase != "computed")

    # ------------------------------------------------------------------------------------------------ pre signals
    def measure_providers(self, call: CallState, args: tuple, kwargs: dict) -> None:
        """The "call" providers the schedule lists, on the call's arguments (before any block runs)."""
        self._measure(self.providers, call, call.pre)

    def _measure(self, providers: tuple[SignalProvider, ...], call: CallState, into: dict[str, Any],
                 **seen: Any) -> None:
        """Call each provider on a view of this call (`seen`: the tensors of its phase); a value goes into `into`."""
        shared: dict[str, Any] = {}  # one fused reduction may serve several providers
        for p in providers:
            value = p.measure(self._view(p, call, shared, **seen))
            if value is not None:
                into[p.name] = value

    def _view(self, p: SignalProvider, call: CallState, shared: dict[str, Any], **seen: Any) -> ProviderView:
        runtime = self.runtime
        args, kwargs = runtime.call_inputs or ((), {})

        def bind() -> dict[str, Any]:
            if call.arguments is None:  # bound once per call, whichever phases read them
                call.arguments = bind_arguments(runtime.transformer, args, kwargs)
            return call.arguments

        record = call.record
        return ProviderView(args, runtime.adapter, runtime.schedule, call.step, record.num_steps, record.timesteps,
                            call.bstate.provided.setdefault(p.name, {}), runtime.transformer, ops=runtime.ops,
                            order=runtime.order, shared=shared, bind=bind,
                            count=self._counter(p, call, seen.get("hidden")), **seen)

    def _counter(self, p: SignalProvider, call: CallState,
                 hidden: torch.Tensor | None) -> Callable[[Callable[[], Any]], Any] | None:
        """`view.counted` of a provider that runs model work: its FLOPs go into the call's computed FLOPs."""
        if p.compute is None or hidden is None:
            return None
        flops, key, shape = self.runtime.flops, p.compute, tuple(hidden.shape)

        def count(fn: Callable[[], Any]) -> Any:
            counter = flops.start(key, shape)
            out = fn()
            flops.stop(counter, key, shape)
            call.flops_computed += flops.cost(key, shape) or 0.0
            return out

        return count

    def on_stack_input(self, call: CallState, slot: BlockSlot, hidden: torch.Tensor, args: tuple,
                       kwargs: dict) -> None:
        call.stack_input = hidden
        if call.record.input_shape is None:
            call.record.input_shape = tuple(hidden.shape)
        if self.stack_providers:
            self._measure(self.stack_providers, call, call.pre, hidden=hidden.detach(),
                          first_block=(slot.block, args, kwargs))

    def on_latents(self, call: CallState, x: torch.Tensor) -> None:
        """Call scope: the "stack_input" providers that read the latents, on the call's latent input x."""
        self._measure(self.latent_providers, call, call.pre, hidden=x)

    def on_probe_output(self, call: CallState, hidden_out: torch.Tensor) -> torch.Tensor | None:
        """The probe blocks' residual (their output minus the stack input), or None; measures the "probe_output"
        providers on it."""
        stack_in = call.stack_input
        if stack_in is None or stack_in.shape != hidden_out.shape or call.phase == RESUMED:
            return None  # a resumed call (dcache.runtime.lanes) measured its probe when it decided
        residual = hidden_out - stack_in
        if self.probe_providers:
            self._measure(self.probe_providers, call, call.pre, residual=residual)
        return residual

    def after_probe_decision(self, call: CallState, residual: torch.Tensor | None) -> None:
        """A computed call refreshes the probe providers' references (`keep`: FBCache's difference accumulates since
        the last computed call)."""
        if residual is None or call.actions is None or "C" not in call.actions[:1]:
            return
        for p in self.probe_providers:
            if p.keep is not None:
                p.keep(self._view(p, call, {}, residual=residual))

    # ------------------------------------------------------------------------------------------------ post signals
    def measure_post(self, call: CallState) -> None:
        """After a computed call: x = stack input, v = stack output, R = v - x; the "computed" providers compare them
        against the branch's last computed call's, which this call's then replace."""
        x, v = call.stack_input, call.stack_output
        if not self.post_providers or x is None or v is None:
            return
        bstate = call.bstate
        if v.shape != x.shape:  # hidden stream changed length across lists: compare the image (tail) tokens
            x = x[:, -v.shape[1]:] if x.shape[1] > v.shape[1] else x
            if v.shape != x.shape:
                return
        residual = v - x
        pending: dict[str, torch.Tensor] = {}
        self._measure(self.post_providers, call, pending, hidden=x.detach(), output=v.detach(),
                      residual=residual.detach(), last_hidden=bstate.input_at_compute,
                      last_output=bstate.output_at_compute, last_residual=bstate.residual_at_compute)
        bstate.residual_at_compute = residual.detach()
        bstate.input_at_compute = x.detach()
        bstate.output_at_compute = v.detach()
        bstate.pending_post = pending

    # ------------------------------------------------------------------------------------------------ host transfer
    def read(self, call: CallState) -> dict[Signal | str, float]:
        """One host transfer for everything the schedule reads this call (pre signals + pending post signals);
        keyed by Signal (built-in) or name (provider)."""
        bstate = call.bstate
        names = list(call.pre)
        tensors = list(call.pre.values())
        names.extend(bstate.pending_post)
        tensors.extend(bstate.pending_post.values())
        if not tensors:
            return {resolve_signal(k): v for k, v in bstate.post_values.items()}
        values = self._to_host(names, tensors)
        post = {k: v for k, v in values.items() if k in bstate.pending_post}
        if post:
            self._deliver_post(bstate, post)
        merged = dict(bstate.post_values)
        merged.update(values)
        return {resolve_signal(k): v for k, v in merged.items()}

    def peek_post(self, bstate: BranchState) -> dict[Signal | str, float]:
        """The post signals the branch's next decision will read (`read` with no pre signals), without delivering
        them: a follower asks a copy of the schedule for that decision ahead of the call (controlnet='follow').
        One host transfer when values are pending; the branch's state is untouched."""
        values = {**bstate.post_values, **self._pending_on_host(bstate)}
        return {resolve_signal(k): v for k, v in values.items()}

    def flush(self, bstate: BranchState) -> None:
        """Bring the post signals still pending at a generation's end to the host (calibration reads them from the
        record)."""
        if bstate.pending_post:
            self._deliver_post(bstate, self._pending_on_host(bstate))

    def _pending_on_host(self, bstate: BranchState) -> dict[str, Any]:
        """The branch's pending post signals as host values (one transfer; {} when none are pending)."""
        if not bstate.pending_post:
            return {}
        names = list(bstate.pending_post)
        return self._to_host(names, [bstate.pending_post[k] for k in names])

    def _to_host(self, names: list[str], tensors: list[torch.Tensor]) -> dict[str, Any]:
        """{name: value}; a [2] tensor is (numerator, denominator), a vector provider's value a tuple of floats.
        Context parallel: the ranks' global values."""
        tensors = [t.reshape(-1).float() for t in tensors]
        flat = torch.cat([t.to(tensors[0].device) for t in tensors])
        flat = sync_signals(flat, tensors, self.runtime.transformer).tolist()
        values: dict[str, float] = {}
        i = 0
        for name, t in zip(names, tensors):
            n = t.numel()
            chunk = flat[i:i + n]
            i += n
            if name in self.vectors:
                values[name] = tuple(chunk)
            else:
                values[name] = chunk[0] / max(chunk[1], _EPS) if n == 2 else chunk[0]
        return values

    @staticmethod
    def _deliver_post(bstate: BranchState, post: dict[str, float]) -> None:
        bstate.post_values = post
        bstate.pending_post = {}
        if bstate.pending_call is not None:  # the computed call they were measured after
            bstate.pending_call.signals.update(post)
