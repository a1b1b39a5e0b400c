"""Peer caches for `benchmarks/methods.py`: diffusers' built-in caches and cache-dit on the same transformer, plus
the block meter that counts what any cache (dcache or a peer) really computes.

Every peer is a `Contender`: a library, a method, the knob the sweep moves (`Search`), fixed knobs per family, and
an `enable(pipe, setting) -> Applied` that puts the cache on `pipe.transformer` and returns how to take it off.
dcache's own methods are built the same way in methods.py, so the sweep code never branches on the library.

How each peer is fitted to the bundled models (`_models.py`; described here for tiny-digits, a
FluxTransformer2DModel with split CFG under `cache_context`; tiny-motion's Wan transformer works the same way, and
tiny-shapes' SD3 transformer is not a diffusers `CacheMixin`, so diffusers' caches cannot be put on it):
  * FirstBlockCache, MagCache, TaylorSeer, SeaCache keep their state per diffusers `cache_context`, so they run
    on the split-CFG pipeline as is ("cond" / "uncond" never share a cache).
  * MagCache needs `mag_ratios` for anything but FLUX.1-dev: they come from diffusers' own calibration mode
    (`MagCacheConfig(calibrate=True)`, one uncached run, the printed list is parsed). diffusers takes one curve
    for both branches; we pass the first one it prints (the cond branch), as a user copying it would.
  * SeaCache has no built-in adapter for these pipelines: `raw_vision_callback` gives its spectral indicator
    per-sample latents [C, T, H, W] (Flux: the 2x2-packed tokens [B, 64, 4] unpacked to [1, 1, 16, 16]; Wan: the
    latents [B, C, F, H, W] as they are).
  * PyramidAttentionBroadcast and FasterCache keep their state per attention module / per model, not per
    `cache_context`: with split CFG the uncond call would reuse the cond call's attention. They run on the same
    pipeline in batched CFG (`cfg_mode="batched"`, one call on [uncond; cond], mathematically the same sampler),
    and their quality is measured against the uncached batched run. FasterCache's CFG cache assumes image latents
    (B, C, H, W); a Flux transformer returns packed tokens [2B, 64, 4], so its low/high-frequency split runs over
    (tokens, channels): it runs, but that part of the method has nothing to work with on any Flux model.
  * cache-dit: `enable_cache(BlockAdapter(...))` with cache-dit's own adapter for the family ("Flux": one list of
    2 + 6 blocks with dummy single blocks and its FluxPatchFunctor; "Wan"; "StableDiffusion3"); our pipeline
    classes are not in its registry, so the adapter is built explicitly. Split CFG: `enable_separate_cfg=True`,
    cond call first (`cfg_compute_first=False`); batched CFG (tiny-shapes): `enable_separate_cfg=False`.

Compute ratio of a peer: `BlockMeter` registers forward pre/post hooks on every block BEFORE a cache is put on
(diffusers' hooks replace `forward`, cache-dit calls the blocks itself; module hooks on `__call__` fire either
way) and, while counting, measures each block call with torch's FlopCounterMode: a block a cache skips costs 0
FLOPs, one whose attention is reused costs only the rest. dcache's `stats().compute_ratio` counts block FLOPs the
same way (FlopCounterMode per unit), so the two ratios are the same quantity; methods.py checks they agree.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode


# ------------------------------------------------------------------------------------------------------------------
# What the sweep needs from every contender
# ------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Search:
    """How the main knob is swept: a log/linear range searched for the target compute ratios, or fixed values.

    Higher `lo`..`hi` values must mean more reuse (lower compute ratio) for "log"/"linear"; for "values" the list
    is simply evaluated in order (every value one point).
    """
    knob: str
    kind: str  # "log" | "linear" | "values"
    lo: float = 0.0
    hi: float = 0.0
    values: tuple = ()
    integer: bool = False


@dataclass
class Applied:
    """A cache on the pipeline: `remove()` takes it off; `compute_ratio()` is the library's own count (or None)."""
    remove: Callable[[], None]
    compute_ratio: Callable[[], float | None] = lambda: None
    info: Callable[[], dict] = dict


@dataclass
class Contender:
    library: str  # "dcache" | "diffusers" | "cache-dit"
    method: str
    search: Search | None
    enable: Callable[[Any, dict], Applied]
    families: list[dict] = field(default_factory=lambda: [{}])  # fixed knobs; later families only for missed bands
    cfg_mode: str = "split"
    note: str = ""
    quick: dict | None = None  # the single setting --quick runs (None: not in the quick subset)

    @property
    def label(self) -> str:
        return f"{self.library}:{self.method}"


def setting_text(setting: dict) -> str:
    """{'threshold': 0.0812, 'K': 3} -> 'threshold=0.0812 K=3' (floats to 3 significant digits)."""
    parts = []
    for key, value in setting.items():
        if isinstance(value, float):
            value = f"{value:.3g}"
        elif isinstance(value, (list, tuple)):
            value = "(" + ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) + ")"
        parts.append(f"{key}={value}")
    return " ".join(parts)


# ------------------------------------------------------------------------------------------------------------------
# Block meter
# ------------------------------------------------------------------------------------------------------------------

def transformer_blocks(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks, in execution order (Flux: 2 double-stream, then 6 single-stream)."""
    out = []
    for list_name in ("transformer_blocks", "single_transformer_blocks", "blocks", "layers"):
        blocks = getattr(transformer, list_name, None)
        if isinstance(blocks, torch.nn.ModuleList):
            out += [(f"{list_name}.{i}", b) for i, b in enumerate(blocks)]
    if not out:
        raise ValueError(f"no block lists found on {type(transformer).__name__}")
    return out


class BlockMeter:
    """FLOPs and executed block calls of the transformer blocks, whatever cache sits on them.

    Register it before any cache. Hooks are no-ops unless `counting` (so timed runs pay ~nothing); while counting,
    every block call runs under its own FlopCounterMode (a call that computes nothing, e.g. a pass-through block of
    a reused stack or a skipped block, counts 0 FLOPs and is not "executed").
    """

    def __init__(self, transformer: torch.nn.Module):
        self.blocks = transformer_blocks(transformer)
        self.counting = False
        self._stack: list[FlopCounterMode] = []
        self._handles = []
        for _, block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._pre))
            self._handles.append(block.register_forward_hook(self._post, always_call=True))
        self.reset()

    def reset(self) -> None:
        self.flops = 0.0
        self.calls = 0  # block calls seen
        self.executed = 0  # block calls that computed something

    def _pre(self, module, args):
        if self.counting:
            mode = FlopCounterMode(display=False)
            mode.__enter__()
            self._stack.append(mode)

    def _post(self, module, args, output):
        if self.counting and self._stack:
            mode = self._stack.pop()
            mode.__exit__(None, None, None)
            flops = float(mode.get_total_flops())
            self.flops += flops
            self.calls += 1
            self.executed += flops > 0

    @contextlib.contextmanager
    def count(self):
        """with meter.count(): pipe(...)  -> meter.flops / meter.executed of that run."""
        self.reset()
        self.counting = True
        try:
            yield self
        finally:
            self.counting = False
            while self._stack:  # an exception inside a block: unwind the modes
                self._stack.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------------------------------
# Helpers the diffusers caches need on this pipeline
# ------------------------------------------------------------------------------------------------------------------

def timestep_callback(pipe) -> Callable[[], float]:
    """Current timestep in 0..1000 for PAB / FasterCache (the pipeline sets no `current_timestep` attribute).

    FlowMatchEulerDiscreteScheduler's step_index is None until its first `step()`, then the index of the step being
    taken; the pipeline calls `set_begin_index(0)`, so before the first step the index is the begin index.
    """
    scheduler = pipe.scheduler

    def current() -> float:
        index = scheduler.step_index if scheduler.step_index is not None else (scheduler.begin_index or 0)
        index = min(index, len(scheduler.timesteps) - 1)
        return float(scheduler.timesteps[index])

    return current


def enable_diffusers_cache(pipe, config) -> Applied:
    transformer = pipe.transformer
    transformer.enable_cache(config)

    def remove():
        transformer.disable_cache()

    return Applied(remove=remove)


def calibrate_diffusers_magcache(pipe, run: Callable[[], Any],
                                 num_steps: int) -> tuple[list[float], list[list[float]]]:
    """diffusers' own MagCache calibration: one uncached run with `calibrate=True`; returns (cond curve, all curves).

    diffusers prints each cache context's ratio list at the end of the run ("Copy these values to
    MagCacheConfig(mag_ratios=...)"); we parse what it prints.
    """
    from diffusers import MagCacheConfig

    buffer = io.StringIO()
    applied = enable_diffusers_cache(pipe, MagCacheConfig(calibrate=True, num_inference_steps=num_steps))
    try:
        with contextlib.redirect_stdout(buffer):
            run()
    finally:
        applied.remove()
    curves = [[float(v) for v in m.group(1).split(",")]
              for m in re.finditer(r"^\[([^\]]+)\]$", buffer.getvalue(), re.M)]
    curves = [c for c in curves if len(c) == num_steps]
    if not curves:
        raise RuntimeError(f"diffusers MagCache calibration printed no ratio list of length {num_steps}: "
                           f"{buffer.getvalue()[:500]!r}")
    return curves[0], curves


# ------------------------------------------------------------------------------------------------------------------
# diffusers contenders
# ------------------------------------------------------------------------------------------------------------------

def diffusers_contenders(num_steps: int, calibration_run: Callable[[Any], Any], raw_vision: Callable | None,
                         tensor_format: str = "BCHW", taylorseer_identifiers: tuple[str, ...] | None = None
                         ) -> list[Contender]:
    """calibration_run(pipe) runs the tuning generation uncached (used by MagCache's calibration mode);
    raw_vision: SeaCache's indicator input for this transformer (`_models.BundledModel.raw_vision`);
    tensor_format: FasterCache's latent layout ("BCFHW" for video); taylorseer_identifiers: TaylorSeer's
    `cache_identifiers` where its defaults match no module (None: its defaults)."""
    import diffusers
    from diffusers import (FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig,
                           TaylorSeerCacheConfig)

    mag_cache: dict[str, list[float]] = {}

    def fbc(pipe, s):
        return enable_diffusers_cache(pipe, FirstBlockCacheConfig(threshold=s["threshold"]))

    def mag(pipe, s):
        if "ratios" not in mag_cache:
            mag_cache["ratios"], mag_cache["all"] = calibrate_diffusers_magcache(
                pipe, lambda: calibration_run(pipe), num_steps)
        config = MagCacheConfig(threshold=s["threshold"], max_skip_steps=s["K"], retention_ratio=s["R"],
                                num_inference_steps=num_steps, mag_ratios=list(mag_cache["ratios"]))
        applied = enable_diffusers_cache(pipe, config)
        applied.info = lambda: {"mag_ratios": "diffusers calibrate=True, cond curve"}
        return applied

    def taylor(pipe, s):
        identifiers = None if s.get("lite") or taylorseer_identifiers is None else list(taylorseer_identifiers)
        config = TaylorSeerCacheConfig(cache_interval=s["interval"], disable_cache_before_step=s.get("warmup", 3),
                                       max_order=s.get("order", 1), taylor_factors_dtype=torch.float32,
                                       use_lite_mode=s.get("lite", False), cache_identifiers=identifiers)
        return enable_diffusers_cache(pipe, config)

    def pab(pipe, s):
        config = PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=s["spatial_range"],
            spatial_attention_timestep_skip_range=tuple(s["window"]),
            current_timestep_callback=timestep_callback(pipe))
        return enable_diffusers_cache(pipe, config)

    def faster(pipe, s):
        config = FasterCacheConfig(
            is_guidance_distilled=s.get("attention_only", False),
            spatial_attention_block_skip_range=s["spatial_range"],
            spatial_attention_timestep_skip_range=(-1, 681),
            unconditional_batch_skip_range=s["uncond_range"],
            unconditional_batch_timestep_skip_range=(-1, 641),
            current_timestep_callback=timestep_callback(pipe),
            tensor_format=tensor_format,
            # pooled_projections is batched [uncond; cond] too; without it the cond-only call mismatches shapes
            _unconditional_conditional_input_kwargs_identifiers=[
                "hidden_states", "encoder_hidden_states", "timestep", "pooled_projections"])
        return enable_diffusers_cache(pipe, config)

    contenders = [
        Contender("diffusers", "FirstBlockCache", Search("threshold", "log", 0.01, 1.0), fbc,
                  quick={"threshold": 0.2}),
        Contender("diffusers", "MagCache", Search("threshold", "log", 0.005, 2.0), mag,
                  families=[{"K": 3, "R": 0.2}, {"K": 8, "R": 0.1}],
                  note="mag_ratios from diffusers' calibrate=True mode on the tuning run (cond curve)"),
        Contender("diffusers", "TaylorSeer", Search("interval", "values", values=(2, 3, 4, 5, 6, 8, 10)), taylor,
                  note="attention modules only (" + ("diffusers' default identifiers" if taylorseer_identifiers is None
                                                     else f"cache_identifiers={list(taylorseer_identifiers)}")
                       + "); Taylor factors in float32",
                  quick={"interval": 3}),
        Contender("diffusers", "TaylorSeer-lite", Search("interval", "values", values=(2, 3, 4, 5, 6, 8)),
                  lambda p, s: taylor(p, {**s, "lite": True}),
                  note="use_lite_mode: blocks skipped, proj_out forecast; Taylor factors in float32"),
        Contender("diffusers", "PAB", Search("spatial_range", "values", values=(2, 3, 4, 6, 8, 12)), pab,
                  families=[{"window": (100, 800)}, {"window": (0, 1000)}], cfg_mode="batched",
                  note="batched CFG (PAB state is per module, not per cache_context)"),
        Contender("diffusers", "FasterCache", Search("uncond_range", "values", values=(2, 3, 5, 8)), faster,
                  families=[{"spatial_range": 2}, {"spatial_range": 4}], cfg_mode="batched",
                  note="batched CFG; its CFG cache assumes image latents (B, C, H, W), Flux returns tokens [B, N, C]"),
        Contender("diffusers", "FasterCache-attn", Search("spatial_range", "values", values=(2, 3, 4, 6, 8)),
                  lambda p, s: faster(p, {**s, "attention_only": True, "uncond_range": 1}), cfg_mode="batched",
                  note="is_guidance_distilled=True: attention reuse only (the CFG cache cannot run on Flux tokens)"),
    ]
    if hasattr(diffusers, "SeaCacheConfig"):
        from diffusers import SeaCacheConfig

        def sea(pipe, s):
            config = SeaCacheConfig(threshold=s["threshold"], residual_order=s.get("order", 1),
                                    retention_steps=s.get("retention", 1), cache_end_steps=1,
                                    max_consecutive_cached=s["max_consecutive"], power_exp=s.get("power", 3.0),
                                    raw_vision_callback=raw_vision)
            return enable_diffusers_cache(pipe, config)

        contenders.append(Contender(
            "diffusers", "SeaCache", Search("threshold", "log", 0.01, 4.0), sea,
            families=[{"max_consecutive": 2}, {"max_consecutive": 5}],
            note="raw_vision_callback gives the indicator per-sample latents [C, T, H, W]"))
    return contenders


# ------------------------------------------------------------------------------------------------------------------
# cache-dit contenders
# ------------------------------------------------------------------------------------------------------------------

def cache_dit_unavailable() -> str | None:
    """None if cache-dit imports, else why not."""
    try:
        import cache_dit  # noqa: F401
    except Exception as exc:  # not installed, or an incompatible dependency
        return (f"cache-dit is not usable (import cache_dit failed: {type(exc).__name__}: {exc}); install the "
                f"benchmark extra with `pip install -e '.[bench]'`, or pass --no-cache-dit to leave its rows out")
    return None


def cache_dit_adapter(pipe, name: str = "Flux"):
    """cache-dit's own adapter for the transformer family `name` (a key of its BlockAdapterRegister: "Flux", "Wan",
    "StableDiffusion3") applied to our pipeline object: our pipeline classes are not in its registry."""
    from cache_dit import BlockAdapterRegister

    factory = BlockAdapterRegister._adapters.get(name)
    if factory is None:
        raise RuntimeError(f"cache-dit has no {name!r} block adapter registered")
    return factory(pipe)


def enable_cache_dit(pipe, setting: dict, num_steps: int, adapter_name: str = "Flux",
                     separate_cfg: bool = True) -> Applied:
    """separate_cfg: the pipeline runs CFG as two calls per step (cond first); False for batched CFG."""
    import cache_dit
    from cache_dit import DBCacheConfig, DMDCalibratorConfig, FoCaCalibratorConfig, TaylorSeerCalibratorConfig

    config = DBCacheConfig(Fn_compute_blocks=setting["F"], Bn_compute_blocks=setting["B"],
                           residual_diff_threshold=setting["threshold"], max_warmup_steps=setting["W"],
                           max_continuous_cached_steps=setting.get("MC", -1), enable_separate_cfg=separate_cfg,
                           cfg_compute_first=False, num_inference_steps=num_steps)
    calibrator = None
    # cache-dit 1.5.3 fails on blocks that return the encoder stream (SD3) with Bn=0 unless the encoder stream's
    # calibrator is off ("State 'transformer_blocks_Bn_residual' not found"): the fix a user finds is the setting
    encoder = {"enable_encoder_calibrator": setting.get("encoder_calibrator", True)}
    if setting.get("taylorseer"):
        calibrator = TaylorSeerCalibratorConfig(taylorseer_order=setting["taylorseer"], **encoder)
    elif setting.get("calibrator") == "foca":
        calibrator = FoCaCalibratorConfig(**encoder)  # cache-dit's FoCa predictor-corrector at its defaults
    elif setting.get("calibrator") == "dmd":
        calibrator = DMDCalibratorConfig(**encoder)  # dynamic mode decomposition of the last 6 residuals
    adapter = cache_dit_adapter(pipe, adapter_name)
    cache_dit.enable_cache(adapter, cache_config=config, calibrator_config=calibrator)

    def remove():
        cache_dit.disable_cache(pipe)

    return Applied(remove=remove, info=lambda: {"cache_dit": cache_dit.__version__})


def cache_dit_contenders(num_steps: int, adapter_name: str = "Flux", separate_cfg: bool = True,
                         encoder_calibrator: bool = True) -> list[Contender]:
    """encoder_calibrator=False: the calibrators leave the encoder stream alone (needed on SD3, see
    enable_cache_dit)."""
    base = {"F": 1, "B": 0, "W": 4}
    calibrated = base if encoder_calibrator else {**base, "encoder_calibrator": False}
    return [
        Contender("cache-dit", "DBCache", Search("threshold", "log", 0.01, 2.0),
                  lambda p, s: enable_cache_dit(p, s, num_steps, adapter_name, separate_cfg),
                  families=[dict(base), {**base, "W": 2, "MC": -1}],
                  note=f"F1B0, warm-up W4 (W2 family for the lowest bands); cache-dit's {adapter_name} adapter"),
        Contender("cache-dit", "DBCache+TaylorSeer", Search("threshold", "log", 0.01, 2.0),
                  lambda p, s: enable_cache_dit(p, s, num_steps, adapter_name, separate_cfg),
                  families=[{**calibrated, "taylorseer": 1}, {**calibrated, "W": 2, "taylorseer": 1}],
                  note="F1B0W4 + TaylorSeerCalibratorConfig(order 1)"),
        # cache-dit 1.5's other calibrators: what it ships beyond Taylor for the low compute ratios
        *[Contender("cache-dit", f"DBCache+{name}", Search("threshold", "log", 0.01, 2.0),
                    lambda p, s: enable_cache_dit(p, s, num_steps, adapter_name, separate_cfg),
                    families=[{**calibrated, "calibrator": key}, {**calibrated, "W": 2, "calibrator": key}],
                    note=f"F1B0W4 + {name}CalibratorConfig() at cache-dit's defaults")
          for name, key in (("FoCa", "foca"), ("DMD", "dmd"))],
    ]
