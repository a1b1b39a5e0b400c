"""dcache.apply(pipe, method, controlnet=...): the ControlNet model cached too, with its own state
(dcache.api.controlnet).

Tiny real FluxControlNetPipeline (one ControlNet call per step, embedded guidance) and QwenImageControlNetPipeline
(one ControlNet call per step shared by the cond and uncond transformer calls) from tests/real_pipelines.py, their
zero-initialised ControlNet projections redrawn (`wake_controlnet`) so that the samples move the output. Reference:
the uncached pipeline. The ControlNet's real forwards are counted on its first block (the hook on the model itself
sees every call, served or not). fixed_interval at 4 steps computes steps 0, 2, 3 and reuses step 1.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from real_pipelines import REAL_PIPELINES, STEPS, wake_controlnet

import dcache
from dcache.api.controlnet import ControlNetNotFollowed

PIPELINES = ["flux_controlnet", "qwen_image_controlnet"]


class Forwards:
    """Counts the ControlNet's real forwards (a pre-hook on its first block)."""

    def __init__(self, controlnet: torch.nn.Module):
        self.n = 0
        controlnet.transformer_blocks[0].register_forward_pre_hook(self._seen)

    def _seen(self, module, args):
        self.n += 1

    def during(self, fn):
        self.n = 0
        out = fn()
        return out, self.n


def _build(name: str):
    spec = REAL_PIPELINES[name]
    pipe = spec.build()
    wake_controlnet(pipe.controlnet)
    return spec, pipe, Forwards(pipe.controlnet)


@pytest.fixture(scope="module", params=PIPELINES)
def case(request):
    return _build(request.param)


@pytest.fixture(scope="module")
def flux():
    return _build("flux_controlnet")


def _run(spec, pipe, seed: int = 0, **extra) -> torch.Tensor:
    return pipe(**spec.call(seed=seed, **extra)).images


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_follow_caches_the_controlnet_exactly_where_the_transformer_reuses(case):
    spec, pipe, forwards = case
    reference, uncached_forwards = forwards.during(lambda: _run(spec, pipe))
    assert uncached_forwards == STEPS
    with dcache.apply(pipe, "fixed_interval", interval=1, controlnet="follow") as handle:  # all compute
        out, n = forwards.during(lambda: _run(spec, pipe))
        assert torch.equal(out, reference) and n == STEPS
        assert handle.stats(expert="controlnet").units_reused == 0
    with dcache.apply(pipe, "fixed_interval") as handle:  # the transformer alone
        transformer_only = _run(spec, pipe)
    handle = dcache.apply(pipe, "fixed_interval", controlnet="follow")
    cached, n = forwards.during(lambda: _run(spec, pipe))
    stats = handle.stats()
    assert n == STEPS - 1  # step 1 serves the samples of step 0
    cn, tr = stats.experts["controlnet"], stats.experts["transformer"]
    assert (cn.calls, cn.units_computed, cn.units_reused) == (STEPS, STEPS - 1, 1)
    assert [sorted(row) for row in cn.per_step] == [["call0"]] * STEPS and cn.per_step[1] == {"call0": "R"}
    assert cn.block_flops_total > 0 and cn.block_flops_computed == pytest.approx(cn.block_flops_total * 3 / 4)
    assert stats.calls == tr.calls + cn.calls  # counted separately and in the total
    assert stats.compute_ratio == pytest.approx((tr.block_flops_computed + cn.block_flops_computed)
                                                / (tr.block_flops_total + cn.block_flops_total))
    assert "controlnet:" in str(stats)
    # handle.memory(): the samples are a part of their own, in the total and by kind
    memory = handle.memory()
    cn_memory, tr_memory = memory.experts["controlnet"], memory.experts["transformer"]
    assert cn_memory.peak_bytes == cn.cache_bytes > 0 and set(cn_memory.by_branch) == {"call0"}
    assert memory.peak_bytes == tr_memory.peak_bytes + cn_memory.peak_bytes
    assert memory.by_kind["controlnet"] == cn_memory.peak_bytes and handle.memory("controlnet") == cn_memory
    # the reused samples cost about as much accuracy as the reused transformer stack (measured: x1.7 - x2.0)
    err, err_transformer_only = _rel(cached, reference), _rel(transformer_only, reference)
    assert 0.0 < err_transformer_only < err < 3 * err_transformer_only and err < 0.05
    with torch.inference_mode():  # bit-identical to the same call under no_grad (the pipeline's own mode)
        assert torch.equal(_run(spec, pipe), cached)
    handle.remove()
    assert torch.equal(_run(spec, pipe), reference)
    assert getattr(pipe.controlnet, "_dcache_controlnet", None) is None


def test_own_schedule_with_its_own_knobs(flux):
    spec, pipe, forwards = flux
    reference = _run(spec, pipe)
    own = {"method": "fixed_interval", "interval": 3, "cutoff_steps": 0}  # C R R C
    with dcache.apply(pipe, "fixed_interval", interval=1, controlnet=own) as handle:
        cached, n = forwards.during(lambda: _run(spec, pipe))
        cn = handle.stats(expert="controlnet")
    assert n == 2 and "".join(row["call0"] for row in cn.per_step) == "CRRC"
    assert handle.stats().experts["transformer"].units_reused == 0
    assert 0.0 < _rel(cached, reference) < 0.05


def test_a_first_order_forecast_of_the_samples_beats_reusing_them(flux):
    """12 steps, the transformer computing every third: with forecast_order=1 "follow" forecasts the samples
    c(t_k) + (j - k) (c(t_k) - c(t_k')) / (k - k') where the transformer forecasts its residual (measured: relative
    error 0.0044 against 0.0086 when both are reused)."""
    spec, pipe, forwards = flux
    reference = _run(spec, pipe, num_inference_steps=12)
    errors, calls = {}, {}
    for order in (0, 1):
        with dcache.apply(pipe, "fixed_interval", interval=3, forecast_order=order, controlnet="follow") as handle:
            out, calls[order] = forwards.during(lambda: _run(spec, pipe, num_inference_steps=12))
            cn = handle.stats(expert="controlnet")
        assert (cn.units_forecast > 0) == (order == 1) and cn.units_computed == calls[order]
        errors[order] = _rel(out, reference)
    assert calls[0] == calls[1] < 12 and 0.0 < errors[1] < 0.7 * errors[0]


def test_follow_a_schedule_with_a_forecaster(flux):
    """A history forecaster (dcache.schedules.forecasters) reads only the transformer's own history, so "follow"
    takes the schedule: the ControlNet's samples are forecast with the Taylor table of the schedule's order where the
    transformer forecasts with FoCa (refused before: only a learned forecaster cannot follow)."""
    spec, pipe, forwards = flux
    reference = _run(spec, pipe, num_inference_steps=12)
    with dcache.apply(pipe, "taylorseer", granularity="stack", interval=3, warmup_steps=3, order=1, forecaster="foca",
                      controlnet="follow") as handle:
        out, n = forwards.during(lambda: _run(spec, pipe, num_inference_steps=12))
        cn = handle.stats(expert="controlnet")
    assert n == cn.units_computed < 12 and cn.units_forecast > 0
    assert 0.0 < _rel(out, reference) < 0.05


@pytest.mark.parametrize("knobs", [dict(compute_ratio=0.34), dict(compute_ratio=None, tolerance=0.05)],
                         ids=["ratio", "tolerance"])
def test_follow_an_adaptive_placement(case, knobs):
    """adaptive_keyframe places the transformer's computed steps from the forecast errors measured after its earlier
    computed calls. The ControlNet runs first at every step, so "follow" asks a copy of the schedule with the errors
    the transformer's own decision will read: it computes at exactly the transformer's computed steps (uneven under a
    tolerance: the errors move them) and forecasts between them, with no ControlNetNotFollowed warning."""
    spec, pipe, forwards = case
    reference = _run(spec, pipe, num_inference_steps=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ControlNetNotFollowed)
        with dcache.apply(pipe, "adaptive_keyframe", scope="call", controlnet="follow", **knobs) as handle:
            out, n = forwards.during(lambda: _run(spec, pipe, num_inference_steps=12))
            stats = handle.stats()
    transformer, controlnet = stats.experts["transformer"], stats.experts["controlnet"]
    computed = [j for j, row in enumerate(transformer.per_step) if "C" in "".join(row.values())]
    assert [j for j, row in enumerate(controlnet.per_step) if row["call0"] == "C"] == computed
    assert n == len(computed) < 12 and controlnet.units_forecast == 12 - n
    if "tolerance" in knobs:  # the measured errors placed them: not one gap throughout
        assert len({b - a for a, b in zip(computed, computed[1:])}) > 1, computed
    assert 0.0 < _rel(out, reference) < 0.05


def test_a_new_generation_never_reads_the_last_ones_samples(flux):
    spec, pipe, forwards = flux
    with dcache.apply(pipe, "fixed_interval", controlnet="follow"):
        fresh = _run(spec, pipe, seed=1)
    with dcache.apply(pipe, "fixed_interval", controlnet="follow") as handle:
        _run(spec, pipe, seed=0)
        second, n = forwards.during(lambda: _run(spec, pipe, seed=1))
        assert handle.stats(expert="controlnet").generations == 2
    assert n == STEPS - 1 and torch.equal(second, fresh)


def test_a_changed_conditioning_scale_rescales_or_computes(flux):
    """control_guidance_end=0.5 switches the ControlNet off at steps 2-3 (scale 0.7 -> 0): a reused step 2 serves
    the step-0 samples times 0/0.7 = 0, exactly the zeros the ControlNet returns there. control_guidance_start=0.5
    switches it on at step 2: samples cached at scale 0 cannot be rescaled, so step 2 computes."""
    spec, pipe, forwards = flux
    reuse_1_2 = {"method": "fixed_interval", "interval": 3, "cutoff_steps": 0}  # C R R C
    reuse_1 = {"method": "fixed_interval"}  # C R C C

    def run(own, **call):
        with dcache.apply(pipe, "fixed_interval", interval=1, controlnet=own):
            return forwards.during(lambda: _run(spec, pipe, **call))

    (a, n_a), (b, n_b) = run(reuse_1_2, control_guidance_end=0.5), run(reuse_1, control_guidance_end=0.5)
    assert (n_a, n_b) == (2, 3) and torch.equal(a, b)
    off_first = _run(spec, pipe, control_guidance_start=0.5)
    out, n = run(reuse_1_2, control_guidance_start=0.5)
    assert n == 3 and torch.equal(out, off_first)  # step 1 served zeros at scale 0; step 2 computed


def test_each_net_of_a_multi_controlnet_has_its_own_cache():
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    spec, single, _ = _build("flux_controlnet")
    torch.manual_seed(3)
    second = wake_controlnet(FluxControlNetModel.from_config(single.controlnet.config), seed=2).eval()
    pipe = FluxControlNetPipeline(**{**single.components, "controlnet": [single.controlnet, second]})
    pipe.set_progress_bar_config(disable=True)
    image = spec.kwargs["control_image"]
    call = dict(control_image=[image, image], controlnet_conditioning_scale=[0.7, 0.4])
    counts = [Forwards(net) for net in pipe.controlnet.nets]
    reference = _run(spec, pipe, **call)
    with dcache.apply(pipe, "fixed_interval", interval=1, controlnet="follow"):
        assert torch.equal(_run(spec, pipe, **call), reference)
    with dcache.apply(pipe, "fixed_interval", controlnet="follow") as handle:
        for c in counts:
            c.n = 0
        cached = _run(spec, pipe, **call)
        stats = handle.stats()
    assert [c.n for c in counts] == [STEPS - 1] * 2
    assert {n: s.units_reused for n, s in stats.experts.items()} == {
        "transformer": 1, "controlnet.nets.0": 1, "controlnet.nets.1": 1}
    assert 0.0 < _rel(cached, reference) < 0.05
    assert torch.equal(_run(spec, pipe, **call), reference)


def test_a_compiled_controlnet_breaks_no_graph():
    """The ControlNet's engine runs its calls in the transformer's eager call frame: compiled with fullgraph=True, a
    computed call is the model's graph and a served one a graph of its own; outputs equal the eager cache's."""
    spec, pipe, _ = _build("flux_controlnet")
    with dcache.apply(pipe, "fixed_interval", controlnet="follow") as handle:
        eager = _run(spec, pipe)
        pipe.controlnet.compile(backend="eager", fullgraph=True)
        compiled = _run(spec, pipe)
        cn = handle.stats(expert="controlnet")
    assert torch.equal(compiled, eager) and cn.units_reused == 1


def test_follow_under_a_schedule_that_reads_signals_computes_the_controlnet_and_says_so(flux):
    spec, pipe, forwards = flux
    with dcache.apply(pipe, "fbcache", threshold=0.5, controlnet="follow") as handle:
        with pytest.warns(ControlNetNotFollowed, match="probe_rel_l1"):
            _, n = forwards.during(lambda: _run(spec, pipe))
        assert n == STEPS and handle.stats(expert="controlnet").units_reused == 0


BAD = [
    (True, ValueError, ["controlnet=True", "controlnet='follow'"]),
    ("sometimes", ValueError, ["controlnet='sometimes'", "sometimes"]),
    ({"interval": 2}, ValueError, ["'method'", "fixed_interval"]),
    ({"method": "follow", "interval": 2}, ValueError, ["takes no knobs", "interval"]),
    ({"method": "fbcache"}, ValueError, ["'method': 'fbcache'", "block layout", "controlnet='follow'"]),
    ({"method": "teacache", "coefficients": [0.0, 0.0, 0.0, 1.0, 0.0]}, ValueError,
     ["modulated_rel_l1", "controlnet='follow'"]),
    ({"method": "taylorseer"}, ValueError, ["granularity", "'stack'"]),
    ({"method": "fixed_interval", "interval": 0}, ValueError, ["controlnet=", "interval"]),
    ({"method": "fixed_interval", "intervall": 2}, ValueError, ["intervall", "interval"]),
    (3, TypeError, ["controlnet=3", "controlnet='follow'"]),
]


@pytest.mark.parametrize("setting,error,words", BAD, ids=[repr(b[0]) for b in BAD])
def test_bad_settings_are_refused_by_name_and_leave_nothing_behind(flux, setting, error, words):
    spec, pipe, _ = flux
    with pytest.raises(error) as info:
        dcache.apply(pipe, "fixed_interval", controlnet=setting)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert getattr(pipe.transformer, "_dcache_engine", None) is None
    assert getattr(pipe.controlnet, "_dcache_controlnet", None) is None


def test_controlnet_needs_a_pipeline_that_has_one(flux):
    spec, pipe, _ = flux
    with pytest.raises(ValueError, match="apply dcache to the pipeline"):
        dcache.apply(pipe.transformer, "fixed_interval", controlnet="follow")
    plain = REAL_PIPELINES["flux"].build()
    with pytest.raises(ValueError, match="FluxPipeline has no ControlNet"):
        dcache.apply(plain, "fixed_interval", controlnet="follow")


# ~8 s (a saved folder loaded twice, generate's and eval's uncached and cached runs); not marked slow: in this folder
# `slow` means the long soak / inductor cases that `make test` leaves out (tests/compat/conftest.py)
def test_generate_and_eval_cache_the_controlnet_from_the_command_line(flux, tmp_path):
    """`dcache generate --controlnet follow` and the eval method spec `fixed_interval:controlnet=follow` on a saved
    FluxControlNetPipeline folder."""
    from typer.testing import CliRunner

    from dcache.pipelines.cli import app

    spec, pipe, _ = flux
    folder, image, prompts = tmp_path / "flux_controlnet", tmp_path / "edges.png", tmp_path / "prompts.txt"
    pipe.save_pretrained(folder)
    spec.kwargs["control_image"].save(image)
    prompts.write_text("a red fox\n")
    common = ["--model", str(folder), "--steps", str(STEPS), "--repeats", "1", "--device", "cpu", "--dtype",
              "float32", "--height", "16", "--width", "16", "--call", f"control_image=@{image}", "--call",
              "max_sequence_length=8"]
    result = CliRunner().invoke(app, ["generate", "--prompt", "a red fox", "--cache", "fixed_interval",
                                      "--controlnet", "follow", "--out", str(tmp_path / "out"), *common])
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    cn = stats["stats"]["experts"]["controlnet"]
    assert (cn["calls"], cn["units_reused"]) == (STEPS, 1) and stats["controlnet"] == "follow"
    assert "controlnet: 3/4 calls fully computed" in result.output
    assert "model calls fully computed" in result.output  # the total counts the ControlNet's calls too
    result = CliRunner().invoke(app, ["eval", "--methods", "fixed_interval,fixed_interval:controlnet=follow",
                                      "--prompts", str(prompts), "--seeds", "1", "--warmup", "0", "--metrics",
                                      "psnr,max_abs", "--no-progress", "--out", str(tmp_path / "report"), *common])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "report" / "results.json").read_text())["variants"]
    alone, both = rows["fixed_interval"], rows["fixed_interval(controlnet=follow)"]
    assert both["compute_ratio"] < 1.0 and 0.0 < alone["max_abs"] < both["max_abs"]
