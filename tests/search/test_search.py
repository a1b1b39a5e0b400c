"""Plan search on the tiny digit model: ECAD (resume), LeMiCa, DP, CLI wiring; plans replay bit-exactly."""

import itertools
import json
import random

import pytest
import torch

import dcache
from dcache.plans.plan import Plan, PlanError
from dcache.schedules.tuning.search import (DPConfig, ECADConfig, LeMiCaConfig, convert_rows, dp_schedule, dp_search,
                                            ecad_search, leximax_path, lemica_search, make_template, run_plan)
from dcache.schedules.tuning.search.dp import group_costs

from search_testkit import STEPS, make_calibration


@pytest.fixture(scope="module")
def template(tiny_pipe):
    return make_template(make_calibration(tiny_pipe, steps=STEPS))


def _front_points(front):
    return [(p["name"], round(p["quality"], 9), round(p["compute_ratio"], 9)) for p in front["points"]]


def _assert_replays(calib, out_dir, front, template):
    """Every front plan loads, replays bit-exactly (twice, same images) and re-measures to the recorded numbers."""
    assert front["points"]
    for p in front["points"]:
        plan = Plan.load(out_dir / p["plan"])
        assert plan.provenance["quality"]["quality"] == p["quality"]
        first, second = run_plan(calib, plan), run_plan(calib, plan)
        assert torch.equal(first, second)
        assert calib.quality_fn(first, calib.reference()) == pytest.approx(p["quality"], abs=1e-9)
        assert template.compute_ratio(plan) == pytest.approx(p["compute_ratio"])
    assert (out_dir / "front.png").stat().st_size > 0 and (out_dir / "summary.md").is_file()
    assert json.loads((out_dir / "front.json").read_text())["points"] == front["points"]


def test_template_costs_match_engine_stats_for_block_plans(tiny_pipe, template):
    calib = make_calibration(tiny_pipe, steps=STEPS)
    rows = ["C" * 8] + ["CRCRRRCC", "RRRRRRRR", "CCCCCCCC", "RCRCRCRC"]
    plan = template.plan("block", rows, method="test")
    handle = dcache.apply(tiny_pipe, plan)
    calib.generate()
    assert handle.stats().compute_ratio == pytest.approx(template.compute_ratio(plan), rel=1e-9)
    handle.remove()
    assert sum(template.module_cost) < sum(template.block_cost)  # modules are part of the blocks


def test_convert_rows_stack_to_module(template):
    plan = Plan(granularity="stack", units=["stack"], num_steps=STEPS, actions={"cond": ["C", "R", "C", "F", "C"]},
                probe_blocks=1, tail_blocks=1, **template.header)
    rows = convert_rows(plan, template, "module")
    assert rows[0] == "C" * len(template.module_units)
    for u, block in enumerate(template.module_block):
        assert rows[1][u] == ("C" if block in (0, 7) else "R")
        assert rows[3][u] == rows[1][u]


def test_ecad_end_to_end_and_replay(calib, template, tmp_path):
    front = ecad_search(calib, tmp_path, ECADConfig(pop_size=6, generations=2), template=template, progress=False)
    _assert_replays(calib, tmp_path, front, template)
    ratios = [p["compute_ratio"] for p in front["points"]]
    quality = [p["quality"] for p in front["points"]]
    assert ratios == sorted(ratios) and quality == sorted(quality)  # a Pareto front: more compute, more quality
    assert all(r < 1.0 for r in ratios)  # the all-compute default is excluded by the constraint


def test_ecad_resume_gives_the_same_front(calib, template, tmp_path):
    config = ECADConfig(pop_size=6, generations=3, seed=3)
    straight = ecad_search(calib, tmp_path / "a", config, template=template, progress=False)

    def crash(generation, info):
        if generation == 1:
            raise KeyboardInterrupt("simulated crash after generation 1")

    with pytest.raises(KeyboardInterrupt):
        ecad_search(calib, tmp_path / "b", config, template=template, progress=False, on_generation=crash)
    assert (tmp_path / "b" / "checkpoint.safetensors").is_file() and not (tmp_path / "b" / "front.json").exists()
    resumed = ecad_search(calib, tmp_path / "b", config, template=template, progress=False, resume=True)
    assert _front_points(resumed) == _front_points(straight)
    assert resumed["evaluated"] == straight["evaluated"]


def test_ecad_seeds_enter_the_population(calib, template, tmp_path):
    seed = template.plan("stack", ["C", "C", "R", "R", "C"], method="seed")  # unlike every fixed interval
    front = ecad_search(calib, tmp_path, ECADConfig(pop_size=8, generations=1), template=template, progress=False,
                        seed_plans={"myseed": seed})
    assert any(e["seed"] == "myseed" for e in front["evaluated"])


def _brute_leximax(n, weights, budget):
    best = None
    for inner in itertools.combinations(range(1, n), budget - 1):
        nodes = (0,) + inner + (n,)
        edges = list(zip(nodes, nodes[1:]))
        if not all(e in weights for e in edges):
            continue
        vec = sorted((weights[e] for e in edges), reverse=True)
        if best is None or vec < best:
            best = vec
    return best


@pytest.mark.parametrize("seed", range(5))
def test_leximax_path_matches_brute_force(seed):
    rng = random.Random(seed)
    n, span = 9, 4
    weights = {(i, j): (0.0 if j == i + 1 else rng.random())
               for i in range(n) for j in range(i + 1, min(n, i + span) + 1)}
    for budget in (3, 4, 6):
        nodes, vec = leximax_path(n, weights, budget)
        assert len(nodes) == budget and nodes[0] == 0
        assert vec == _brute_leximax(n, weights, budget)


def test_leximax_prefers_smaller_worst_edge_over_smaller_sum():
    # two 2-edge paths 0->2->4 (errors 0.5, 0.5: sum 1.0) and 0->1->4 (0, 0.6: sum 0.6): minimax takes the first
    weights = {(0, 2): 0.5, (2, 4): 0.5, (0, 1): 0.0, (1, 4): 0.6}
    assert leximax_path(4, weights, 2)[0] == [0, 2]
    with pytest.raises(ValueError, match="no schedule"):
        leximax_path(4, weights, 1)


def test_lemica_end_to_end(calib, template, tmp_path):
    front = lemica_search(calib, tmp_path, LeMiCaConfig(budgets=(3,), max_span=3), template=template, progress=False)
    _assert_replays(calib, tmp_path, front, template)
    plan = Plan.load(tmp_path / front["points"][0]["plan"])
    assert plan.granularity == "stack" and sum(r == "C" for r in plan.actions["cond"]) == 3
    edges = json.loads((tmp_path / "edges.json").read_text())["edges"]
    assert len(edges) == sum(1 for i in range(STEPS) for j in range(i + 2, min(STEPS, i + 3) + 1))
    handle = dcache.apply(calib.pipe, plan)  # the engine agrees on the cost
    calib.generate()
    assert handle.stats().compute_ratio == pytest.approx(front["points"][0]["compute_ratio"])
    handle.remove()


def test_lemica_forecast_edges_and_plans(calib, template, tmp_path):
    """forecast_order=1: edges measured with the skipped steps forecast, plans exported with F cells (Taylor 1)."""
    reuse = lemica_search(calib, tmp_path / "r", LeMiCaConfig(budgets=(3,), max_span=3), template=template,
                          progress=False)
    front = lemica_search(calib, tmp_path / "f", LeMiCaConfig(budgets=(3,), max_span=3, forecast_order=1),
                          template=template, progress=False)
    plan = Plan.load(tmp_path / "f" / front["points"][0]["plan"])
    assert plan.forecast_order == 1 and "R" not in "".join(plan.actions["cond"])
    assert sum(r == "C" for r in plan.actions["cond"]) == 3 and "F" in plan.actions["cond"]
    forecast_edges = json.loads((tmp_path / "f" / "edges.json").read_text())
    reuse_edges = json.loads((tmp_path / "r" / "edges.json").read_text())
    assert forecast_edges["forecast_order"] == 1 and forecast_edges["edges"].keys() == reuse_edges["edges"].keys()
    assert forecast_edges["edges"] != reuse_edges["edges"]
    assert calib.quality_fn(run_plan(calib, plan), calib.reference()) == pytest.approx(front["points"][0]["quality"])
    assert front["points"][0]["compute_ratio"] == pytest.approx(reuse["points"][0]["compute_ratio"])
    with pytest.raises(ValueError, match="forecast_order=-1"):
        LeMiCaConfig(forecast_order=-1)


@pytest.mark.parametrize("seed", range(4))
def test_dp_schedule_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 8
    feats = {"cond": [torch.randn(3, generator=gen) for _ in range(n)]}
    cost = group_costs(feats, max_group=4)
    for budget, lo, hi in ((3, 2, 4), (4, 1, 3)):
        starts, total = dp_schedule(cost, budget, lo, hi)
        best = min(sum(cost[a, b] for a, b in zip((0,) + c, c + (n,)))
                   for c in itertools.combinations(range(1, n), budget - 1)
                   if all(lo <= b - a <= hi for a, b in zip((0,) + c, c + (n,))))
        assert starts[0] == 0 and len(starts) == budget and total == pytest.approx(best)


def test_dp_end_to_end(calib, template, tmp_path):
    front = dp_search(calib, tmp_path, DPConfig(budgets=(3, 2)), template=template, progress=False)
    _assert_replays(calib, tmp_path, front, template)
    assert sorted(p["compute_ratio"] for p in front["points"]) == pytest.approx([2 / STEPS, 3 / STEPS])


def test_mismatched_plans_are_rejected(tiny_pipe, calib, template):
    plan = template.plan("stack", ["C", "R", "C", "R", "C"], method="test")
    with pytest.raises(PlanError, match="steps"):  # another step count
        handle = dcache.apply(tiny_pipe, plan)
        try:
            tiny_pipe(labels=[1], num_inference_steps=STEPS + 2, generator=torch.Generator().manual_seed(0),
                      output_type="pt")
        finally:
            handle.remove()
    bad = Plan.from_dict({**plan.to_dict(), "block_layout": [3, 5]})
    with pytest.raises(PlanError, match="block lists"):  # another model variant
        dcache.apply(tiny_pipe, bad)
    wrong_units = template.plan("module", ["C" * len(template.module_units)] * STEPS, method="test").to_dict()
    wrong_units["units"] = wrong_units["units"][:-1]
    wrong_units["actions"] = {b: [r[:-1] for r in rows] for b, rows in wrong_units["actions"].items()}
    with pytest.raises(PlanError, match="units"):
        dcache.apply(tiny_pipe, Plan.from_dict(wrong_units))
    assert getattr(tiny_pipe.transformer, "_dcache_engine", None) is None  # nothing left hooked


def test_cli_run_search_writes_front_and_command_is_registered(tiny_pipe, tmp_path):
    from dcache.pipelines.cli import app
    from dcache.pipelines.search_cli import run_search

    assert "search" in {c.name for c in app.registered_commands}
    front = run_search("dp", tiny_pipe, True, budget="0.6", out=str(tmp_path), steps=STEPS, prompts="1,7",
                       progress=False)
    assert len(front["points"]) == 1 and (tmp_path / front["points"][0]["plan"]).is_file()
    assert "accuracy" in front["points"][0]["metrics"] or "psnr" in front["points"][0]["metrics"]
