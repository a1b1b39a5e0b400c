"""`dcache search --method keyframe`: a placement per budget that scores at least the uniform one on the
calibration set, a plan and a setup file that replay it (the setup at any step count), every score saved as measured
(a rerun resumes), and teaching errors for budgets and damaged score files."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from search_testkit import make_calibration
from typer.testing import CliRunner

import dcache
from dcache.generations.health import DCacheHealthWarning
from dcache.pipelines.cli import app
from dcache.schedules.tuning.search import KeyframeSearchConfig, keyframe_search
from dcache.schedules.tuning.search.core import make_template
from dcache.schedules.tuning.search.keyframe_search import SCORES_FILE, uniform
from dcache.files.state_file import StateFileError

STEPS = 8


class Counted:
    """A calibration generate() that counts its calls."""

    def __init__(self, generate):
        self.generate, self.calls = generate, 0

    def __call__(self):
        self.calls += 1
        return self.generate()


@pytest.fixture(scope="module")
def searched(tmp_path_factory, tiny_pipe):
    out = tmp_path_factory.mktemp("kf")
    calib = make_calibration(tiny_pipe, steps=STEPS)
    calib.generate = Counted(calib.generate)
    front = keyframe_search(calib, out, KeyframeSearchConfig(budgets=(4, 3), scope="auto", rounds=2),
                            progress=False)
    return calib, out, front


def test_the_front_has_a_plan_and_a_setup_per_budget_that_replay_the_measured_quality(searched, tiny_pipe):
    calib, out, front = searched
    assert [p["name"] for p in sorted(front["points"], key=lambda p: p["name"])] == ["keyframe-k3", "keyframe-k4"]
    reference = calib.reference()
    for point in front["points"]:
        k = int(point["name"].removeprefix("keyframe-k"))
        assert point["compute_ratio"] <= (k + 0.5) / STEPS  # k computed calls per branch of STEPS
        for spec in (out / point["plan"], out / "setups" / f"{point['name']}.setup.json"):
            with dcache.apply(tiny_pipe, str(spec)):
                images = calib.generate().float().cpu()
            assert calib.quality_fn(images, reference) == pytest.approx(point["quality"], abs=1e-6), spec


def test_the_placement_scores_at_least_the_uniform_one(searched):
    calib, out, front = searched
    scores = json.loads((out / SCORES_FILE).read_text())["scores"]
    for found in front["config"]["found"]:
        k = found["budget"]
        starts = [scores[key] for key in scores if key.startswith("2|call|")
                  and key.endswith(",".join(map(str, uniform(k, STEPS - 1))))]
        assert starts and found["quality"] >= max(starts) - 1e-9


def test_a_rerun_resumes_from_the_saved_scores(searched, tiny_pipe):
    calib, out, _ = searched
    first = calib.generate.calls
    scored = len(json.loads((out / SCORES_FILE).read_text())["scores"])
    again = make_calibration(tiny_pipe, steps=STEPS)
    again.generate = Counted(again.generate)
    keyframe_search(again, out, KeyframeSearchConfig(budgets=(4, 3), scope="auto", rounds=2), progress=False)
    assert scored >= 10 and again.generate.calls <= first - scored  # no setting scored twice


def test_the_setup_places_the_keyframes_in_normalised_time_at_another_step_count(searched, tiny_pipe):
    _, out, front = searched
    found = next(f for f in front["config"]["found"] if f["budget"] == 4)
    with dcache.apply(tiny_pipe, str(out / "setups" / "keyframe-k4.setup.json")) as handle:
        tiny_pipe(labels=[1], num_inference_steps=16, output_type="pt")
    assert handle.setup().knobs["keyframes"] == list(found["keyframes"])
    assert handle.stats().compute_ratio == pytest.approx(4 / 16, abs=0.03)  # 4 keyframes of 16 steps


def test_budgets_and_damaged_score_files_are_refused_with_the_fix(tmp_path, tiny_pipe):
    with pytest.raises(ValueError, match="ints >= 2"):
        KeyframeSearchConfig(budgets=(1,))
    with pytest.raises(ValueError, match="scope"):
        KeyframeSearchConfig(scope="everywhere")
    calib = make_calibration(tiny_pipe, steps=4)
    with pytest.raises(ValueError, match="more keyframes than the 4 steps"):
        keyframe_search(calib, tmp_path, KeyframeSearchConfig(budgets=(6,)), template=make_template(calib),
                        progress=False)
    damaged = tmp_path / "d"
    damaged.mkdir()
    (damaged / SCORES_FILE).write_text(json.dumps({"scores": "lots"}))
    with pytest.raises(StateFileError, match="delete it"):
        keyframe_search(calib, damaged, KeyframeSearchConfig(budgets=(2,)), progress=False)


def test_dcache_search_keyframe_writes_plans_and_setups(tmp_path):
    out = tmp_path / "s"
    torch.set_num_threads(2)  # what torch would start with on 2 cores; the bundled model runs on 1
    try:
        result = CliRunner().invoke(app, ["search", "--method", "keyframe", "--steps", "6", "--budget", "3",
                                          "--prompts", "1", "--scope", "call", "--out", str(out)])
    finally:
        threads, _ = torch.get_num_threads(), torch.set_num_threads(1)
    assert result.exit_code == 0, result.output
    assert threads == 1 and "cpu (1 torch thread)" in result.output  # it says the thread count it ran with
    assert (out / "plans" / "keyframe-k3.plan.json").is_file() and (out / "front.png").is_file()
    setup = json.loads((out / "setups" / "keyframe-k3.setup.json").read_text())
    assert setup["method"] == "keyframe" and setup["scope"] == "call" and len(setup["knobs"]["keyframes"]) == 3
    assert "setup.json" in result.output


def test_dcache_search_l2p_ridges_sets_the_ridges_each_placement_is_scored_at(tmp_path):
    out = tmp_path / "s"
    args = ["search", "--method", "keyframe", "--steps", "6", "--budget", "3", "--prompts", "1", "--scope", "call"]
    result = CliRunner().invoke(app, args + ["--forecaster", "l2p", "--l2p-ridges", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / SCORES_FILE).read_text())
    assert {key.rsplit("=", 1)[1] for key in saved["scores"] if "|l2p=" in key} == {"0"}  # plain least squares alone
    # fitted on the prompts at seed 1, scored at seed 0: said in the front, the plan and the score file's settings
    assert json.loads((out / "front.json").read_text())["config"]["l2p_fitted_on"].startswith("fit runs held out")
    plan = json.loads((out / "plans" / "keyframe-k3.plan.json").read_text())
    assert plan["provenance"]["calibration"]["l2p_fit_seed"] == 1 == saved["settings"]["l2p_fit_seed"]
    for bad, says in ((["--forecaster", "l2p", "--l2p-ridges", "1,-1"], ">= 0"),
                      (["--forecaster", "l2p", "--l2p-ridges", "ten"], "comma-separated numbers"),
                      (["--l2p-ridges", "1"], "--forecaster l2p only")):
        result = CliRunner().invoke(app, args + bad + ["--out", str(tmp_path / "bad")])
        assert result.exit_code == 2 and "--l2p-ridges" in result.output and says in result.output, result.output
        assert not (tmp_path / "bad").exists()


def test_l2p_tables_are_fitted_on_the_fit_runs_and_scored_on_the_calibration_set(tmp_path, tiny_pipe):
    """With fit runs (the calibration prompts at another seed) a placement's L2P table is the one fitted on them,
    not on the scored samples: the ridge and the L2P-or-Taylor choice are made on samples the fit never saw."""
    from dcache.schedules.tuning.l2p_fit import l2p_statistics, solve_l2p
    from dcache.schedules.tuning.search.keyframe_search import L2PScores, ScoreBook, fractions

    calib = make_calibration(tiny_pipe, steps=STEPS, guidance=5.0)
    held_out = make_calibration(tiny_pipe, steps=STEPS, guidance=5.0, seed=1).generate
    calib.fit_runs, calib.generate = [Counted(held_out)], Counted(calib.generate)
    reference = calib.reference()
    scores = L2PScores(calib, reference, ScoreBook(tmp_path / SCORES_FILE, {"num_steps": STEPS}), STEPS, (1.0,))
    steps = [0, 3, 6]
    table, quality = scores.table(2, "call", steps), scores.best(2, "call", steps)[0]

    def fitted(run) -> dict:
        return solve_l2p(l2p_statistics(tiny_pipe, [run], "keyframe", order=2, progress=False,
                                        keyframes=fractions(steps, STEPS)), 1.0)

    def gap(a: dict, b: dict) -> float:
        assert a["weights"].keys() == b["weights"].keys()
        return max(abs(x - y) for key in a["weights"] for x, y in zip(a["weights"][key], b["weights"][key]))

    assert gap(table, fitted(held_out)) < 1e-9 < 1e-3 < gap(table, fitted(calib.generate.generate))
    assert calib.fit_runs[0].calls == 2  # recorded uncached once, one cadence generation
    assert calib.generate.calls == 2  # the reference and the one scored generation
    with dcache.apply(tiny_pipe, "keyframe", scope="call", keyframes=fractions(steps, STEPS), forecaster=table):
        assert calib.quality_fn(calib.generate().float().cpu(), reference) == pytest.approx(quality, abs=1e-6)


# On the bundled model at 8 steps (labels 1 and 7): at its guidance 1.5 L2P wins one budget and the Taylor series the
# other, the CFG difference neither; at guidance 5 L2P with the CFG difference wins both. Every path is exercised.
@pytest.mark.parametrize("guidance, kinds_found", [(None, {("taylor", False), ("l2p", False)}),
                                                   (5.0, {("l2p", True)})], ids=["guidance-1.5", "guidance-5"])
def test_l2p_is_fitted_per_placement_searched_apart_kept_only_where_it_scores_better_and_replays(
        tmp_path, tiny_pipe, guidance, kinds_found):
    """forecaster="l2p": per budget the placement is searched again with L2P fitted on the calibration set for each
    candidate (every ridge of l2p_ridges scored and saved in the score file), starting from the uniform ones and the
    Taylor series' placement; L2P is kept only where its best beats the Taylor series' quality by min_gain; the kept
    placement is scored with cfg_difference (the bundled pipeline splits CFG) at every ridge and that kept only where
    it gains min_gain more; the plan and the setup carry the table and replay the quality the front reports; a rerun
    scores nothing again."""
    calib = make_calibration(tiny_pipe, steps=STEPS, guidance=guidance)
    calib.generate = Counted(calib.generate)
    config = KeyframeSearchConfig(budgets=(3, 2), rounds=1, forecaster="l2p", l2p_ridges=(10.0, 0.0))
    front = keyframe_search(calib, tmp_path, config, progress=False)
    scores = json.loads((tmp_path / SCORES_FILE).read_text())["scores"]
    reference = calib.reference()
    kinds = set()
    for found in front["config"]["found"]:
        k, order = found["budget"], found["order"]
        taylor = max(v for key, v in scores.items() if key.count("|") == 2 and len(key.split("|")[2].split(",")) == k
                     and key.startswith(f"{order}|"))
        assert found["taylor_quality"] == taylor  # the Taylor series' best at this budget and order
        l2p_scores = {key: v for key, v in scores.items() if key.startswith(f"{order}|call|") and "|l2p=" in key
                      and len(key.split("|")[2].split(",")) == k}
        plain = {key: v for key, v in l2p_scores.items() if not key.endswith("|cfg-diff")}
        placements = {key.split("|l2p=")[0] for key in plain}
        assert len(placements) >= 3  # the uniform starts at least, each at every ridge:
        assert all(f"{p}|l2p={r:g}" in plain for p in placements for r in config.l2p_ridges)
        kinds.add((found["forecaster"], found["cfg_difference"]))
        if found["forecaster"] == "l2p":
            assert found["quality"] > taylor + 0.03
            kept = f"{order}|call|{','.join(map(str, found['steps']))}"
            coupled = [l2p_scores[f"{kept}|l2p={r:g}|cfg-diff"] for r in config.l2p_ridges]  # KeyError: not scored
            if found["cfg_difference"]:
                assert found["quality"] == max(coupled) > max(plain.values()) + 0.03
            else:  # the best L2P placement and ridge scored
                assert found["quality"] == max(plain.values()) and max(coupled) <= found["quality"] + 0.03
        else:
            assert found["quality"] == taylor and max(plain.values()) <= taylor + 0.03
            assert not found["cfg_difference"] and len(l2p_scores) == len(plain)
        name = f"keyframe-k{k}"
        setup = json.loads((tmp_path / "setups" / f"{name}.setup.json").read_text())
        plan = json.loads((tmp_path / "plans" / f"{name}.plan.json").read_text())
        served = setup["knobs"].get("forecaster", {"name": "taylor"})["name"]
        assert served == found["forecaster"] == plan.get("extras", {}).get("forecaster", {"name": "taylor"})["name"]
        point = next(p for p in front["points"] if p["name"] == name)
        assert point["quality"] == pytest.approx(found["quality"], abs=1e-6)  # the plan records what was scored
        for spec in (tmp_path / "plans" / f"{name}.plan.json", tmp_path / "setups" / f"{name}.setup.json"):
            with dcache.apply(tiny_pipe, str(spec)):
                images = calib.generate().float().cpu()
            assert calib.quality_fn(images, reference) == pytest.approx(point["quality"], abs=1e-6), spec
    assert kinds == kinds_found
    again = make_calibration(tiny_pipe, steps=STEPS, guidance=guidance)
    again.generate = Counted(again.generate)
    rerun = keyframe_search(again, tmp_path, config, progress=False)
    assert rerun["config"]["found"] == front["config"]["found"]
    # resumed: the reference, the template and the recording once, and per budget the winner's cadence, plan and
    # front point; no placement or ridge is scored again
    assert again.generate.calls <= 3 + 3 * len(config.budgets)
    with pytest.raises(ValueError, match="taylor, l2p"):
        KeyframeSearchConfig(forecaster="spectrum")
    with pytest.raises(ValueError, match="l2p_ridges"):
        KeyframeSearchConfig(forecaster="l2p", l2p_ridges=(1.0, -1.0))
    result = CliRunner().invoke(app, ["search", "--method", "lemica", "--forecaster", "l2p", "--steps", "6"])
    assert result.exit_code == 2 and "--method keyframe only" in result.output


def test_uneven_cfg_leaves_one_uncond_keyframe_out_served_through_the_difference_and_replays(tmp_path, tiny_pipe):
    """uneven_cfg=True: per budget k also k cond + k - 1 uncond calls with cfg_difference (call scope, split CFG):
    the uncond keyframes are the cond ones minus one (never step 0), the placement scores at least the even
    placement with its best left-out keyframe, and beats the same keyframes without the difference (at guidance 3 the
    branch one keyframe short stops the branches' errors from cancelling); L2P with its difference table is scored at
    every ridge on that placement; the plan and the setup replay the reported quality; bad uses are refused."""
    steps, k = 10, 4
    calib = make_calibration(tiny_pipe, steps=steps, guidance=3.0)
    config = KeyframeSearchConfig(budgets=(k,), scope="call", rounds=1, uneven_cfg=True, forecaster="l2p",
                                  l2p_ridges=(1.0,))
    front = keyframe_search(calib, tmp_path, config, progress=False)
    even, uneven = front["config"]["found"]
    assert (uneven["budget"], uneven["uncond_budget"]) == (k, k - 1) and uneven["cfg_difference"]
    assert uneven["uncond_steps"][0] == 0 and set(uneven["uncond_steps"]) < set(uneven["steps"])
    scores = json.loads((tmp_path / SCORES_FILE).read_text())["scores"]
    start = ",".join(map(str, even["steps"] if even["forecaster"] == "taylor" else ()))
    if start:  # the search started from the Taylor series' even placement, each keyframe but the first left out
        starts = [v for key, v in scores.items() if key.startswith(f"{uneven['order']}|call|{start}|u=")
                  and key.endswith("|cfg-diff") and "|l2p=" not in key]
        assert len(starts) == k - 1 and uneven["taylor_quality"] >= max(starts)
    for end in (0.8, 0.9, 1.0):  # ... and from the uniform starts, the best of all ascended
        placed = ",".join(map(str, uniform(k, round(end * (steps - 1)))))
        drops = [v for key, v in scores.items() if key.startswith(f"{uneven['order']}|call|{placed}|u=")
                 and key.endswith("|cfg-diff") and "|l2p=" not in key]
        assert len(drops) == k - 1 and uneven["taylor_quality"] >= max(drops)
    cond, left = (",".join(map(str, uneven[key])) for key in ("steps", "uncond_steps"))
    placed = f"{uneven['order']}|call|{cond}|u={left}"
    fitted = [scores[f"{placed}|l2p={r:g}|cfg-diff"] for r in config.l2p_ridges]  # KeyError: L2P not scored there
    assert uneven["quality"] == (max(fitted) if uneven["forecaster"] == "l2p" else uneven["taylor_quality"])
    # L2P with its difference table was placed by its own left-out ascent: scored at several uneven placements, the
    # best of them kept where it beats the Taylor series' placement by min_gain
    l2p_uneven: dict[str, float] = {}  # placement -> its best ridge
    for key, v in scores.items():
        if "|u=" in key and "|l2p=" in key:
            placement = key.split("|l2p=")[0]
            l2p_uneven[placement] = max(v, l2p_uneven.get(placement, v))
    assert len(l2p_uneven) > k - 1
    if uneven["forecaster"] == "l2p":
        assert uneven["quality"] == max(l2p_uneven.values()) > uneven["taylor_quality"] + config.min_gain
    else:
        assert max(l2p_uneven.values()) <= uneven["taylor_quality"] + config.min_gain
    reference = calib.reference()
    knobs = dict(keyframes=uneven["keyframes"], uncond_keyframes=uneven["uncond_keyframes"], order=uneven["order"])
    with dcache.apply(tiny_pipe, "keyframe", scope="call", **knobs):
        without = calib.quality_fn(calib.generate().float().cpu(), reference)
    assert uneven["quality"] > without + 1.0  # the difference beats the same keyframes without it
    assert scores[placed] == pytest.approx(without, abs=1e-6)  # the Taylor series' own caches: scored, not kept
    own_l2p = [v for key, v in scores.items() if key.startswith(f"{placed}|l2p=") and not key.endswith("|cfg-diff")]
    assert uneven["forecaster"] != "l2p" or own_l2p  # L2P's own tables: a baseline wherever L2P served D
    assert uneven["own_caches_quality"] == pytest.approx(max([without, *own_l2p]), abs=1e-6)
    name = f"keyframe-k{k}u{k - 1}"
    point = next(p for p in front["points"] if p["name"] == name)
    assert point["compute_ratio"] == pytest.approx((2 * k - 1) / (2 * steps), abs=0.01)
    setup = json.loads((tmp_path / "setups" / f"{name}.setup.json").read_text())
    assert setup["knobs"]["cfg_difference"] is True and setup["scope"] == "call"
    for spec in (tmp_path / "plans" / f"{name}.plan.json", tmp_path / "setups" / f"{name}.setup.json"):
        with dcache.apply(tiny_pipe, str(spec)):
            images = calib.generate().float().cpu()
        assert calib.quality_fn(images, reference) == pytest.approx(point["quality"], abs=1e-6), spec
    with pytest.raises(ValueError, match="call scope only"):
        KeyframeSearchConfig(scope="blocks", uneven_cfg=True)
    with pytest.raises(ValueError, match="split CFG"):
        keyframe_search(make_calibration(tiny_pipe, steps=4, guidance=1.0), tmp_path / "nocfg",
                        KeyframeSearchConfig(budgets=(2,), uneven_cfg=True), progress=False)
    for args, says in ((["--method", "lemica"], "--method keyframe only"), (["--method", "keyframe"], "--scope call")):
        result = CliRunner().invoke(app, ["search", *args, "--uneven-cfg", "--steps", "6",
                                          "--out", str(tmp_path / "x")])
        assert result.exit_code == 2 and says in result.output, result.output


def test_an_uneven_budget_where_the_difference_scores_worse_keeps_the_own_caches(tmp_path, tiny_pipe, monkeypatch):
    """The uneven placement is finally scored with each branch served from its own cache; where that scores at least
    as well as the difference (here made so: the own caches' scores are raised), the plan and setup leave
    cfg_difference off, so a search never ends below that baseline."""
    import importlib

    search = importlib.import_module("dcache.schedules.tuning.search.keyframe_search")  # the module, not the function
    real = search._quality

    def own_caches_win(calib, reference, scope, **knobs):
        raised = "uncond_keyframes" in knobs and not knobs.get("cfg_difference")
        return real(calib, reference, scope, **knobs) + (100.0 if raised else 0.0)

    monkeypatch.setattr(search, "_quality", own_caches_win)
    calib = make_calibration(tiny_pipe, steps=8, guidance=3.0)
    front = keyframe_search(calib, tmp_path, KeyframeSearchConfig(budgets=(3,), scope="call", rounds=1,
                                                                  uneven_cfg=True), progress=False)
    uneven = front["config"]["found"][1]
    assert uneven["cfg_difference"] is False and uneven["quality"] == uneven["own_caches_quality"]
    assert uneven["quality"] > uneven["taylor_quality"] + 50
    setup = json.loads((tmp_path / "setups" / "keyframe-k3u2.setup.json").read_text())
    assert "cfg_difference" not in setup["knobs"]
    assert list(setup["knobs"]["uncond_keyframes"]) == list(uneven["uncond_keyframes"])


def test_an_uneven_budget_never_carries_a_difference_that_serves_nothing(tmp_path, tiny_pipe):
    """k = 2 with L2P: the unconditional branch computes step 0 only, so cfg_difference finds no later step where both
    branches computed, cannot check the difference and never serves it. Scored with the difference, the setting is
    then just L2P's own tables (which beat the Taylor series' here); compared with the Taylor own caches only, it used
    to keep cfg_difference=True in the plan and setup, and every replay warned that it did nothing. The baseline is
    now the same forecaster's own caches: the setup leaves the difference off, keeps L2P's tables and replays its
    quality without a warning."""
    calib = make_calibration(tiny_pipe, steps=STEPS, guidance=3.0)
    config = KeyframeSearchConfig(budgets=(2,), scope="call", rounds=1, uneven_cfg=True, forecaster="l2p",
                                  l2p_ridges=(1.0, 0.0))
    front = keyframe_search(calib, tmp_path, config, progress=False)
    uneven = front["config"]["found"][1]
    assert uneven["uncond_steps"] == [0] and uneven["cfg_difference"] is False
    assert uneven["quality"] == uneven["own_caches_quality"] >= uneven["taylor_quality"]
    setup = json.loads((tmp_path / "setups" / "keyframe-k2u1.setup.json").read_text())
    assert "cfg_difference" not in setup["knobs"]
    assert ("forecaster" in setup["knobs"]) == (uneven["forecaster"] == "l2p")
    point = next(p for p in front["points"] if p["name"] == "keyframe-k2u1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DCacheHealthWarning)  # e.g. cfg_difference_unchecked
        with dcache.apply(tiny_pipe, str(tmp_path / "setups" / "keyframe-k2u1.setup.json")):
            images = calib.generate().float().cpu()
    assert calib.quality_fn(images, calib.reference()) == pytest.approx(point["quality"], abs=1e-6)


def test_the_left_out_ascent_finds_the_best_placement_and_left_out_keyframe_of_an_analytic_score():
    """ascend_left_out on a separable score with one optimum: cond steps at `target`, the keyframe at index 2 left
    out. From a uniform start it moves every keyframe there (each move one of -2..+2 steps), picks index 2, and
    takes no move worth <= min_gain; the benchmark's cfg-diff search and the library's uneven budget both use it."""
    from dcache.schedules.tuning.search.keyframe_search import ascend_left_out, left_out

    n, target = 20, [0, 3, 9, 14, 18]
    scored = []

    def score(steps: list[int], drop: int) -> float:
        scored.append((tuple(steps), drop))
        return -sum((s - t) ** 2 for s, t in zip(steps, target)) - (0.0 if drop == 2 else 0.5)

    config = KeyframeSearchConfig(rounds=6, min_gain=0.03)
    quality, steps, drop = ascend_left_out(score, [uniform(5, n - 1), [0, 2, 4, 6, 8]], n, config)
    assert (steps, drop, quality) == (target, 2, 0.0) and left_out(steps, drop) == [0, 3, 14, 18]
    assert all(d >= 1 for _, d in scored)  # step 0 is never left out
    # a gain no larger than min_gain is not taken: with min_gain 1 the last unit steps towards the target stay
    _, coarse, _ = ascend_left_out(score, [uniform(5, n - 1)], n, KeyframeSearchConfig(min_gain=1.0))
    assert sum((s - t) ** 2 for s, t in zip(coarse, target)) > 0
