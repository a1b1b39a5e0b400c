"""Measuring the signals a schedule reads, and bringing them to the host once per call.

Pre signals are measured on this call before the decision: the "call" providers from the call's arguments
(`measure_providers`, dcache.runtime.signal_providers), MODULATED_REL_L1 / INPUT_DELTA and the "stack_input" providers
on the stack input (`on_stack_input`), PROBE_REL_L1 / FORECAST_ERROR on the probe blocks' output (`on_probe_output`).
Post signals (built-in, and the "computed" providers) are measured after a computed call (`measure_post`) and
delivered with the branch's next decision. Every value stays a
device tensor ([1], or [2] = numerator and denominator) until `read`, which moves all of them in one transfer
(`flush` does the same for the post signals still pending when a generation ends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dcache.kernels import residual_capture

from ..actions import POST_SIGNALS, PRE_SIGNALS, Signal
from .call_state import RESUMED, BlockSlot, CallState
from .parallel import sync_signals
from .signal_providers import ProviderView, provider, resolve_signal
from .cache_state import BranchState, UnitHistory
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
        once calibrated)."""
        self.wanted = frozenset(resolve_signal(s) for s in self.runtime.schedule.signals)
        listed = tuple(p for s in sorted(s for s in self.wanted if not isinstance(s, Signal))
                       if (p := provider(s)) is not None)
        self.providers = tuple(p for p in listed if p.phase == "call")  # before the call
        self.stack_providers = tuple(p for p in listed if p.phase == "stack_input")
        self.post_providers = tuple(p for p in listed if p.phase == "computed")
        self.vectors = frozenset(p.name for p in listed if p.vector)  # values read as tuples of floats
        # recorded with the call's decision
        self.pre = PRE_SIGNALS | frozenset(p.name for p in self.providers + self.stack_providers)

    # ------------------------------------------------------------------------------------------------ pre signals
    def measure_providers(self, call: CallState, args: tuple, kwargs: dict) -> None:
        """The "call" providers the schedule lists, on the call's arguments (before any block runs)."""
        self._measure(self.providers, call, call.pre)

    def _measure(self, providers: tuple, call: CallState, into: dict, hidden: torch.Tensor | None = None,
                 output: torch.Tensor | None = None) -> None:
        runtime = self.runtime
        args, kwargs = runtime.call_inputs or ((), {})
        if call.arguments is None:  # bound once per call, whichever phases measure
            call.arguments = bind_arguments(runtime.transformer, args, kwargs)
        record = call.record
        for p in providers:
            memory = call.bstate.provided.setdefault(p.name, {})
            view = ProviderView(call.arguments, args, runtime.adapter, runtime.schedule, call.step, record.num_steps,
                                record.timesteps, memory, runtime.transformer, hidden, output)
            value = p.measure(view)
            if value is not None:
                into[p.name] = value

    def on_stack_input(self, call: CallState, slot: BlockSlot, hidden: torch.Tensor, args: tuple,
                       kwargs: dict) -> None:
        runtime = self.runtime
        call.stack_input = hidden
        bstate = call.bstate
        if call.record.input_shape is None:
            call.record.input_shape = tuple(hidden.shape)
        if Signal.MODULATED_REL_L1 in self.wanted:
            fn = runtime.adapter.modulated_input
            mod = hidden
            if fn is not None:  # the probe (e.g. block 0's AdaLN) is compute an uncached call never does: count it
                flops = runtime.flops
                key, shape = "modulated_input", tuple(hidden.shape)
                counter = flops.start(key, shape)
                mod = fn(slot.block, bind_arguments(slot.block, args, kwargs))
                flops.stop(counter, key, shape)
                call.flops_computed += flops.cost(key, shape) or 0.0
            if bstate.prev_modulated is not None and bstate.prev_modulated.shape == mod.shape:
                call.pre[Signal.MODULATED_REL_L1] = runtime.ops.rel_l1(mod, bstate.prev_modulated)
            bstate.prev_modulated = mod.detach()
        if Signal.INPUT_DELTA in self.wanted:
            self.input_delta(call, hidden.detach())
        if self.stack_providers:
            self._measure(self.stack_providers, call, call.pre, hidden=hidden.detach())

    def input_delta(self, call: CallState, x: torch.Tensor) -> None:
        """INPUT_DELTA = mean|x - x of the branch's previous call| (x: the stack input, or the latents in call
        scope); x becomes the next call's reference."""
        bstate = call.bstate
        if bstate.prev_input is not None and bstate.prev_input.shape == x.shape:
            call.pre[Signal.INPUT_DELTA] = (x - bstate.prev_input).abs().mean()
        bstate.prev_input = x

    def on_probe_output(self, call: CallState, hidden_out: torch.Tensor) -> torch.Tensor | None:
        """The probe blocks' residual (their output minus the stack input), or None; measures PROBE_REL_L1 and
        FORECAST_ERROR against the branch's references."""
        bstate = call.bstate
        stack_in = call.stack_input
        if stack_in is None or stack_in.shape != hidden_out.shape or call.phase == RESUMED:
            return None  # a resumed call (dcache.runtime.lanes) measured its probe when it decided
        residual = hidden_out - stack_in
        rel_l1 = self.runtime.ops.rel_l1
        if Signal.PROBE_REL_L1 in self.wanted and bstate.probe_ref is not None \
                and bstate.probe_ref.shape == residual.shape:
            call.pre[Signal.PROBE_REL_L1] = rel_l1(residual, bstate.probe_ref)
        if Signal.FORECAST_ERROR in self.wanted and bstate.probe_history is not None \
                and bstate.probe_history.filled > 1 and bstate.probe_history.matches([residual]):
            predicted = bstate.probe_history.forecast(call.step)[0]
            call.pre[Signal.FORECAST_ERROR] = rel_l1(residual, predicted)
        return residual

    def after_probe_decision(self, call: CallState, residual: torch.Tensor | None) -> None:
        """Probe references refresh only on computed calls (FBCache semantics: the diff accumulates since)."""
        if residual is None or call.actions is None or "C" not in call.actions[:1]:
            return
        bstate = call.bstate
        if Signal.PROBE_REL_L1 in self.wanted:
            bstate.probe_ref = residual.detach()
        if Signal.FORECAST_ERROR in self.wanted:
            if bstate.probe_history is None:
                bstate.probe_history = UnitHistory(max(self.runtime.order, 1))
            bstate.probe_history.update([residual], call.step)

    # ------------------------------------------------------------------------------------------------ post signals
    def measure_post(self, call: CallState) -> None:
        """After a computed call: x = stack input, v = stack output, R = v - x, against the last computed call's."""
        wanted = self.wanted & POST_SIGNALS
        x, v = call.stack_input, call.stack_output
        if not (wanted or self.post_providers) or x is None or v is None:
            return
        bstate = call.bstate
        if v.shape != x.shape:  # hidden stream changed length across lists: compare the image (tail) tokens
            x = x[:, -v.shape[1]:] if x.shape[1] > v.shape[1] else x
            if v.shape != x.shape:
                return
        residual = v - x
        pending: dict[str, torch.Tensor] = {}
        prev_r = bstate.residual_at_compute
        if ({Signal.RESIDUAL_NORM_RATIO, Signal.RESIDUAL_REL_L1} & wanted) and prev_r is not None \
                and prev_r.shape == residual.shape:
            _, stats = residual_capture(v, x, prev=prev_r)
            # stats = [sum|r-prev|, sum|prev|, sum r^2, sum prev^2, mean token norm ratio]
            if Signal.RESIDUAL_NORM_RATIO in wanted:
                pending[Signal.RESIDUAL_NORM_RATIO.value] = stats[4:5]
            if Signal.RESIDUAL_REL_L1 in wanted:
                pending[Signal.RESIDUAL_REL_L1.value] = stats[0:2]
        if Signal.OUTPUT_DELTA in wanted and bstate.output_at_compute is not None \
                and bstate.output_at_compute.shape == v.shape:
            pending[Signal.OUTPUT_DELTA.value] = (v - bstate.output_at_compute).abs().mean().reshape(1)
        if Signal.INPUT_DELTA_COMPUTED in wanted and bstate.input_at_compute is not None \
                and bstate.input_at_compute.shape == x.shape:
            pending[Signal.INPUT_DELTA_COMPUTED.value] = (x - bstate.input_at_compute).abs().mean().reshape(1)
        if Signal.OUTPUT_MEAN in wanted:
            pending[Signal.OUTPUT_MEAN.value] = v.abs().mean().reshape(1)
        if self.post_providers:
            self._measure(self.post_providers, call, pending, hidden=x.detach(), output=v.detach())
        bstate.residual_at_compute = residual.detach()
        bstate.input_at_compute = x.detach()
        bstate.output_at_compute = v.detach()
        bstate.pending_post = pending

    # ------------------------------------------------------------------------------------------------ host transfer
    def read(self, call: CallState) -> dict[Signal | str, float]:
        """One host transfer for everything the schedule reads this call (pre signals + pending post signals);
        keyed by Signal (built-in) or name (provider)."""
        bstate = call.bstate
        names = [s.value if isinstance(s, Signal) else s for s in call.pre]
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

    def flush(self, bstate: BranchState) -> None:
        """Bring the post signals still pending at a generation's end to the host (calibration reads them from the
        record)."""
        if bstate.pending_post:
            names = list(bstate.pending_post)
            self._deliver_post(bstate, self._to_host(names, [bstate.pending_post[k] for k in names]))

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
