"""What the engine can do with a unit, at which granularity, and which signals a schedule may ask for."""

from __future__ import annotations

from enum import Enum


class Action(str, Enum):
    """One character each, so a call's decisions are a short string ("CCRRF...") and plans stay readable."""

    COMPUTE = "C"  # run the unit; refresh its cache
    REUSE = "R"  # unit output = unit input + cached residual (blocks, stack) or the cached output (modules)
    FORECAST = "F"  # like REUSE but with a Taylor extrapolation of the cached history over the steps since computed


ACTION_CHARS = frozenset(a.value for a in Action)


class Granularity(str, Enum):
    STACK = "stack"  # one unit: the blocks between the probe (front) and tail (back) blocks, reused as one residual
    BLOCK = "block"  # one unit per transformer block, in execution order across block lists
    MODULE = "module"  # one unit per (block, inner module), e.g. attention / feed-forward


class Signal(str, Enum):
    """Scalars the engine measures for dynamic schedules; each is computed only if the schedule asks for it. Each is a
    provider in the registry of dcache.runtime.signal_providers (measured by dcache.runtime.built_in_signals); a
    method that needs another signal registers a provider of its own there and lists the provider's name.

    Available to `decide` (measured on this call before the decision):
      MODULATED_REL_L1   relL1(mod_t, mod_prev_call): first block's timestep-modulated input (TeaCache).
      PROBE_REL_L1       relL1(r_t, r_ref): residual of the probe (front) blocks vs the one at the last computed
                         call of this branch (FBCache / DBCache).
      INPUT_DELTA        mean|x_t - x_prev_call| of the stack input hidden states (EasyCache).
      FORECAST_ERROR     relL1(probe output, its Taylor forecast) (CG-Taylor gate).
    Measured after a computed call, delivered with the next call of the same branch (no extra host sync):
      OUTPUT_DELTA       mean|v_t - v_last_compute| of the stack output hidden states (EasyCache's k numerator).
      INPUT_DELTA_COMPUTED  mean|x_t - x_last_compute| of the stack input between computed calls (k denominator).
      OUTPUT_MEAN        mean|v_t| of the stack output.
      RESIDUAL_NORM_RATIO  mean over tokens of ||R_t|| / ||R_last_compute|| (MagCache calibration).
      RESIDUAL_REL_L1    relL1(R_t, R_last_compute) of the stack residual.
    """

    MODULATED_REL_L1 = "modulated_rel_l1"
    PROBE_REL_L1 = "probe_rel_l1"
    INPUT_DELTA = "input_delta"
    FORECAST_ERROR = "forecast_error"
    OUTPUT_DELTA = "output_delta"
    INPUT_DELTA_COMPUTED = "input_delta_computed"
    OUTPUT_MEAN = "output_mean"
    RESIDUAL_NORM_RATIO = "residual_norm_ratio"
    RESIDUAL_REL_L1 = "residual_rel_l1"


PRE_SIGNALS = frozenset({Signal.MODULATED_REL_L1, Signal.PROBE_REL_L1, Signal.INPUT_DELTA, Signal.FORECAST_ERROR})
POST_SIGNALS = frozenset(Signal) - PRE_SIGNALS
