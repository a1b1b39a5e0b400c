"""A cache that says what it did (dcache.generations.health): each warning fires when its case happens, once per
handle, and not otherwise; handle.stats().health holds the same facts."""

from __future__ import annotations

import warnings

import pytest
import torch
from compat_kit import make_pipeline, seeded

import dcache
from dcache.generations.health import DCacheHealthWarning


def generate(pipe, guidance=2.0, steps=8):
    return pipe([1, 7], num_inference_steps=steps, guidance_scale=guidance, generator=seeded(0))


def health_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, DCacheHealthWarning)]


def test_a_cache_that_reuses_nothing_says_so_once_naming_the_knob():
    pipe = make_pipeline()
    handle = dcache.apply(pipe, "fbcache", threshold=1e-9)
    said = health_warnings(lambda: generate(pipe))
    assert len(said) == 1 and "reused nothing" in said[0] and "`threshold`" in said[0]
    assert handle.stats().health["nothing_reused"] is True and handle.stats().health["reuse_fraction"] == 0.0
    assert health_warnings(lambda: generate(pipe)) == []  # once per handle
    handle.remove()


def test_a_cache_that_serves_almost_everything_says_it_froze_the_image():
    pipe = make_pipeline()
    with dcache.apply(pipe, "fixed_interval", interval=100, warmup_steps=1, cutoff_steps=0) as handle:
        said = health_warnings(lambda: generate(pipe, steps=10))
        facts = handle.stats().health
    assert len(said) == 1 and "entirely from the cache" in said[0] and "`interval`" in said[0]
    assert facts["reused_after_warmup"] == 1.0 and not facts["nothing_reused"]


def test_a_normal_cache_and_a_calibrating_generation_say_nothing():
    pipe = make_pipeline()
    with dcache.apply(pipe, "fixed_interval", interval=2) as handle:
        assert health_warnings(lambda: generate(pipe)) == []
        facts = handle.stats().health
    assert 0 < facts["reuse_fraction"] < 1 and facts["missing_branches"] == [] and facts["non_finite_units"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MagCache says once that it calibrates itself
        handle = dcache.apply(pipe, "magcache")
    said = health_warnings(lambda: generate(pipe))  # the self-calibrating first generation computes every step
    assert said == [] and handle.stats().health["calibrating"] is True
    handle.remove()


def test_a_branch_that_went_missing_is_said():
    pipe = make_pipeline()
    with dcache.apply(pipe, "fixed_interval", interval=2) as handle:
        assert health_warnings(lambda: generate(pipe, guidance=2.0)) == []
        said = health_warnings(lambda: generate(pipe, guidance=1.0))  # no uncond calls any more
        assert handle.stats().health["missing_branches"] == ["uncond"]
    assert len(said) == 1 and "['uncond']" in said[0]


def test_non_finite_cached_values_are_said():
    pipe = make_pipeline()
    with dcache.apply(pipe, "fixed_interval", interval=2) as handle:
        with torch.no_grad():
            pipe.transformer.transformer_blocks[0].ff.net[-1].bias.fill_(float("nan"))
        said = health_warnings(lambda: generate(pipe))
        facts = handle.stats().health
    assert facts["non_finite_units"] and any("NaN or infinity" in s for s in said)


@pytest.mark.parametrize("method", ["fbcache", "fixed_interval"])
def test_transformer_only_use_reports_at_the_next_generation(method):
    """Without a scheduler a generation ends when the next starts: its facts come then (or at remove())."""
    pipe = make_pipeline()
    handle = dcache.apply(pipe.transformer, method, num_steps=4, **({"threshold": 1e-9} if method == "fbcache"
                                                                    else {"interval": 2}))
    enc, pooled = pipe.label_encoder(torch.tensor([1]))
    from compat_kit import TXT_TOKENS, grid_ids

    def run():
        for t in (1.0, 0.75, 0.5, 0.25):
            pipe.transformer(hidden_states=torch.randn(1, 16, 4, generator=seeded(0)), encoder_hidden_states=enc,
                             pooled_projections=pooled, timestep=torch.tensor([t]), img_ids=grid_ids(4, 4),
                             txt_ids=torch.zeros(TXT_TOKENS, 3), return_dict=False)

    with torch.no_grad():
        run()
        said = health_warnings(handle.remove)
    assert (len(said) == 1) == (method == "fbcache")


def test_a_cache_that_computes_more_than_it_skips_says_so_and_how_to_decide_once():
    """FBCache on the bundled model, a batch of 4 with per-sample decisions (the default): each row decides alone at
    batch 1 (embedders and probe block run again per row), and at threshold 0.15 it skips too little to pay for
    that (measured: 1.044x the uncached FLOPs, 8 units served; 0.927x deciding once per call). It says so once,
    naming its knob and decisions='batch'; deciding once per call it says nothing of the kind."""
    from dcache.pipelines.bundled import load_tiny_pipeline

    pipe = load_tiny_pipeline()

    def run():
        pipe([0, 3, 5, 8], num_inference_steps=12, generator=torch.Generator().manual_seed(0), output_type="pt")

    with dcache.apply(pipe, "fbcache", threshold=0.15) as handle:
        said = health_warnings(run)
        stats = handle.stats()
        assert health_warnings(run) == []  # once per handle
    assert stats.compute_ratio > 1.0 and stats.units_reused > 0, (stats.compute_ratio, stats.units_reused)
    costly = [s for s in said if "costs more than it skips" in s]
    assert len(costly) == 1 and "`threshold`" in costly[0] and "decisions='batch'" in costly[0], said
    assert f"computed {stats.compute_ratio:.3f}x" in costly[0]
    with dcache.apply(pipe, "fbcache", threshold=0.15, decisions="batch") as handle:
        said = health_warnings(run)
        ratio = handle.stats().compute_ratio
    assert ratio <= 1.0 and not [s for s in said if "costs more than it skips" in s], (ratio, said)


def test_a_forecasting_plan_that_computes_few_steps_is_not_called_frozen():
    """Keyframes forecast between their computed steps (the image moves with each step), so serving 10 of the 11
    calls after the first keyframe is the plan working, not a frozen image; the same plan with plain reuse
    (order 0) is frozen and says so."""
    pipe = make_pipeline()
    with dcache.apply(pipe, "keyframe", keyframes=(0.0, 0.5), order=2) as handle:
        said = health_warnings(lambda: generate(pipe, steps=12))
        facts = handle.stats().health
    assert said == [] and facts["reuse_fraction"] > 0.8 and facts["reused_after_warmup"] == 0.0
    with dcache.apply(pipe, "keyframe", keyframes=(0.0, 0.5), order=0) as handle:
        said = health_warnings(lambda: generate(pipe, steps=12))
        facts = handle.stats().health
    assert len(said) == 1 and "mostly frozen" in said[0] and "compute more steps" in said[0], said
    assert facts["reused_after_warmup"] >= 0.9
