"""TeaCache (arXiv 2411.19108): reuse the step residual while the rescaled modulated-input change stays small.

Per branch s (cond / uncond keep separate accumulators; the engine keeps their residuals apart):
    x_i   = relL1(mod_i, mod_{i-1})          the first block's timestep-modulated input vs the previous call of s
                                              (Signal.MODULATED_REL_L1; the engine refreshes mod on EVERY call)
    acc  += poly(x_i)                        poly = c0*x^4 + c1*x^3 + c2*x^2 + c3*x + c4 (per-model coefficients)
    reuse the cached stack residual while acc < threshold, else compute and reset acc = 0
The first `ret_steps` and the last `cutoff_steps` steps always compute (and reset acc).

Coefficients, in order of precedence: the `coefficients` knob; a calibration file (`calibration="cal.json"`,
written by `dcache.schedules.tuning.calibrate.calibrate_teacache`); the table registered for the model's identity
(`register_table("teacache", identity, entry)`; the published sets below). A table entry is either a list of 5
coefficients or a dict {"coefficients": [...], "threshold": t, "ret_steps": n, "ret_ratio": r, "cutoff_steps": m,
"source": "..."} whose optional fields give the model's recommended defaults; where one identity covers several
checkpoints with different coefficient sets, the entry is a list of such dicts with a "match" dict of extra config
values (e.g. CogVideoX 1.0 vs 1.5: {"patch_size_t": None} / {"patch_size_t": 2}).

Modulated input per family (dcache.model.families): FLUX / HunyuanVideo / LTX / Lumina / Mochi: the AdaLN-modulated
input of the first block, as in TeaCache. CogVideoX: the time embedding `emb`. Wan2.1: the block's `temb` =
timestep_proj, TeaCache's `e0`, so the Wan tables are the `use_ret_steps` sets (5 warm-up steps, last step not forced).
HiDream: the block's `temb` (timestep + pooled-text embedding; TeaCache used the timestep embedding alone).
The coefficients are fitted for one step count and resolution; thresholds do not transfer across step counts.
Entries written by calibrate_teacache carry the fitted x interval ("x_range"); outside it the estimate is extended
in proportion from the nearest end and kept >= 0 (see TeaCacheSchedule.estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from dcache import Action, CallContext, GenerationInfo, Granularity, MethodConfig, MethodSchedule, Schedule, Signal
from dcache import knob, register_method, register_preset
from dcache.files.checks import is_count, is_number

from .tables import (identity_from_config, known_identities, known_variants, lookup_table, model_identity,
                     register_table)

FALLBACK_THRESHOLD = 0.25  # used when neither the knob nor the model's table gives one


@register_method
@dataclass(frozen=True)
class TeaCacheConfig(MethodConfig):
    """TeaCache: reuse the step residual while the rescaled change of the modulated input stays small.

    Paper: Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model",
    https://arxiv.org/abs/2411.19108.

    Use it on a model with published or calibrated polynomial coefficients (`dcache calibrate --method teacache`);
    the signal needs the first block's modulated input, which the model family's adapter provides.

    Example (the bundled tiny model):
        >>> import dcache
        >>> from dcache.pipelines.bundled import load_tiny_pipeline
        >>> pipe = load_tiny_pipeline()
        >>> with dcache.apply(pipe, "teacache") as handle:
        ...     image = pipe("3").images[0]
    """

    method = "teacache"
    # `dcache calibrate --method teacache`: the polynomial fit, merged into a calibration file
    calibrator = ("table", "dcache.schedules.tuning.calibrate:calibrate_teacache")
    # `dcache estimate` on a bare config: coefficients that stand in for the model's (memory and FLOPs hold)
    estimate_placeholder = {"coefficients": [0.0, 0.0, 0.0, 1.0, 0.0]}
    # the knob and grid that speed= / quality= targets and `dcache estimate` sweep
    main_knob = ("threshold", (0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.2))
    threshold: float | None = knob(None, low=0.0, high=1e6, types=(float, int),
                                   doc="accumulated rescaled change below which the step residual is reused; None = "
                                       f"the model table's recommended value (else {FALLBACK_THRESHOLD}). Scales "
                                       "differ by model: FLUX 0.25-0.8, HunyuanVideo 0.1-0.15, Mochi 0.06-0.09")
    coefficients: tuple | None = knob(None, types=(tuple, list),
                                      doc="5 polynomial coefficients, highest power first (numpy.polyfit(x, y, 4)); "
                                          "None = calibration file, then the model's registered table")
    calibration: str | None = knob(None, types=(str,), doc="path of a calibration JSON (calibrate_teacache) to take "
                                                           "the coefficients from")
    variant: str = knob("default", doc="which registered table of the model's identity to use where one architecture "
                                       "has several (e.g. Wan2.1 I2V '480p' / '720p', FLUX 'kontext')")
    ret_steps: int | None = knob(None, low=0, high=100_000, types=(int,),
                                 doc="first steps always computed; None = the table's (else 1)")
    ret_ratio: float | None = knob(None, low=0.0, high=1.0, types=(float, int),
                                   doc="fraction of the first steps always computed (the larger of this and ret_steps "
                                       "applies); None = the table's (else 0)")
    cutoff_steps: int | None = knob(None, low=0, high=100_000, types=(int,),
                                    doc="last steps always computed; None = the table's (else 1)")
    max_skip_steps: int = knob(-1, low=-1, high=100_000, doc="most reused steps in a row (-1 = no limit; TeaCache has "
                                                              "none)")

    def check(self) -> None:
        if self.coefficients is not None:
            coeffs = tuple(self.coefficients)
            if len(coeffs) != 5 or any(isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c)
                                       for c in coeffs):
                raise self.invalid("coefficients", self.coefficients, "5 finite numbers, highest power first "
                                   "(c0*x^4 + c1*x^3 + c2*x^2 + c3*x + c4)")
            object.__setattr__(self, "coefficients", tuple(float(c) for c in coeffs))

    @staticmethod
    def check_calibration_table(table: Any) -> list[tuple[str, str]]:
        """[c0..c4] or {"coefficients": [c0..c4], "threshold", "ret_steps", "ret_ratio", "cutoff_steps",
        "x_range"}."""
        entry = table if isinstance(table, dict) else {"coefficients": table}
        coeffs = entry.get("coefficients")
        bad = []
        if not (isinstance(coeffs, (list, tuple)) and len(coeffs) == 5 and all(is_number(c) for c in coeffs)):
            bad.append(("table.coefficients", "5 finite polynomial coefficients, highest power first"))
        limits: dict[str, tuple[Callable[[Any], bool], str]] = {
            "threshold": (lambda v: is_number(v, 0.0) and v > 0, "a finite number > 0"),
            "ret_steps": (is_count, "an int >= 0"), "cutoff_steps": (is_count, "an int >= 0"),
            "ret_ratio": (lambda v: is_number(v, 0.0, 1.0), "a number in [0, 1]"),
            "x_range": (lambda v: isinstance(v, list) and len(v) == 2 and all(is_number(x) for x in v)
                        and v[0] < v[1], "[low, high] with low < high")}
        return bad + [(f"table.{k}", what) for k, (ok, what) in limits.items()
                      if entry.get(k) is not None and not ok(entry[k])]

    def build(self, model: nn.Module) -> Schedule:
        entry = resolve_entry(self, model)
        return TeaCacheSchedule(self, entry)


def poly4(coefficients: tuple[float, ...], x: float) -> float:
    """numpy.poly1d(coefficients)(x) for 5 coefficients, highest power first (Horner)."""
    y = 0.0
    for c in coefficients:
        y = y * x + c
    return y


def _normalize_entry(entry: Any) -> dict:
    if isinstance(entry, dict):
        return dict(entry)
    return {"coefficients": tuple(entry)}


def _matches(model: nn.Module, match: dict) -> bool:
    config = getattr(model, "config", {}) or {}
    for key, want in match.items():
        got = config.get(key) if hasattr(config, "get") else None
        if isinstance(got, list):
            got = tuple(got)
        if isinstance(want, list):
            want = tuple(want)
        if got != want:
            return False
    return True


def table_entry(model: nn.Module, variant: str = "default") -> dict | None:
    """The registered TeaCache entry of this model (None if there is none), candidates resolved by config."""
    table = lookup_table("teacache", model, variant)
    if table is None:
        return None
    if isinstance(table, list) and table and isinstance(table[0], dict):
        for candidate in table:
            if _matches(model, candidate.get("match", {})):
                return _normalize_entry(candidate)
        return None
    return _normalize_entry(table)


def resolve_entry(config: TeaCacheConfig, model: nn.Module) -> dict:
    """Coefficients and recommended defaults for `model`: knob > calibration file > registered table."""
    identity = model_identity(model)
    entry = table_entry(model, config.variant) or {}
    if config.calibration is not None:
        from .calibration_file import load_calibration

        found = load_calibration(config.calibration).find("teacache", identity=identity)
        if found is None:
            raise ValueError(f"TeaCacheConfig.calibration={config.calibration!r} has no TeaCache entry for "
                             f"{identity}; calibrate this model with calibrate_teacache(...) or pass "
                             f"coefficients=[...].")
        entry = {**entry, **_normalize_entry(found.table)}
    if config.coefficients is not None:  # explicit coefficients: no calibrated x_range applies to them
        entry = {**entry, "coefficients": config.coefficients, "x_range": None}
    if entry.get("coefficients") is None:
        variants = [v for v in known_variants("teacache", identity) if v != config.variant]
        hint = f" Registered variants of this model: {variants}; pass variant=..." if variants else ""
        raise ValueError(
            f"TeaCache needs polynomial coefficients for {identity}, and none is registered"
            f"{' under variant ' + repr(config.variant) if config.variant != 'default' else ''}.{hint} Known models: "
            f"{len(known_identities('teacache'))} (see dcache.schedules.teacache). Fit them once with "
            f"dcache.schedules.tuning.calibrate.calibrate_teacache(pipe, run_fn, path='cal.json') and pass "
            f"calibration='cal.json', or pass coefficients=[c0, c1, c2, c3, c4] (highest power first; "
            f"[0, 0, 0, 1, 0] accumulates the raw modulated-input change).")
    entry["coefficients"] = tuple(float(c) for c in entry["coefficients"])
    return entry


class TeaCacheSchedule(MethodSchedule):
    granularity = Granularity.STACK
    signals = frozenset({Signal.MODULATED_REL_L1})

    def __init__(self, config: TeaCacheConfig, entry: dict):
        super().__init__(config)
        self.coefficients: tuple[float, ...] = entry["coefficients"]
        # knob given > calibrated value > default; a null in the file means "not calibrated", like a missing key
        pick = lambda knob_value, key, default: next(v for v in (knob_value, entry.get(key), default) if v is not None)
        self.threshold = float(pick(config.threshold, "threshold", FALLBACK_THRESHOLD))
        self.ret_steps = int(pick(config.ret_steps, "ret_steps", 1))
        self.ret_ratio = float(pick(config.ret_ratio, "ret_ratio", 0.0))
        self.cutoff_steps = int(pick(config.cutoff_steps, "cutoff_steps", 1))
        self.source = entry.get("source", "")
        x_range = entry.get("x_range")  # calibrated entries: the x interval the polynomial was fitted on
        self.x_range = (float(x_range[0]), float(x_range[1])) if x_range and 0 < x_range[0] < x_range[1] else None
        self._acc: dict[str, list[float]] = {}

    def reset(self, generation: GenerationInfo) -> None:
        self._acc = {}

    def warmup(self, num_steps: int | None) -> int:
        ratio_steps = int(math.ceil(self.ret_ratio * num_steps - 1e-9)) if num_steps else 0
        return max(self.ret_steps, ratio_steps)

    def decide(self, ctx: CallContext) -> Action:
        acc = self._acc.setdefault(ctx.branch, [0.0, 0])  # accumulated estimate, reused steps in a row
        n = ctx.num_steps
        forced = ctx.step < max(self.warmup(n), 1) or (n is not None and ctx.step >= n - self.cutoff_steps)
        x = ctx.signals.get(Signal.MODULATED_REL_L1)
        if forced or x is None:
            acc[:] = [0.0, 0]
            return Action.COMPUTE
        acc[0] += self.estimate(x)
        limit = self.config.max_skip_steps
        if acc[0] < self.threshold and (limit < 0 or acc[1] < limit):
            acc[1] += 1
            return Action.REUSE
        acc[:] = [0.0, 0]
        return Action.COMPUTE

    def estimate(self, x: float) -> float:
        """poly(x); for a calibrated entry (with x_range), outside the fitted interval the estimate is scaled in
        proportion from the nearest end, poly(edge) * x / edge, and never negative: a degree-4 fit over a narrow
        interval is meaningless outside it (e.g. poly(0) < 0 would let the accumulator fall and reuse forever).
        Published coefficient sets have no x_range and are used as fitted, like the reference."""
        if self.x_range is None:
            return poly4(self.coefficients, x)
        lo, hi = self.x_range
        edge = min(max(x, lo), hi)
        y = poly4(self.coefficients, edge)
        if edge != x:
            y *= x / edge
        return max(y, 0.0)

    def config_dict(self) -> dict:
        return {**super().config_dict(), "effective": {
            "coefficients": list(self.coefficients), "threshold": self.threshold, "ret_steps": self.ret_steps,
            "ret_ratio": self.ret_ratio, "cutoff_steps": self.cutoff_steps, "source": self.source,
            "x_range": list(self.x_range) if self.x_range else None}}


# ------------------------------------------------------------------------------------------------------------------
# Published coefficient sets ([TC] ali-vilab/TeaCache 7c10efc; [DF] diffusers), highest power first. Identities come
# from the real checkpoints' transformer configs (only the size keys of schedules.tables matter); tests check them
# against meta-device builds of the diffusers classes.
# ------------------------------------------------------------------------------------------------------------------

def _identity(class_name: str, **config: Any) -> str:
    return identity_from_config(class_name, config)


_FLUX_DEV = _identity("FluxTransformer2DModel", num_layers=19, num_single_layers=38, num_attention_heads=24,
                      attention_head_dim=128, in_channels=64, joint_attention_dim=4096)
_HUNYUAN_VIDEO = _identity("HunyuanVideoTransformer3DModel", num_layers=20, num_single_layers=40,
                           num_attention_heads=24, attention_head_dim=128, in_channels=16)
_WAN_T2V_1_3B = _identity("WanTransformer3DModel", num_layers=30, num_attention_heads=12, attention_head_dim=128,
                          in_channels=16)
_WAN_T2V_14B = _identity("WanTransformer3DModel", num_layers=40, num_attention_heads=40, attention_head_dim=128,
                         in_channels=16)
_WAN_I2V_14B = _identity("WanTransformer3DModel", num_layers=40, num_attention_heads=40, attention_head_dim=128,
                         in_channels=36)
_COGVIDEOX_2B = _identity("CogVideoXTransformer3DModel", num_layers=30, num_attention_heads=30, attention_head_dim=64,
                          in_channels=16)
_COGVIDEOX_5B = _identity("CogVideoXTransformer3DModel", num_layers=42, num_attention_heads=48, attention_head_dim=64,
                          in_channels=16)
_COGVIDEOX_5B_I2V = _identity("CogVideoXTransformer3DModel", num_layers=42, num_attention_heads=48,
                              attention_head_dim=64, in_channels=32)
_CONSISID = _identity("ConsisIDTransformer3DModel", num_layers=42, num_attention_heads=48, attention_head_dim=64,
                      in_channels=32)
_MOCHI = _identity("MochiTransformer3DModel", num_layers=48, num_attention_heads=24, attention_head_dim=128,
                   in_channels=12)
_LTX_2B = _identity("LTXVideoTransformer3DModel", num_layers=28, num_attention_heads=32, attention_head_dim=64,
                    in_channels=128)
_LUMINA2 = _identity("Lumina2Transformer2DModel", num_layers=26, num_attention_heads=24, hidden_size=2304,
                     in_channels=16)
_HIDREAM_I1 = _identity("HiDreamImageTransformer2DModel", num_layers=16, num_single_layers=32, num_attention_heads=20,
                        attention_head_dim=128, in_channels=16)

FLUX_COEFFS = (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01)
FLUX_KONTEXT_COEFFS = (-1.04655119e03, 3.12563399e02, -1.69500694e01, 4.10995971e-01, 3.74537863e-02)
HUNYUAN_VIDEO_COEFFS = (7.33226126e+02, -4.01131952e+02, 6.75869174e+01, -3.14987800e+00, 9.61237896e-02)
COGVIDEOX_2B_COEFFS = (-3.10658903e+01, 2.54732368e+01, -5.92380459e+00, 1.75769064e+00, -3.61568434e-03)
COGVIDEOX_5B_COEFFS = (-1.53880483e+03, 8.43202495e+02, -1.34363087e+02, 7.97131516e+00, -5.23162339e-02)
COGVIDEOX15_5B_COEFFS = (2.50210439e+02, -1.65061612e+02, 3.57804877e+01, -7.81551492e-01, 3.58559703e-02)
COGVIDEOX15_5B_I2V_COEFFS = (1.22842302e+02, -1.04088754e+02, 2.62981677e+01, -3.06009921e-01, 3.71213220e-02)
MOCHI_COEFFS = (-3.51241319e+03, 8.11675948e+02, -6.09400215e+01, 2.42429681e+00, 3.05291719e-03)
LTX_COEFFS = (2.14700694e+01, -1.28016453e+01, 2.31279151e+00, 7.92487521e-01, 9.69274326e-03)
LUMINA_V1_COEFFS = (393.76566581, -603.50993606, 209.10239044, -23.00726601, 0.86377344)
LUMINA2_V2_COEFFS = (225.7042019806413, -608.8453716535591, 304.1869942338369, 124.21267720116742,
                     -1.4089066892956552)
HIDREAM_COEFFS = (-3.13605009e+04, -7.12425503e+02, 4.91363285e+01, 8.26515490e+00, 1.08053901e-01)
COSMOS_COEFFS = (2.71156237e+02, -9.19775607e+01, 2.24437250e+00, 2.08355751e+00, 1.41776330e-01)
# Wan2.1, `e0` (timestep_proj) signal = TeaCache's --use_ret_steps sets: 5 warm-up steps, last step not forced.
WAN_T2V_1_3B_E0_COEFFS = (-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01, -4.99875664e-02)
WAN_T2V_14B_E0_COEFFS = (-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01, -3.15583525e-01)
WAN_I2V_480P_E0_COEFFS = (2.57151496e+05, -3.54229917e+04, 1.40286849e+03, -1.35890334e+01, 1.32517977e-01)
WAN_I2V_720P_E0_COEFFS = (8.10705460e+03, 2.13393892e+03, -3.72934672e+02, 1.66203073e+01, -4.17769401e-02)
# Wan2.1, `e` (time embedding) sets, for a custom adapter whose modulated input is `e`: 1 warm-up step (2 calls).
WAN_T2V_1_3B_E_COEFFS = (2.39676752e+03, -1.31110545e+03, 2.01331979e+02, -8.29855975e+00, 1.37887774e-01)
WAN_T2V_14B_E_COEFFS = (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404)
WAN_I2V_480P_E_COEFFS = (-3.02331670e+02, 2.23948934e+02, -5.25463970e+01, 5.87348440e+00, -2.01973289e-01)
WAN_I2V_720P_E_COEFFS = (-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683)


def _entry(coefficients: tuple, threshold: float, source: str, **extra: Any) -> dict:
    return {"coefficients": coefficients, "threshold": threshold, "source": source, **extra}


_WAN_E0 = dict(ret_steps=5, cutoff_steps=0)

# FLUX.1-dev: 0.25 -> 1.5x, 0.4 -> 1.8x, 0.6 -> 2.0x (TeaCache default), 0.8 -> 2.25x at 28 steps. FLUX.1-schnell
# has the same identity (only guidance_embeds differs) and gets the dev set; FLUX.1-Kontext too: variant="kontext".
register_table("teacache", _FLUX_DEV, _entry(FLUX_COEFFS, 0.6, "TeaCache4FLUX, FLUX.1-dev 28 steps"))
register_table("teacache", _FLUX_DEV, _entry(FLUX_KONTEXT_COEFFS, 0.2, "diffusers TeaCache FLUX.1-Kontext-dev"),
               variant="kontext")
register_table("teacache", _HUNYUAN_VIDEO, _entry(HUNYUAN_VIDEO_COEFFS, 0.15,
                                                  "TeaCache4HunyuanVideo: 0.1 -> 1.6x, 0.15 -> 2.1x"))
register_table("teacache", _WAN_T2V_1_3B, _entry(WAN_T2V_1_3B_E0_COEFFS, 0.05,
                                                 "TeaCache4Wan2.1 T2V-1.3B e0 (use_ret_steps): slow 0.05, fast 0.10",
                                                 **_WAN_E0))
# Wan2.2 T2V-A14B experts share this identity; these coefficients were fitted on Wan2.1 T2V-14B.
register_table("teacache", _WAN_T2V_14B, _entry(WAN_T2V_14B_E0_COEFFS, 0.10,
                                                "TeaCache4Wan2.1 T2V-14B e0 (use_ret_steps): slow 0.10, fast 0.20",
                                                **_WAN_E0))
# I2V-14B 480P and 720P (and FLF2V-14B) share one architecture: no default, pick variant="480p" / "720p".
register_table("teacache", _WAN_I2V_14B, _entry(WAN_I2V_480P_E0_COEFFS, 0.20,
                                                "TeaCache4Wan2.1 I2V-14B-480P e0: slow 0.20, fast 0.30", **_WAN_E0),
               variant="480p")
register_table("teacache", _WAN_I2V_14B, _entry(WAN_I2V_720P_E0_COEFFS, 0.20,
                                                "TeaCache4Wan2.1 I2V-14B-720P e0: slow 0.20, fast 0.30", **_WAN_E0),
               variant="720p")
register_table("teacache", _COGVIDEOX_2B, _entry(COGVIDEOX_2B_COEFFS, 0.1, "TeaCache4CogVideoX-2b: slow 0.1, "
                                                                           "fast 0.2"))
# CogVideoX 1.0 and 1.5 (5B) share the size keys; 1.5 has patch_size_t=2.
register_table("teacache", _COGVIDEOX_5B, [
    _entry(COGVIDEOX_5B_COEFFS, 0.1, "TeaCache4CogVideoX-5b: slow 0.1, fast 0.2", match={"patch_size_t": None}),
    _entry(COGVIDEOX15_5B_COEFFS, 0.1, "TeaCache4CogVideoX1.5-5B: 0.1 -> 1.3x, 0.2 -> 1.8x, 0.3 -> 2.1x",
           match={"patch_size_t": 2}),
])
register_table("teacache", _COGVIDEOX_5B_I2V, [
    _entry(COGVIDEOX_5B_COEFFS, 0.1, "TeaCache4CogVideoX-5b-I2V: slow 0.1, fast 0.2", match={"patch_size_t": None}),
    _entry(COGVIDEOX15_5B_I2V_COEFFS, 0.1, "TeaCache4CogVideoX1.5-5B-I2V: 0.1 -> 1.3x, 0.2 -> 1.8x",
           match={"patch_size_t": 2}),
])
register_table("teacache", _CONSISID, _entry(COGVIDEOX_5B_COEFFS, 0.1,
                                             "TeaCache4ConsisID: 0.1 -> 1.6x, 0.15 -> 2.1x, 0.2 -> 2.5x"))
register_table("teacache", _MOCHI, _entry(MOCHI_COEFFS, 0.06, "TeaCache4Mochi (64 steps): 0.06 -> 1.5x, "
                                                              "0.09 -> 2.1x"))
# LTX-Video 2B checkpoints (0.9.0 / 0.9.1 / 0.9.5) share the identity; fitted on 0.9.1 at 50 steps.
register_table("teacache", _LTX_2B, _entry(LTX_COEFFS, 0.03, "TeaCache4LTX-Video 0.9.1 (50 steps): 0.03 -> 1.6x, "
                                                             "0.05 -> 2.1x"))
register_table("teacache", _LUMINA2, _entry(LUMINA2_V2_COEFFS, 0.3, "TeaCache4Lumina2 (v2 coefficients)"))
register_table("teacache", _LUMINA2, _entry(LUMINA_V1_COEFFS, 0.3, "TeaCache4Lumina2 v1 / Lumina-Next (30 steps): "
                                                                    "0.2 -> 1.5x, 0.3 -> 1.9x, 0.4 -> 2.4x"),
               variant="v1")
# HiDream-I1 Full / Dev / Fast share one architecture; fitted on Full (50 steps), first 10% of steps computed.
register_table("teacache", _HIDREAM_I1, _entry(HIDREAM_COEFFS, 0.25, "TeaCache4HiDream-I1-Full (50 steps): 0.17 -> "
                                                                     "1.5x, 0.25 -> 1.7x, 0.3 -> 2x, 0.45 -> 2.6x",
                                               ret_ratio=0.1))

# Presets for checkpoints whose identity is ambiguous or whose class dcache reaches only through a custom adapter.
register_preset("teacache-flux-kontext", "teacache", "FLUX.1-Kontext-dev coefficients (diffusers), threshold 0.2",
                variant="kontext")
register_preset("teacache-lumina-next", "teacache", "Lumina-Next coefficients (TeaCache4Lumina-Next, 30 steps)",
                coefficients=LUMINA_V1_COEFFS, threshold=0.3)
register_preset("teacache-cosmos", "teacache", "Cosmos T2V / V2W coefficients (TeaCache4Cosmos); t2v 0.3, i2v 0.4",
                coefficients=COSMOS_COEFFS, threshold=0.3)
register_preset("teacache-wan-i2v-480p", "teacache", "Wan2.1 I2V-14B-480P (e0 set)", variant="480p")
register_preset("teacache-wan-i2v-720p", "teacache", "Wan2.1 I2V-14B-720P (e0 set)", variant="720p")
