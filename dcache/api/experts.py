"""Pipelines with more than one denoising transformer ("experts"): every one is cached, each with its own state.

Wan 2.2 A14B pipelines hold `transformer` (high noise) and `transformer_2` (low noise) and switch at
`boundary_ratio`; only one of them runs at each step. diffusers names such extra denoisers `transformer_<k>` (0.42:
WanPipeline, WanImageToVideoPipeline, WanVACEPipeline, LucyEditPipeline); ControlNets and UNets are not experts.

Each expert gets its own Engine and Schedule (so its own generation record, cached tensors, MagCache calibration and
decisions): no cache crosses the switch, and the second expert's first call computes (an engine forces COMPUTE where
a branch has nothing cached). The first expert's engine hooks the scheduler and hands every generation and step on
to the others (`Engine(leader=...)`), so all experts count steps on the same scheduler.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..schedule import Schedule
from .engine_factory import build_engine, resolve_schedule
from .handle import Handle

_EXPERT_NAME = re.compile(r"^transformer_\d+$")
_SAME = object()  # experts= gave no setting for this expert: it runs transformer's method and overrides


def extra_experts(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """(component name, module) of the pipeline's denoising transformers other than `pipeline.transformer`."""
    if pipeline is None:
        return []
    components = getattr(pipeline, "components", None) or {}
    found = []
    for name in sorted(components):
        module = components[name]
        if _EXPERT_NAME.match(name) and isinstance(module, nn.Module) and module is not pipeline.transformer:
            found.append((name, module))
    return found


def expert_method(base_method: Any, base_overrides: dict, setting: Any) -> tuple[Any, dict] | None:
    """What one extra expert runs, from `dcache.apply(..., experts={name: setting})`:
    missing -> the same method and overrides as `transformer`; a dict -> the same method with these overrides on top
    (e.g. {"warmup_steps": 2}); a method name / config / Plan / plan path -> that method; None -> left uncached."""
    if setting is _SAME:
        return base_method, dict(base_overrides)
    if setting is None:
        return None
    if isinstance(setting, dict):
        return base_method, {**base_overrides, **setting}
    return setting, {}


def check_expert_names(pipeline: Any, experts: dict | None) -> dict:
    """Validate `experts=` against the pipeline's experts; returns {name: setting or _SAME}."""
    names = [name for name, _ in extra_experts(pipeline)]
    experts = dict(experts or {})
    unknown = sorted(set(experts) - set(names))
    if unknown:
        have = names or "none besides `transformer`"
        raise ValueError(f"experts={experts!r}: {unknown} is not a denoising transformer of this "
                         f"{type(pipeline).__name__} (its extra experts: {have}); `transformer` itself takes the "
                         f"method and overrides given to dcache.apply.")
    return {name: experts.get(name, _SAME) for name in names}


def attach_experts(handle: Handle, pipeline: Any, method: Any, overrides: dict, settings: dict,
                   **engine_options: Any) -> None:
    """Build an engine for each extra expert (check_expert_names' `settings`), following `handle`'s engine and in
    its scope, into `handle.experts`. engine_options: build_engine's keywords. On an error the caller removes the
    handle (its experts with it)."""
    leader = handle.engine
    for name, module in extra_experts(pipeline):
        picked = expert_method(method, overrides, settings[name])
        if picked is None:
            continue
        if isinstance(picked[0], Schedule):
            raise ValueError(f"a Schedule instance keeps one expert's state; give {name} its own: "
                             f"dcache.apply(pipe, schedule, experts={{{name!r}: another_schedule}}) "
                             f"(or a method name, which builds one per expert).")
        schedule, sub_name, config = resolve_schedule(picked[0], picked[1], module)
        engine = build_engine(module, schedule, sub_name, pipeline=pipeline, scope=leader.scope, leader=leader,
                              **engine_options)
        handle.experts[name] = Handle(engine, sub_name, config)
