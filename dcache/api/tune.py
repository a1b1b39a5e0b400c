"""`dcache.tune`: the setting of a method that meets a speed or quality target, as a config for `dcache.apply`.

    run = lambda: pipe(prompt, num_inference_steps=28, generator=torch.Generator().manual_seed(1))
    config = dcache.tune(pipe, "magcache", speed="2x", calibration_run=run)   # a MethodConfig
    handle = dcache.apply(pipe, config)

speed="2x" picks, among the settings of the method's main knob whose ideal speed-up reaches 2, the one with the best
PSNR on the calibration run; quality="psnr>=30" the fastest setting that keeps 30 dB there. The sweep runs through
the target resolver a method package registers (dcache.methods.target_resolver), so this module names no method.
`dcache.apply(pipe, "magcache", speed="2x", calibration_run=run)` is the same choice in one call; its handle keeps
the sweep (`handle.target`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from ..config import MethodConfig
from ..methods import DEFAULT_METHOD, preset_scope, target_resolver


def tune(target: Any, method: str = DEFAULT_METHOD, *, speed: str | float | None = None, quality: str | None = None,
         calibration_run: Callable[[], Any] | None = None, num_steps: int | None = None, scope: str | None = None,
         progress: bool | Callable[[str], None] = True, **overrides: Any) -> MethodConfig:
    """The config of `method` (a method or preset name, with `overrides` fixed) that meets one target on
    `calibration_run()`, one generation compared with the same generation uncached. A ValueError shows the sweep
    when no setting meets it. target: the pipeline (or transformer, with num_steps) the run uses; scope: as for
    dcache.apply (a preset's own by default). progress: a bar (True), None/False, or a function of one line."""
    scope = preset_scope(method) if scope is None else scope
    config, _ = tuned(target, method, {"speed": speed, "quality": quality, "calibration_run": calibration_run},
                      num_steps=num_steps, scope=scope, overrides=overrides, progress=progress)
    if preset_scope(method) not in (None, "blocks"):
        warnings.warn(f"the preset {method!r} runs in scope={preset_scope(method)!r}, which a config does not carry: "
                      f"apply the tuned config with dcache.apply(pipe, config, scope={preset_scope(method)!r}).",
                      UserWarning, stacklevel=2)
    return config


def tuned(target: Any, method: Any, keywords: dict[str, Any], *, num_steps: int | None, scope: str | None,
          overrides: dict[str, Any], progress: bool | Callable[[str], None] = True) -> tuple[MethodConfig, Any]:
    """(the chosen config, the sweep that chose it) for dcache.apply's and dcache.tune's speed= / quality= /
    calibration_run= keywords."""
    unknown = sorted(set(keywords) - {"speed", "quality", "calibration_run"})
    if unknown:
        raise TypeError(f"{unknown} are not target keywords; give speed='2x' or quality='psnr>=30' with "
                        f"calibration_run=.")
    return target_resolver()(target, method, speed=keywords.get("speed"), quality=keywords.get("quality"),
                             calibration_run=keywords.get("calibration_run"), num_steps=num_steps, scope=scope,
                             overrides=overrides, progress=progress)
