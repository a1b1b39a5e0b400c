"""benchmarks/frontier.py's scenarios per bundled model: every keyframe budget lands in its band, in the model's own
CFG mode, and the untuned / transferred keyframe plans have the budget's counts."""

import pytest


@pytest.fixture(scope="module")
def frontier(load_benchmark):
    return load_benchmark("frontier")


@pytest.mark.parametrize("model", ["digits", "motion", "shapes"])
def test_every_budget_is_inside_its_band(frontier, model):
    tol = frontier.methods.BAND_TOL
    for scenario in frontier.ALL[model].values():
        budgets = scenario.budgets()
        assert {band for band, _, _ in budgets} == set(scenario.bands), scenario.name  # every band has a budget
        for band, cond, uncond in budgets:
            calls = cond + (uncond if scenario.branches == 2 else 0)
            ratio = calls / (scenario.steps * scenario.branches)
            assert band / tol <= ratio <= band * tol, (model, scenario.name, band, cond, uncond, ratio)


def test_batched_cfg_decides_once_per_step(frontier):
    shapes = frontier.ALL["shapes"]["cfg4"]
    assert shapes.mode == "batched" and shapes.branches == 1
    assert frontier.ALL["motion"]["cfg5"].branches == 2


def test_uniform_and_transferred_plans_match_the_budgets(frontier):
    scenario = frontier.ALL["motion"]["cfg5"]
    plans = frontier.uniform_plans(scenario)
    for band, cond, uncond in scenario.budgets():
        plan = plans[f"{cond}+{uncond}"]
        assert len(plan["keyframes"]) == cond and plan["keyframes"][0] == 0.0 and plan["keyframes"][-1] == 1.0
        assert len(plan.get("uncond_keyframes", plan["keyframes"])) == uncond
    assert frontier.transferred_plans("motion", scenario) == {}  # 20 steps: tiny-digits' 28-step plans do not fit
    shapes = frontier.ALL["shapes"]["cfg4"]
    moved = frontier.transferred_plans("shapes", shapes)
    assert set(moved) == set(frontier.uniform_plans(shapes)) and moved["5"] == frontier.KEYFRAMES["nocfg"]["5"]


def test_split_cfg_scenarios_with_an_uneven_budget_also_report_the_even_ones(frontier):
    """The band selection takes the budget closest to the band's ratio (6 + 5 at 0.2 with 28 steps), so the even
    budget beside it (6 + 6: both branches on the same steps) needs its own contender to be shown at all."""
    def labels(scenario, plans, l2p=None):
        return {c.method: c for c in frontier.contenders(scenario, plans, quick=False, cache_dit=False,
                                                         calibration_run=None, l2p_plans=l2p)}

    cfg3 = frontier.ALL["digits"]["cfg3"]
    fitted = {name: {**plan, "forecaster": "l2p-table"} for name, plan in frontier.KEYFRAMES["cfg3"].items()}
    found = labels(cfg3, frontier.KEYFRAMES["cfg3"], fitted)
    for method in ("keyframe call even", "keyframe call even foca", "keyframe call l2p even"):
        assert set(found[method].search.values) == {"6+6", "4+4"}  # no plan with uncond_keyframes
    assert set(found["keyframe call"].search.values) == {"6+5", "6+6", "4+3", "4+4"}
    nocfg = frontier.ALL["digits"]["nocfg"]  # one decision per step: every budget is "even" already
    assert "keyframe call even" not in labels(nocfg, frontier.KEYFRAMES["nocfg"])
    steps10 = frontier.ALL["digits"]["steps10"]  # split CFG, but its budgets are all even
    assert "keyframe call even" not in labels(steps10, frontier.KEYFRAMES["steps10"])


def test_merged_runs_keep_each_scenario_with_the_run_that_measured_it(frontier):
    def run(commit, names):
        meta = dict(command=f"python benchmarks/frontier.py # {commit}", git_commit=commit, date="2026-11-29 08:00",
                    load_start="0.1 0.1 0.1", load_end="0.2 0.2 0.2")
        return dict(meta=meta, scenarios=[dict(name=n, psnr=commit) for n in names])

    new, old = run("bbbbbbb", ["cfg3"]), run("aaaaaaa", ["cfg1.5", "cfg3", "nocfg"])
    merged = frontier.merge_runs(new, old)
    assert merged["meta"] == new["meta"]
    assert [sc["name"] for sc in merged["scenarios"]] == ["cfg1.5", "cfg3", "nocfg"]  # the old run's order
    by_name = {sc["name"]: sc for sc in merged["scenarios"]}
    assert by_name["cfg3"]["psnr"] == "bbbbbbb" and "measured" not in by_name["cfg3"]  # the new run wins
    assert by_name["nocfg"]["measured"]["git_commit"] == "aaaaaaa"
    assert "aaaaaaa" in frontier._provenance(by_name["nocfg"])[0] and frontier._provenance(by_name["cfg3"]) == []
    again = frontier.merge_runs(run("ccccccc", ["cfg1.5"]), merged)  # a scenario keeps the run that measured it
    assert {sc["name"]: sc.get("measured", {}).get("git_commit") for sc in again["scenarios"]} == {
        "cfg1.5": None, "cfg3": "bbbbbbb", "nocfg": "aaaaaaa"}


def test_the_keyframe_searches_reach_the_optimum_of_an_analytic_score(frontier):
    """search_keyframes (even and uneven budgets) and search_cfg_difference run the library's starts and ascent
    (keyframe_search.best_placement / ascend / ascend_left_out) on the tuning score: on a separable score with one
    optimum they land on it, and the returned fractions are the step indices over N - 1."""
    scenario = frontier.Scenario("toy", 20, 3.0, (0.2,))
    cond_t, uncond_t = [0, 3, 9, 14, 18], [0, 5, 12, 17]

    def steps(fractions):
        return [round(f * 19) for f in fractions]

    def measure(setting):
        sc = steps(setting["keyframes"])
        su = steps(setting.get("uncond_keyframes") or setting["keyframes"])
        cost = sum((s - t) ** 2 for s, t in zip(sc, cond_t))
        return -cost - (sum((s - t) ** 2 for s, t in zip(su, uncond_t)) if len(su) == len(uncond_t) else 0)

    even = frontier.search_keyframes(None, scenario, 5, 5, 2, lambda _: None, measure=measure)
    assert steps(even["keyframes"]) == cond_t and even["uncond_keyframes"] is None and even["tune_psnr"] == 0
    uneven = frontier.search_keyframes(None, scenario, 5, 4, 2, lambda _: None, measure=measure)
    assert (steps(uneven["keyframes"]), steps(uneven["uncond_keyframes"])) == (cond_t, uncond_t)
    assert uneven["tune_psnr"] == 0
    with pytest.raises(ValueError, match="leaves out exactly one uncond keyframe"):
        frontier.search_keyframes(None, scenario, 5, 3, 2, lambda _: None, measure=measure)


def test_the_cfg_difference_search_picks_the_left_out_keyframe(frontier, monkeypatch):
    scenario = frontier.Scenario("toy", 20, 3.0, (0.2,))
    target, drop = [0, 4, 9, 15, 19], 3  # the uncond branch leaves out step 15

    def tuning_psnr(bench, keyframes, uncond_keyframes, order, cfg_difference):
        sc, su = ([round(f * 19) for f in k] for k in (keyframes, uncond_keyframes))
        return -sum((s - t) ** 2 for s, t in zip(sc, target)) - (0 if su == target[:drop] + target[drop + 1:] else 1)

    monkeypatch.setattr(frontier, "_tuning_psnr", tuning_psnr)
    found = frontier.search_cfg_difference(None, scenario, (0.0, 0.25, 0.5, 0.75, 1.0), 2, lambda _: None)
    assert [round(f * 19) for f in found["keyframes"]] == target and found["cfg_difference"] is True
    assert [round(f * 19) for f in found["uncond_keyframes"]] == [0, 4, 9, 19]


def test_the_left_out_search_climbs_to_the_best_uneven_placement_of_an_analytic_score(frontier):
    """search_left_out scores settings (cond keyframes, uncond = cond minus one; each placement once) and returns the
    best the left-out ascent reaches from its distinct starts: here cond steps at `target`, the uncond branch leaving
    out the third keyframe."""
    from dcache.schedules.tuning.search.keyframe_search import step_indices

    scenario = frontier.ALL["digits"]["cfg3"]
    n, target = scenario.steps, [0, 7, 16, 22]
    scored = []

    def score(setting: dict) -> float:
        cond, uncond = (step_indices(setting[key], n) for key in ("keyframes", "uncond_keyframes"))
        scored.append((tuple(cond), tuple(uncond)))
        assert len(uncond) == len(cond) - 1 and set(uncond) < set(cond) and setting["order"] == 2
        return -sum((c - t) ** 2 for c, t in zip(cond, target)) - (0.0 if 16 not in uncond else 0.5)

    found = frontier.search_left_out(scenario, [[0, 8, 17, 24], [0, 8, 17, 24], [0, 10, 20, 24]], 2, score,
                                     "l2p cfg-diff", lambda line: None)
    assert step_indices(found["keyframes"], n) == target and "cfg_difference" not in found
    assert step_indices(found["uncond_keyframes"], n) == [0, 7, 22]
    assert len(scored) == len(set(scored))  # every placement scored once
