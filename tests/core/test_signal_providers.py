"""Signal providers (dcache.runtime.signal_providers): a signal a method brings with it, measured by the engine at
every call of a schedule that lists it, without the core naming it. Reference: the same quantity computed directly from
the inputs the test passed."""

from __future__ import annotations

import pytest
import toy_models as toy
import torch

import dcache
from dcache import Action, Schedule, SignalProvider, register_signal
from dcache.runtime import signal_providers

STEPS = 4


def _mean_change(view):
    """mean|x - x_prev| / mean|x_prev| of the call's hidden_states, as [numerator, denominator]."""
    x = view.arguments["hidden_states"]
    prev = view.memory.get("x")
    view.memory["x"] = x.clone()
    if prev is None:
        return None  # a branch's first call has nothing to compare with
    return torch.stack([(x - prev).abs().mean(), prev.abs().mean()])


@pytest.fixture
def mean_change():
    name = register_signal(SignalProvider("test_mean_change", _mean_change, quiet=0.0))
    yield name
    signal_providers._PROVIDERS.pop(name)  # the registry is global: leave it as the suite found it


class _Recorder(Schedule):
    """Keeps the provider's value at every decision; answers one action for every call."""

    def __init__(self, signal, action=Action.COMPUTE):
        self.signals = frozenset({signal})
        self.signal, self.action, self.seen = signal, action, []

    def decide(self, ctx):
        self.seen.append(ctx.signals.get(self.signal))
        return self.action


def _expected():
    xs = [toy.toy_inputs(s, STEPS)["hidden_states"] for s in range(STEPS)]
    return [None] + [float((xs[i] - xs[i - 1]).abs().mean() / xs[i - 1].abs().mean()) for i in range(1, STEPS)]


@pytest.mark.parametrize("scope, action", [("blocks", Action.COMPUTE), ("call", Action.REUSE)])
def test_provider_values_reach_decide_and_the_record(mean_change, scope, action):
    model = toy.ToyTransformer()
    schedule = _Recorder(mean_change, action)
    with dcache.apply(model, schedule, num_steps=STEPS, scope=scope) as handle, torch.no_grad():
        for s in range(STEPS):
            model(**toy.toy_inputs(s, STEPS))
        bstate = handle.engine.branches["call0"]
        kept = bstate.provided[mean_change]["x"]  # the provider's reference counts as cache memory
        assert bstate.nbytes == sum(h.nbytes for h in bstate.units.values()) + kept.numel() * kept.element_size()
        recorded = [c.signals.get(mean_change) for c in handle.engine.record.calls]
    expected = _expected()
    assert schedule.seen[0] is None and recorded[0] is None
    assert schedule.seen[1:] == pytest.approx(expected[1:], rel=1e-6)
    assert recorded[1:] == schedule.seen[1:]  # pre signals are recorded with the call's actions
    if action is Action.REUSE:  # measured on reused calls too (call scope: before the transformer would run)
        assert [c.actions for c in handle.engine.record.calls] == ["C"] + ["R"] * (STEPS - 1)


def test_unknown_signals_and_built_in_names_are_refused():
    model = toy.ToyTransformer()
    with pytest.raises(ValueError, match="register_signal"):
        dcache.apply(model, _Recorder("no_such_signal"))
    assert getattr(model, "_dcache_engine", None) is None
    with pytest.raises(ValueError, match="measured by the engine"):
        register_signal(SignalProvider("input_delta", _mean_change))
