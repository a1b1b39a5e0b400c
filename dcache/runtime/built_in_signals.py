"""The built-in signals (dcache.actions.Signal), each a provider in the one registry (dcache.runtime.signal_providers).

Registered in the order the engine measures them (`dcache.runtime` imports this module, so the registry always holds
them). Each keeps its references in its own per-branch `view.memory`; the "computed" ones compare against the stack's
input, output and residual at the branch's previous computed call, which the meter keeps for every "computed"
provider (`view.last_hidden`, `last_output`, `last_residual`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dcache.kernels import residual_capture

from .block_io import bind_arguments
from .cache_state import UnitHistory
from .signal_providers import SignalProvider, register_built_in

if TYPE_CHECKING:
    from .signal_providers import ProviderView


# ---------------------------------------------------------------------------------------------------- stack input
def modulated_rel_l1(view: ProviderView) -> torch.Tensor | None:
    """relL1(mod_t, mod_prev_call) of the first block's timestep-modulated input (the adapter's `modulated_input`;
    the stack input where the family has none). The probe is compute an uncached call never does: counted."""
    mod = view.hidden
    fn = view.adapter.modulated_input
    if fn is not None:
        block, args, kwargs = view.first_block
        mod = view.counted(lambda: fn(block, bind_arguments(block, args, kwargs)))
    prev = view.memory.get("modulated")
    value = view.ops.rel_l1(mod, prev) if prev is not None and prev.shape == mod.shape else None
    view.memory["modulated"] = mod.detach()
    return value


def input_delta(view: ProviderView) -> torch.Tensor | None:
    """mean|x - x of the branch's previous call| (x: the stack input, or the latents in call scope)."""
    x = view.hidden
    prev = view.memory.get("input")
    value = (x - prev).abs().mean() if prev is not None and prev.shape == x.shape else None
    view.memory["input"] = x
    return value


# ---------------------------------------------------------------------------------------------------- probe output
def probe_rel_l1(view: ProviderView) -> torch.Tensor | None:
    """relL1(r_t, r_ref): the probe blocks' residual against the one at the branch's last computed call."""
    ref = view.memory.get("reference")
    return view.ops.rel_l1(view.residual, ref) if ref is not None and ref.shape == view.residual.shape else None


def keep_probe_reference(view: ProviderView) -> None:
    """Refreshed only on computed calls (FBCache: the difference accumulates since)."""
    view.memory["reference"] = view.residual.detach()


def forecast_error(view: ProviderView) -> torch.Tensor | None:
    """relL1(probe residual, its Taylor forecast from the branch's computed calls)."""
    history = view.memory.get("history")
    if history is None or history.filled <= 1 or not history.matches([view.residual]):
        return None
    return view.ops.rel_l1(view.residual, history.forecast(view.step)[0])


def keep_probe_history(view: ProviderView) -> None:
    history = view.memory.get("history")
    if history is None:
        history = view.memory["history"] = UnitHistory(max(view.order, 1))
    history.update([view.residual], view.step)


# ---------------------------------------------------------------------------------------------------- computed
def _residual_stats(view: ProviderView) -> torch.Tensor:
    """One fused reduction for both residual signals: [sum|r-prev|, sum|prev|, sum r^2, sum prev^2, mean token norm
    ratio] of R = v - x against the last computed call's."""
    stats = view.shared.get("residual_capture")
    if stats is None:
        _, stats = residual_capture(view.output, view.hidden, prev=view.last_residual)
        view.shared["residual_capture"] = stats
    return stats


def _has_last_residual(view: ProviderView) -> bool:
    return view.last_residual is not None and view.last_residual.shape == view.residual.shape


def residual_norm_ratio(view: ProviderView) -> torch.Tensor | None:
    """mean over tokens of ||R_t|| / ||R_last_compute||."""
    return _residual_stats(view)[4:5] if _has_last_residual(view) else None


def residual_rel_l1(view: ProviderView) -> torch.Tensor | None:
    """relL1(R_t, R_last_compute), as [numerator, denominator]."""
    return _residual_stats(view)[0:2] if _has_last_residual(view) else None


def _mean_change(now: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor | None:
    """mean|now - last| as [1]; None before a last value of the same shape."""
    return (now - last).abs().mean().reshape(1) if last is not None and last.shape == now.shape else None


def output_delta(view: ProviderView) -> torch.Tensor | None:
    """mean|v_t - v_last_compute|."""
    return _mean_change(view.output, view.last_output)


def input_delta_computed(view: ProviderView) -> torch.Tensor | None:
    """mean|x_t - x_last_compute|."""
    return _mean_change(view.hidden, view.last_hidden)


def output_mean(view: ProviderView) -> torch.Tensor:
    """mean|v_t|."""
    return view.output.abs().mean().reshape(1)


# A change reads 1e-9 when nothing changed (not 0: a schedule may divide by it); a ratio or a mean reads 1.
MODULATED_REL_L1 = register_built_in(SignalProvider("modulated_rel_l1", modulated_rel_l1, phase="stack_input",
                                                    compute="modulated_input", doc=modulated_rel_l1.__doc__))
INPUT_DELTA = register_built_in(SignalProvider("input_delta", input_delta, phase="stack_input", latents=True,
                                               doc=input_delta.__doc__))
PROBE_REL_L1 = register_built_in(SignalProvider("probe_rel_l1", probe_rel_l1, phase="probe_output",
                                                keep=keep_probe_reference, doc=probe_rel_l1.__doc__))
FORECAST_ERROR = register_built_in(SignalProvider("forecast_error", forecast_error, phase="probe_output",
                                                  keep=keep_probe_history, doc=forecast_error.__doc__))
RESIDUAL_NORM_RATIO = register_built_in(SignalProvider("residual_norm_ratio", residual_norm_ratio, quiet=1.0,
                                                       phase="computed", doc=residual_norm_ratio.__doc__))
RESIDUAL_REL_L1 = register_built_in(SignalProvider("residual_rel_l1", residual_rel_l1, phase="computed",
                                                   doc=residual_rel_l1.__doc__))
OUTPUT_DELTA = register_built_in(SignalProvider("output_delta", output_delta, phase="computed",
                                                doc=output_delta.__doc__))
INPUT_DELTA_COMPUTED = register_built_in(SignalProvider("input_delta_computed", input_delta_computed,
                                                        phase="computed", doc=input_delta_computed.__doc__))
OUTPUT_MEAN = register_built_in(SignalProvider("output_mean", output_mean, quiet=1.0, phase="computed",
                                               doc=output_mean.__doc__))
