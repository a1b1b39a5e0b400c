"""dcache on real diffusers pipelines, called the way users call them: one line per pipeline.

Each pipeline (tests/real_pipelines.py: real diffusers / transformers classes, tiny configs, random weights) runs its
own `__call__` with a prompt string through its tokenizer and text encoder, its scheduler and, where it takes them,
custom sigmas or timesteps through diffusers' `retrieve_timesteps` (which inspects the signature of the scheduler's
`set_timesteps`, the method dcache wraps). Per pipeline:
  (a) all-compute under dcache (fbcache, threshold 0) is bit-identical to the uncached pipeline, with default and
      custom sigmas / timesteps;
  (b) after handle.remove() the output is bit-identical again;
  (c) a reusing setting (fixed_interval: compute steps 0, 2, 3 of 4, reuse step 1) skips blocks (counted) and stays
      finite and within a relative error of the uncached output;
  (d) the custom schedule reaches the scheduler under dcache: the generation has len(custom) steps and differs from
      the default one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from real_pipelines import REAL_PIPELINES, STEPS

import dcache

REL_BOUND = 0.1  # reuse of one step in 4 on random-weight models (measured 0.001-0.037, Chroma highest)


def _output(result, spec) -> torch.Tensor:
    """The pipeline's output (latents here) as a float tensor."""
    out = result.frames if spec.video else result.images
    return torch.as_tensor(np.asarray(out)) if not isinstance(out, torch.Tensor) else out


def _run(pipe, spec, **extra) -> torch.Tensor:
    return _output(pipe(**spec.call(seed=0, **extra)), spec)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", sorted(REAL_PIPELINES))
def test_real_pipeline_under_dcache(name):
    spec = REAL_PIPELINES[name]
    pipe = spec.build()
    custom = spec.custom or {}
    reference = _run(pipe, spec)
    reference_custom = _run(pipe, spec, **custom) if custom else None

    handle = dcache.apply(pipe, "fbcache", threshold=0.0)  # (a) computes every unit of every call
    assert torch.equal(_run(pipe, spec), reference)
    stats = handle.stats()
    assert stats.calls > 0 and stats.calls_fully_computed == stats.calls and stats.units_reused == 0
    if custom:  # (d): the wrapped set_timesteps still takes sigmas / timesteps, and they reach the scheduler
        assert torch.equal(_run(pipe, spec, **custom), reference_custom)
        assert handle.stats().num_steps == len(next(iter(custom.values())))
        assert not torch.equal(reference_custom, reference)
    handle.remove()
    assert torch.equal(_run(pipe, spec), reference)  # (b)

    handle = dcache.apply(pipe, "fixed_interval")  # (c)
    cached = _run(pipe, spec)
    stats = handle.stats()
    handle.remove()
    assert stats.num_steps == STEPS and stats.units_reused > 0 and stats.compute_ratio < 1.0, str(stats)
    assert torch.isfinite(cached).all()
    assert 0.0 < _rel(cached, reference) < REL_BOUND
    assert torch.equal(_run(pipe, spec), reference)


def test_wan22_second_expert_is_cached_with_its_own_state():
    """Wan 2.2 (two experts switched at boundary_ratio): every denoising call of both experts goes through dcache,
    and no cache crosses the switch (the second expert's first call computes). 4 steps with timesteps ~1000, 934,
    781, 47 and boundary 0.9: steps 0-1 run `transformer`, steps 2-3 `transformer_2`."""
    spec = REAL_PIPELINES["wan22"]
    pipe = spec.build()
    reference = _run(pipe, spec)
    handle = dcache.apply(pipe, "fixed_interval", interval=3, warmup_steps=1, cutoff_steps=0)
    cached = _run(pipe, spec)
    stats = handle.stats()
    handle.remove()
    assert stats.calls == STEPS and set(stats.experts) == {"transformer", "transformer_2"}
    assert [part.calls for part in stats.experts.values()] == [2, 2]
    # interval 3 from step 0 computes steps 0 and 3 and reuses 1 and 2; step 2 is the second expert's first call,
    # which has nothing cached: computed
    assert [set(row.values()) for row in stats.per_step] == [{"C"}, {"R"}, {"C"}, {"C"}]
    assert torch.equal(_run(pipe, spec), reference)
    assert torch.isfinite(cached).all() and 0.0 < _rel(cached, reference) < REL_BOUND


# ---- every method and preset on the real FluxPipeline --------------------------------------------------------------

# method -> overrides under which it computes every unit of every call (its all-compute setting). The profiled
# methods (ertacache, invardiff, profilingdit, bac) replay calibrated plans and have none.
ALL_COMPUTE = {
    "fbcache": {"threshold": 0.0}, "magcache": {"max_skip_steps": 0}, "teacache": {"threshold": 0.0},
    "easycache": {"threshold": 0.0}, "seacache": {"threshold": 0.0, "gate": True}, "cg_taylor": {"threshold": 0.0},
    "taylorseer": {"interval": 1}, "fora": {"interval": 1}, "fixed_interval": {"interval": 1},
    "delta_dit": {"interval": 1}, "flowcache": {"threshold": 0.0},
    "pab": {"spatial_range": 1, "temporal_range": 1, "cross_range": 1, "mlp_range": 1},
    "keyframe": {"keyframes": tuple(i / (STEPS - 1) for i in range(STEPS))},  # every step a keyframe
    "adaptive_keyframe": {"compute_ratio": 1.0},  # a budget of every step
}


def _calibrate(pipe, spec, tmp_path) -> dict[str, dict]:
    """Calibrate through the public API on seeds 1 and 2 (the checked generation uses seed 0): MagCache ratios and
    TeaCache coefficients are registered for the model (the coefficients also under the variants presets name);
    the profiled methods' plans are saved and passed by path. Returns per method the overrides its name needs."""
    from dcache.schedules.tuning.ertacache_calibration import calibrate_ertacache
    from dcache.schedules.tuning.bac_calibration import calibrate_bac
    from dcache.schedules.tuning.calibrate import calibrate_magcache, calibrate_teacache
    from dcache.schedules.tuning.invardiff_calibration import calibrate_invardiff
    from dcache.schedules.tuning.profilingdit_calibration import calibrate_profilingdit

    from dcache.methods import presets
    from dcache.schedules.tables import model_identity, register_table

    runs = [lambda seed=seed: pipe(**spec.call(seed=seed)) for seed in (1, 2)]
    calibrate_magcache(pipe, runs[0])
    table = calibrate_teacache(pipe, runs)  # 3 (x, y) points per run of 4 steps: 6
    # presets that pick a published coefficient set of another checkpoint (variant="kontext", "480p", ...): the
    # fitted set registered under that variant too, as a user of such a checkpoint would have it
    for variant in {p.overrides["variant"] for p in presets().values() if "variant" in p.overrides}:
        register_table("teacache", model_identity(pipe.transformer), table, variant=variant)
    extra = {}
    for name, calibrate in (("ertacache", calibrate_ertacache), ("invardiff", calibrate_invardiff),
                            ("profilingdit", calibrate_profilingdit), ("bac", calibrate_bac)):
        path = tmp_path / f"{name}.plan.json"
        calibrate(pipe, runs).save(path)
        extra[name] = {"plan": str(path)}
    return extra


def test_every_method_and_preset_runs_on_the_real_flux_pipeline(tmp_path):
    from dcache.methods import methods, presets

    spec = REAL_PIPELINES["flux"]
    pipe = spec.build()
    reference = _run(pipe, spec)
    extra = _calibrate(pipe, spec, tmp_path)
    names = {**{m: m for m in methods()}, **{p.name: p.method for p in presets().values()}}
    assert set(ALL_COMPUTE) | set(extra) == set(methods())  # a new method must be added to one of them
    for name, method in sorted(names.items()):
        overrides = extra.get(method, {})
        with dcache.apply(pipe, name, **overrides) as handle:
            out = _run(pipe, spec)
            stats = handle.stats()
        assert stats.calls == STEPS and torch.isfinite(out).all(), name
        assert _rel(out, reference) < REL_BOUND, (name, str(stats))
        if method in ALL_COMPUTE:
            with dcache.apply(pipe, name, **{**overrides, **ALL_COMPUTE[method]}) as handle:
                out = _run(pipe, spec)
                stats = handle.stats()
            assert stats.calls_fully_computed == stats.calls and torch.equal(out, reference), (name, str(stats))
    assert torch.equal(_run(pipe, spec), reference)
