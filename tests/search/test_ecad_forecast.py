"""Forecast-aware ECAD: step / block genomes whose skipped cells are FORECAST (Taylor) when evaluated and replayed,
seeded with the recorded plans of the forecasting dynamic schedules."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from dcache.plans.plan import Plan
from dcache.schedules.tuning.search import ECADConfig, ecad_search, make_template, measure, run_plan
from dcache.schedules.tuning.search.ecad import genome_plan, heuristic_seeds, rows_to_genome, seed_rows, shift_moves

from search_testkit import STEPS, make_calibration


@pytest.fixture(scope="module")
def template(tiny_pipe):
    return make_template(make_calibration(tiny_pipe, steps=STEPS))


@pytest.mark.parametrize("field, value, needle", [("granularity", "layer", "granularity='layer'"),
                                                   ("forecast_order", -1, "forecast_order=-1"),
                                                   ("forecast_order", 5, "forecast_order=5")])
def test_config_rejects_bad_values_and_names_them(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        ECADConfig(**{field: value})


def test_genome_plan_forecasts_the_zero_bits(template):
    cfg = ECADConfig(granularity="stack", forecast_order=2)
    plan = genome_plan(np.array([1, 0, 0, 1], dtype=bool), template, cfg, method="t")
    assert plan.granularity == "stack" and plan.forecast_order == 2
    assert all(rows == ["C", "C", "F", "F", "C"] for rows in plan.actions.values())
    assert template.compute_ratio(plan) == pytest.approx(3 / STEPS)
    reuse = genome_plan(np.array([1, 0, 0, 1], dtype=bool), template, ECADConfig(granularity="stack"), method="t")
    assert reuse.forecast_order == 0 and all(rows == ["C", "C", "R", "R", "C"] for rows in reuse.actions.values())
    block = genome_plan(np.zeros((STEPS - 1) * template.num_blocks, bool), template,
                        ECADConfig(granularity="block", forecast_order=1), method="t")
    assert block.units == template.units("block") and set("".join(block.actions["cond"][1:])) == {"F"}


def test_seed_rows_coarsen_a_module_plan_to_where_anything_computes(template):
    rng = np.random.default_rng(0)
    u = len(template.module_units)
    rows = ["C" * u] + ["".join(rng.choice(["C", "R", "F"], size=u, p=[0.15, 0.7, 0.15])) for _ in range(STEPS - 1)]
    rows[2] = "R" * u  # one step that computes nothing
    plan = template.plan("module", rows, method="seed")
    module_rows = plan.actions["cond"]  # as the engine executes them (composed inputs re-added)
    blocks = seed_rows(plan, template, "block")
    stack = seed_rows(plan, template, "stack")
    for s in range(STEPS):
        for b in range(template.num_blocks):
            parts = [module_rows[s][m] for m, blk in enumerate(template.module_block) if blk == b]
            assert blocks[s][b] == ("C" if "C" in parts else "R")
        assert stack[s] == ("C" if "C" in module_rows[s] else "R")
    assert stack[2] == "R" and stack[0] == "C"
    # coarse -> fine keeps convert_rows' meaning (a reused step reuses all its modules)
    assert seed_rows(template.plan("stack", stack, method="s"), template, "module")[2] == "R" * u


def test_heuristic_seeds_at_step_granularity_are_fixed_intervals(template):
    seeds = heuristic_seeds(template, "stack")
    assert sorted(seeds) == [f"fixed{k}-all" for k in (2, 3, 4, 5)]
    for k in (2, 3, 4, 5):
        expect = [s % k == 0 or s == STEPS - 1 for s in range(1, STEPS)]
        assert seeds[f"fixed{k}-all"].tolist() == expect


def test_search_evaluates_the_forecast_it_replays_and_keeps_its_seeds_dominated(calib, template, tmp_path):
    seed = dataclasses.replace(template.plan("stack", ["C", "C", "F", "F", "C"], method="seed"),  # no fixed interval
                               forecast_order=1)
    cfg = ECADConfig(pop_size=6, generations=2, granularity="stack", forecast_order=1)
    front = ecad_search(calib, tmp_path, cfg, template=template, progress=False, seed_plans={"myseed": seed})
    assert front["points"]
    for p in front["points"]:
        plan = Plan.load(tmp_path / p["plan"])
        assert plan.granularity == "stack" and plan.forecast_order == 1
        cells = "".join(r for rows in plan.actions.values() for r in rows)
        assert set(cells) <= {"C", "F"} and "F" in cells
        first, second = run_plan(calib, plan), run_plan(calib, plan)
        assert torch.equal(first, second)  # replays bit-exactly
        assert calib.quality_fn(first, calib.reference()) == pytest.approx(p["quality"], abs=1e-9)
        steps = sum(r == "C" for r in plan.actions["cond"])
        assert p["compute_ratio"] == pytest.approx(steps / STEPS)
    # the seed was scored as the forecasting plan it is, not as its reuse twin
    seeded = [e for e in front["evaluated"] if e["seed"] == "myseed"]
    assert len(seeded) == 1
    forecast_q = measure(calib, template, seed).quality
    reuse_q = measure(calib, template, dataclasses.replace(
        seed, forecast_order=0, actions={b: [r.replace("F", "R") for r in rows] for b, rows in seed.actions.items()}
    )).quality
    assert seeded[0]["quality"] == pytest.approx(forecast_q, abs=1e-9)
    assert abs(forecast_q - reuse_q) > 1e-3
    # the front is never worse than anything evaluated (seeds included): Pareto dominance over the archive
    for e in front["evaluated"]:
        assert any(p["compute_ratio"] <= e["compute_ratio"] + 1e-12 and p["quality"] >= e["quality"] - 1e-12
                   for p in front["points"])


def test_resume_refuses_a_checkpoint_of_another_genome(calib, template, tmp_path):
    ecad_search(calib, tmp_path, ECADConfig(pop_size=4, generations=1, granularity="stack"), template=template,
                progress=False)
    with pytest.raises(ValueError, match="forecast_order"):
        ecad_search(calib, tmp_path, ECADConfig(pop_size=4, generations=2, granularity="stack", forecast_order=1),
                    template=template, progress=False, resume=True)


def test_stack_genome_search_finds_the_best_plan_of_a_small_space(calib, template, tmp_path):
    """5 steps = 4 free bits: 16 genomes; a long enough search must reach the exhaustive optimum at 3 computed
    steps."""
    cfg = ECADConfig(pop_size=8, generations=4, granularity="stack", forecast_order=1, seed=1)
    front = ecad_search(calib, tmp_path, cfg, template=template, progress=False)
    best = {}
    for bits in itertools.product([False, True], repeat=STEPS - 1):
        x = np.array(bits)
        if x.all():
            continue
        m = measure(calib, template, genome_plan(x, template, cfg, method="brute"))
        k = round(m.compute_ratio, 9)
        best[k] = max(best.get(k, -1e9), m.quality)
    at = round(3 / STEPS, 9)
    found = [p["quality"] for p in front["points"] if p["compute_ratio"] <= at + 1e-12]
    assert found and max(found) == pytest.approx(best[at], abs=1e-9)
    assert rows_to_genome(["C"] * STEPS).all()


def test_cli_ecad_forecast_seeds_with_the_forecasting_dynamic_schedules(tiny_pipe, tmp_path):
    from dcache.pipelines.search_cli import FORECAST_SEEDS, dynamic_seed_plans, run_search

    calib = make_calibration(tiny_pipe, steps=STEPS)
    seeds = dynamic_seed_plans(tiny_pipe, calib, FORECAST_SEEDS)
    assert any(k.startswith("magcache-forecast") for k in seeds)
    assert any(p.forecast_order >= 1 for p in seeds.values())
    front = run_search("ecad", tiny_pipe, True, out=str(tmp_path), steps=STEPS, prompts="1,7", pop_size=4,
                       generations=1, granularity="stack", forecast_order=1, progress=False)
    assert {e["seed"] for e in front["evaluated"]} & {k for k in seeds}
    plan = Plan.load(tmp_path / front["points"][0]["plan"])
    assert plan.granularity == "stack" and plan.forecast_order == 1


@pytest.mark.parametrize("kwargs, needle", [(dict(polish_ratios=(0.0,)), "polish_ratios"),
                                            (dict(polish_ratios=(1.5,)), "polish_ratios"),
                                            (dict(polish_evaluations=0), "polish_evaluations"),
                                            (dict(polish_reach=0), "polish_reach")])
def test_polish_config_is_validated(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ECADConfig(**kwargs)


@pytest.mark.parametrize("reach", [1, 2])
def test_shift_moves_keep_every_units_count_and_move_one_cell(reach):
    rng = np.random.default_rng(reach)
    steps, units = 7, 3
    x = rng.random((steps - 1) * units) < 0.5
    moves = shift_moves(x, steps, reach)
    bits = x.reshape(steps - 1, units)
    expected = set()
    for s, u in itertools.product(range(steps - 1), range(units)):
        for t in range(steps - 1):
            if bits[s, u] and not bits[t, u] and 0 < abs(t - s) <= reach:
                y = bits.copy()
                y[s, u], y[t, u] = False, True
                expected.add(y.tobytes())
    assert {m.reshape(steps - 1, units).tobytes() for m in moves} == expected
    assert len(moves) == len(expected)
    for m in moves:
        assert (m.reshape(steps - 1, units).sum(0) == bits.sum(0)).all()


def test_polish_ends_on_a_local_optimum_and_never_loses(calib, template, tmp_path):
    base = ECADConfig(pop_size=4, generations=1, granularity="stack", forecast_order=1, seed=2)
    plain = ecad_search(calib, tmp_path / "a", base, template=template, progress=False)
    ratio = 3 / STEPS
    polished = ecad_search(calib, tmp_path / "b", dataclasses.replace(base, polish_ratios=(ratio,),
                                                                      polish_evaluations=100),
                           template=template, progress=False)

    def best(front):
        return max((p for p in front["points"] if p["compute_ratio"] <= ratio + 1e-9), key=lambda p: p["quality"])

    assert len(polished["evaluated"]) >= len(plain["evaluated"])
    assert best(polished)["quality"] >= best(plain)["quality"]
    top = Plan.load(tmp_path / "b" / best(polished)["plan"])
    x = rows_to_genome(top.actions["cond"])
    for y in shift_moves(x, STEPS):  # no neighbour at the same ratio scores higher
        m = measure(calib, template, genome_plan(y, template, base, method="n"))
        assert m.quality <= best(polished)["quality"] + 1e-9


def test_seeds_beyond_the_population_are_scored_and_kept_dominated(calib, template, tmp_path):
    rows = {"a": ["C", "C", "F", "F", "C"], "b": ["C", "C", "C", "F", "C"], "c": ["C", "F", "C", "C", "C"]}
    seeds = {k: dataclasses.replace(template.plan("stack", r, method="seed"), forecast_order=1)
             for k, r in rows.items()}
    cfg = ECADConfig(pop_size=4, generations=1, granularity="stack", forecast_order=1)  # 3 seeded slots, 3 fixed-k
    front = ecad_search(calib, tmp_path, cfg, template=template, progress=False, seed_plans=seeds)
    named = {e["seed"]: e for e in front["evaluated"] if e["seed"]}
    assert set(rows) <= set(named)
    for name, plan in seeds.items():
        assert named[name]["quality"] == pytest.approx(measure(calib, template, plan).quality, abs=1e-9)
        assert any(p["compute_ratio"] <= named[name]["compute_ratio"] + 1e-12
                   and p["quality"] >= named[name]["quality"] - 1e-12 for p in front["points"])


def test_a_seed_method_that_cannot_run_is_reported_not_dropped_silently(tiny_pipe):
    from dcache.pipelines.search_cli import SeedPlanSkipped, dynamic_seed_plans

    calib = make_calibration(tiny_pipe, steps=STEPS)
    with pytest.warns(SeedPlanSkipped, match=r"seed plan no-such-method skipped: no-such-method cannot be applied"):
        seeds = dynamic_seed_plans(tiny_pipe, calib, ("no-such-method", "fora"))
    assert list(seeds) and all(k.startswith("fora") for k in seeds)  # the others are still recorded
