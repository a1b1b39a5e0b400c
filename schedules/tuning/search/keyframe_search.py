"""Keyframe search: where to compute, for a given number of computed steps, on the user's own calibration set.

The `keyframe` method computes at a few fixed places in normalised time t in [0, 1] and forecasts every other step
from them with a Taylor series (schedules/keyframe.py). Which places work best depends on the model and the prompts:
uniform spacing is a good start, the best placement is often denser early. For each budget of k computed calls per
branch this search

  1. scores uniform placements of k keyframes ending at 80, 90 and 100 % of the generation (order 2),
  2. moves one keyframe at a time by -2..+2 steps while the calibration quality rises by more than `min_gain`
     (coordinate ascent, at most `rounds` passes),
  3. tries the placement with order 1 and keeps the better order,
  4. with `forecaster="l2p"`, searches the placement again (the same uniform starts and the step-3 placement,
     then the same ascent) scoring each with the L2P forecaster fitted for it on the calibration's `fit_runs`
     (other seeds; without them on the scored run itself, in-sample): the fit runs are recorded uncached once
     (dcache.schedules.tuning.l2p_fit.delta_grams), each placement's
     table is solved from those Gram matrices for every ridge of `l2p_ridges` and scored (one cadence generation and
     one generation per ridge), the best ridge is the placement's score; L2P is kept where it beats the Taylor
     series by more than `min_gain`. Searched apart because the placement that suits a Taylor series need not suit a
     fitted predictor (on the bundled video model at 0.15 with CFG 5: 15.8 dB with L2P on the Taylor placement,
     16.2 dB on its own); with split CFG in call scope, the kept L2P placement is then also scored with
     `cfg_difference=True` serving the unconditional branch through L2P's table for the CFG difference, at every
     ridge, and kept where that scores better by more than `min_gain`,
  5. with `uneven_cfg=True` (split CFG, call scope), also searches the uneven budget of k conditional and k - 1
     unconditional calls served with `cfg_difference=True` (the unconditional calls the branch does not compute
     served as the conditional output minus a forecast of the CFG difference; dcache.runtime.cfg_difference):
     from the step-3 placement and the uniform starts of step 1, every keyframe but the first is tried as the one the
     unconditional branch leaves out, then from the best of those the conditional keyframes move as in step 2 (the
     left-out one with them) and the left-out one is chosen again, while the quality rises by more than `min_gain`;
     with `forecaster="l2p"` the same left-out ascent runs again (from that placement and the step-3 one) scored
     served by L2P fitted for each candidate with its table for the CFG difference (best ridge), kept where it
     scores better by more than `min_gain` (the placement that suits the Taylor forecast of the difference need not
     suit the fitted one: on the bundled digit model at guidance 3, 4 + 3 of 56 calls, 32.4 dB held out on the
     Taylor-placed keyframes, 33.6 dB on keyframes searched for L2P's difference); finally the placement is scored
     with each branch served from its own cache (by the Taylor series, and by L2P's branch tables where L2P serves
     the difference), and kept that way where the difference did not score better (it never ends below that, and a
     setup never carries a difference that serves nothing). An uneven budget is the only way to reach (2k - 1) / 2N
     of the calls with split CFG, and without the difference the branch one keyframe short stops the two branches'
     forecast errors from cancelling in the guidance sum (benchmarks/frontier.py, bundled digit model, guidance 3,
     held out: 6 + 5 of 56 calls 34.1 dB on keyframes searched without the difference, 39.0 dB with it on keyframes
     searched for it),

scoring each setting by one calibration generation (the calibration's quality_fn, e.g. PSNR to the uncached images;
the worst guidance scale with several). Every score is saved to <out>/keyframe-scores.json as it is measured, so a
rerun with the same calibration resumes where it stopped. The result per budget is a plan (recorded from the best
setting; its FORECAST rows replay in normalised time at any step count) and a setup file (method "keyframe" with
its knobs and scope: the same placement, applied natively at any step count), named keyframe-k<k> (and
keyframe-k<k>u<k - 1> for the uneven budget).

Scope: the keyframe schedule decides from the step alone, so it runs in call scope (the whole transformer call
served; fastest at batch 1) or in block scope. "auto" searches in call scope and keeps, per budget, the scope that
scores better on the calibration set.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import dcache
from dcache.files.checks import is_number, same
from dcache.generations.health import quiet
from dcache.files.atomic import read_json
from dcache.api.setup_file import Setup
from dcache.files.state_file import StateFileError
from dcache.schedules.keyframe import keyframe_steps
from dcache.schedules.tuning.l2p_fit import AUTO_RIDGES, delta_grams, l2p_statistics, solve_l2p

from .core import Calibration, FrontPoint, Template, is_main_process, make_template, measure, write_front, write_json

SCORES_FILE = "keyframe-scores.json"
MAX_SCORES_BYTES = 16 << 20  # one "order|scope|steps[|u=steps][|l2p=ridge][|cfg-diff]" key per setting: hundreds
SCOPES = ("blocks", "call", "auto")
FORECASTERS = ("taylor", "l2p")  # what serves between keyframes: the Taylor series, or L2P fitted here


@dataclass(frozen=True)
class KeyframeSearchConfig:
    budgets: tuple[int, ...] = (6, 4)  # computed calls per branch (keyframes), one searched placement each
    scope: str = "call"  # "blocks" | "call" | "auto" (searched in call scope, the better scope kept per budget)
    rounds: int = 6  # coordinate-ascent passes over the keyframes
    min_gain: float = 0.03  # quality gain (dB for PSNR) a move must bring to be taken
    forecaster: str = "taylor"  # "l2p": also fit L2P per budget on the calibration set, kept where it scores better
    l2p_ridges: tuple[float, ...] = AUTO_RIDGES  # the L2P ridges scored per placement (fewer: a faster search)
    uneven_cfg: bool = False  # also k + (k - 1) calls per budget with cfg_difference (split CFG, call scope)

    def __post_init__(self) -> None:
        if not self.budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 2 for b in self.budgets):
            raise ValueError(f"budgets={self.budgets!r}: give computed calls per branch as ints >= 2, e.g. (6, 4) "
                             f"(--budget 6,4, or compute ratios such as 0.25,0.15).")
        if self.scope not in SCOPES:
            raise ValueError(f"scope={self.scope!r} must be one of {', '.join(SCOPES)}.")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise ValueError(f"rounds={self.rounds!r} must be an int >= 0 (0 keeps the best uniform placement).")
        if not is_number(self.min_gain, 0.0):
            raise ValueError(f"min_gain={self.min_gain!r} must be a finite number >= 0.")
        if self.forecaster not in FORECASTERS:
            raise ValueError(f"forecaster={self.forecaster!r} must be one of {', '.join(FORECASTERS)} (--forecaster).")
        if not isinstance(self.uneven_cfg, bool):
            raise ValueError(f"uneven_cfg={self.uneven_cfg!r} must be True or False.")
        if self.uneven_cfg and self.scope == "blocks":
            raise ValueError("uneven_cfg=True (--uneven-cfg) serves the unconditional calls through the CFG "
                             "difference, which works in call scope only: use --scope call or --scope auto.")
        if not self.l2p_ridges or not all(is_number(r, 0.0) for r in self.l2p_ridges):
            raise ValueError(f"l2p_ridges={self.l2p_ridges!r} (--l2p-ridges): give one or more finite ridges >= 0 "
                             f"(the pull towards the Taylor weights; 0 is plain least squares), e.g. {AUTO_RIDGES}.")


def fractions(steps: list[int], num_steps: int) -> tuple[float, ...]:
    """Step indices -> keyframes in normalised time (step / (N - 1)), as the keyframe method takes them."""
    return tuple(round(s / (num_steps - 1), 4) for s in steps)


def step_indices(keyframes, num_steps: int) -> list[int]:
    """Keyframes in normalised time -> the sorted steps a num_steps generation computes (the keyframe schedule's
    own rule; the inverse of `fractions`)."""
    return sorted(keyframe_steps(tuple(keyframes), num_steps))


def uniform(k: int, last: int) -> list[int]:
    """k step indices spread evenly over 0..last (fewer when steps coincide)."""
    return sorted({round(i * last / (k - 1)) for i in range(k)}) if k > 1 else [0]


class ScoreBook:
    """The quality of every setting scored so far, saved after each one (resumable), keyed "order|scope|i,j,..."
    (Taylor), "...|l2p=ridge" (L2P fitted for that placement with that ridge), "...|u=i,j,..." (the unconditional
    branch's own keyframes) and "...|cfg-diff" (served with cfg_difference=True)."""

    def __init__(self, path: Path | None, settings: dict[str, Any]):
        self.path, self.settings = path, settings
        self.scores: dict[str, float] = self._load() if path is not None and path.is_file() else {}

    def _load(self) -> dict[str, float]:
        fix = "delete it (the rerun scores the settings again) or pass a new --out"
        data = read_json(self.path, MAX_SCORES_BYTES, "keyframe score file", fix, StateFileError)
        if not isinstance(data, dict) or not isinstance(data.get("scores"), dict):
            raise StateFileError(f"the keyframe score file {str(self.path)!r} holds no table of scores; {fix}.")
        if not same(data.get("settings"), self.settings):
            return {}  # scores of another calibration set or step count: not evidence here; overwritten
        scores = data["scores"]
        if not all(isinstance(k, str) and _parse_key(k) is not None and is_number(v) for k, v in scores.items()):
            raise StateFileError(f"the keyframe score file {str(self.path)!r} holds entries that are not "
                                 f"\"order|scope|steps[|l2p=ridge[|cfg-diff]]\": finite quality; {fix}.")
        return {k: float(v) for k, v in scores.items()}

    def get(self, key: str, measure_fn: Callable[[], float]) -> float:
        if key not in self.scores:
            self.scores[key] = measure_fn()
            if self.path is not None and is_main_process():
                write_json(self.path, {"format": "dcache.keyframe-scores", "version": 1, "settings": self.settings,
                                       "scores": self.scores})
        return self.scores[key]


def _key(order: int, scope: str, steps: list[int], ridge: float | None = None, difference: bool = False,
         uncond: list[int] | None = None) -> str:
    return (f"{order}|{scope}|{_steps(steps)}" + ("" if uncond is None else f"|u={_steps(uncond)}")
            + ("" if ridge is None else f"|l2p={ridge:g}") + ("|cfg-diff" if difference else ""))


def _steps(steps: list[int]) -> str:
    return ",".join(map(str, steps))


def _parse_key(key: str) -> tuple | None:
    """The parts of a score key ("order|scope|steps", then optionally "u=steps", "l2p=ridge", "cfg-diff" in that
    order), or None where it is not one."""
    parts = key.split("|")
    if len(parts) < 3 or parts[0] not in ("1", "2") or parts[1] not in ("blocks", "call") or not _is_steps(parts[2]):
        return None
    rest = parts[3:]
    if rest and rest[0].startswith("u=") and _is_steps(rest[0][2:]):
        rest = rest[1:]
    if rest and rest[0].startswith("l2p=") and is_number(_float(rest[0][4:]), 0.0):
        rest = rest[1:]
    if rest == ["cfg-diff"]:
        rest = []
    return tuple(parts) if not rest else None


def _is_steps(text: str) -> bool:
    return all(s.isdecimal() and len(s) < 6 for s in text.split(","))


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def keyframe_search(calib: Calibration, out_dir: str | os.PathLike,
                    config: KeyframeSearchConfig = KeyframeSearchConfig(), *, template: Template | None = None,
                    progress: bool = True) -> dict:
    """Search a keyframe placement per budget on the calibration set; write plans, setups and the front."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = template or make_template(calib)
    n = template.num_steps
    too_many = [b for b in config.budgets if b > n]
    if too_many:
        raise ValueError(f"budgets {too_many} ask for more keyframes than the {n} steps of the calibration run; "
                         f"give at most {n} per branch, or search with more --steps.")
    reference = calib.reference()
    book = ScoreBook(out / SCORES_FILE, {**calib.settings, "num_steps": n})

    def score(order: int, scope: str, steps: list[int]) -> float:
        return book.get(_key(order, scope, steps),
                        lambda: _quality(calib, reference, scope, keyframes=fractions(steps, n), order=order))

    search_scope = "blocks" if config.scope == "blocks" else "call"
    l2p = L2PScores(calib, reference, book, n, config.l2p_ridges) if config.forecaster == "l2p" else None
    if config.uneven_cfg and not _splits_cfg(calib):
        raise ValueError("uneven_cfg=True (--uneven-cfg) needs a pipeline that runs guidance as separate 'cond' and "
                         "'uncond' transformer calls (split CFG): this one does not (batched CFG, or no guidance), "
                         "so there is no unconditional call to leave out. Search without --uneven-cfg.")
    points, found = [], []
    from tqdm.auto import tqdm

    def save(name: str, setting: dict, scope: str, budget: int | str) -> None:
        plan = _record_plan(calib, setting, scope, budget)
        points.append(FrontPoint(name, plan, measure(calib, template, plan)))
        knobs = {**setting, **{key: list(setting[key]) for key in ("keyframes", "uncond_keyframes") if key in setting}}
        Setup(method="keyframe", knobs=knobs, scope=scope).save(out / "setups" / f"{name}.setup.json")

    with tqdm(total=len(config.budgets) * (2 if config.uneven_cfg else 1), desc="keyframe budgets", leave=False,
              disable=not (progress and is_main_process())) as bar:
        for k in config.budgets:
            quality, steps = best_placement(lambda s: score(2, search_scope, s), k, n, config)
            order = 1 if score(1, search_scope, steps) > quality else 2
            scope = search_scope
            if config.scope == "auto" and score(order, "blocks", steps) > score(order, "call", steps):
                scope = "blocks"
            quality, served = score(order, scope, steps), "taylor"
            taylor_quality, taylor_steps, forecaster = quality, steps, None
            if l2p is not None:
                fitted, placed = best_placement(lambda s: l2p.best(order, scope, s)[0], k, n, config, also=steps)
                if fitted > quality + config.min_gain:
                    quality, served, steps, forecaster = fitted, "l2p", placed, l2p.table(order, scope, placed)
            difference = False
            if forecaster is not None and scope == "call" and l2p.splits_cfg():
                coupled = l2p.best(order, scope, steps, difference=True)[0]
                if coupled > quality + config.min_gain:
                    quality, difference = coupled, True
                    forecaster = l2p.table(order, scope, steps, difference=True)
            setting = {"keyframes": fractions(steps, n), "order": order}
            if forecaster is not None:
                setting["forecaster"] = forecaster
            if difference:
                setting["cfg_difference"] = True
            found.append({"budget": k, "steps": steps, "scope": scope, "forecaster": served,
                          "cfg_difference": difference, "keyframes": setting["keyframes"], "order": order,
                          "quality": quality, "taylor_quality": taylor_quality})
            save(f"keyframe-k{k}", setting, scope, k)
            bar.update(1)
            if config.uneven_cfg:
                entry, setting = _uneven_budget(calib, reference, book, l2p, taylor_steps, order, n, config)
                found.append(entry)
                save(f"keyframe-k{k}u{k - 1}", setting, "call", f"{k}+{k - 1}")
                bar.update(1)
    fitted_on = {} if l2p is None else {"l2p_fitted_on": "fit runs held out from the scoring" if calib.fit_runs
                                        else "the scored calibration set (in-sample)"}
    return write_front(out, "keyframe", points, config={**asdict(config), "budgets": list(config.budgets),
                                                         "found": found, **fitted_on})


def best_placement(score: Callable[[list[int]], float], k: int, n: int, config: KeyframeSearchConfig,
                   also: list[int] | None = None) -> tuple[float, list[int]]:
    """(quality, step indices) of the best placement of k keyframes found by uniform starts (and `also`) +
    coordinate ascent from the best start."""
    best: tuple[float, list[int]] | None = None
    starts = uniform_starts(k, n)
    for steps in starts + ([also] if also is not None and also not in starts else []):
        q = score(steps)
        if best is None or q > best[0]:
            best = (q, steps)
    return ascend(score, *best, n, config, config.rounds)


def uniform_starts(k: int, n: int) -> list[list[int]]:
    """k keyframes spread evenly up to 80, 90 and 100 % of n steps: where each placement search starts."""
    return [uniform(k, max(round(end * (n - 1)), k - 1)) for end in (0.8, 0.9, 1.0)]


def ascend(score: Callable[[list[int]], float], quality: float, steps: list[int], n: int,
           config: KeyframeSearchConfig, rounds: int) -> tuple[float, list[int]]:
    """Coordinate ascent: up to `rounds` passes moving one keyframe (not the first) by -2..+2 steps, a move taken
    where the quality rises by more than min_gain."""
    for _ in range(rounds):
        improved = False
        for i in range(1, len(steps)):  # the first keyframe stays at step 0: nothing is cached before it
            for move in (-2, -1, 1, 2):
                moved = list(steps)
                moved[i] += move
                after = moved[i + 1] if i + 1 < len(moved) else n
                if not moved[i - 1] < moved[i] < after:
                    continue
                q = score(moved)
                if q > quality + config.min_gain:
                    quality, steps, improved = q, moved, True
        if not improved:
            break
    return quality, steps


def left_out(steps: list[int], drop: int) -> list[int]:
    """`steps` without its entry at index `drop`: the unconditional keyframes of an uneven budget."""
    return steps[:drop] + steps[drop + 1:]


def ascend_left_out(score: Callable[[list[int], int], float], starts: list[list[int]], n: int,
                    config: KeyframeSearchConfig) -> tuple[float, list[int], int]:
    """(quality, conditional keyframes, index of the one the unconditional branch leaves out) maximising
    score(cond steps, left-out index) over n steps: on each start every keyframe but the first (step 0, where both
    branches compute) is tried as the left-out one and the best start kept; then passes of `ascend` (the left-out
    keyframe moving with its index) alternate with choosing the left-out one again, at most `config.rounds` times,
    while the quality rises by more than `config.min_gain`. Ties go to the later keyframe and the earlier start."""
    def best_drop(steps: list[int]) -> tuple[float, int]:
        return max((score(steps, d), d) for d in range(1, len(steps)))

    (quality, drop), steps = max(((best_drop(s), s) for s in starts), key=lambda item: item[0])
    for _ in range(config.rounds):
        moved_quality, steps = ascend(lambda s: score(s, drop), quality, steps, n, config, 1)
        improved, quality = moved_quality > quality, moved_quality
        again, other = best_drop(steps)
        if again > quality + config.min_gain:
            quality, drop, improved = again, other, True
        if not improved:
            break
    return quality, steps, drop


def _uneven_budget(calib: Calibration, reference: torch.Tensor, book: ScoreBook, l2p: L2PScores | None,
                   start: list[int], order: int, n: int, config: KeyframeSearchConfig) -> tuple[dict, dict]:
    """(found entry, keyframe setting) of the uneven budget: len(start) conditional keyframes, the unconditional
    branch leaving one of them out, served with cfg_difference=True in call scope (module docstring, step 5)."""
    def score(steps: list[int], drop: int) -> float:
        uncond = left_out(steps, drop)
        return book.get(_key(order, "call", steps, difference=True, uncond=uncond), lambda: _quality(
            calib, reference, "call", keyframes=fractions(steps, n), uncond_keyframes=fractions(uncond, n),
            order=order, cfg_difference=True))

    starts = [list(start)] + [u for u in uniform_starts(len(start), n) if u != list(start)]
    quality, steps, drop = ascend_left_out(score, starts, n, config)
    uncond = left_out(steps, drop)
    setting = {"keyframes": fractions(steps, n), "uncond_keyframes": fractions(uncond, n), "order": order,
               "cfg_difference": True}
    taylor_quality, served = quality, "taylor"
    if l2p is not None and l2p.splits_cfg():  # placed again for L2P's own forecast of the difference
        fitted, placed, dropped = ascend_left_out(
            lambda s, d: l2p.best(order, "call", s, difference=True, uncond=left_out(s, d))[0],
            [steps] + ([list(start)] if list(start) != steps else []), n, config)
        if fitted > quality + config.min_gain:
            quality, served, steps, uncond = fitted, "l2p", placed, left_out(placed, dropped)
            setting.update(keyframes=fractions(steps, n), uncond_keyframes=fractions(uncond, n),
                           forecaster=l2p.table(order, "call", steps, difference=True, uncond=uncond))
    # never below its own baseline: the same placement with each branch served from its own cache (the run-time
    # check of the difference scores the served calls, the calibration scores the finished samples), by the Taylor
    # series and, where L2P serves the difference, by L2P's branch tables too: a difference that L2P serves no better
    # than its own tables (e.g. one it can never check: no step after the first where both branches compute) is
    # left off, so the setup does not carry a cfg_difference that does nothing
    own_setting = {key: setting[key] for key in ("keyframes", "uncond_keyframes", "order")}
    own = book.get(_key(order, "call", steps, uncond=uncond), lambda: _quality(
        calib, reference, "call", keyframes=setting["keyframes"], uncond_keyframes=setting["uncond_keyframes"],
        order=order))
    own_served = "taylor"
    if served == "l2p":
        fitted_own = l2p.best(order, "call", steps, uncond=uncond)[0]
        if fitted_own > own:
            own, own_served = fitted_own, "l2p"
            own_setting["forecaster"] = l2p.table(order, "call", steps, uncond=uncond)
    if own >= quality:
        quality, served, setting = own, own_served, own_setting
    entry = {"budget": len(steps), "uncond_budget": len(uncond), "steps": steps, "uncond_steps": uncond,
             "scope": "call", "forecaster": served, "cfg_difference": "cfg_difference" in setting,
             "keyframes": setting["keyframes"], "uncond_keyframes": setting["uncond_keyframes"], "order": order,
             "quality": quality, "taylor_quality": taylor_quality, "own_caches_quality": own}
    return entry, setting


def _splits_cfg(calib: Calibration) -> bool:
    """Whether the calibration pipeline runs guidance as separate "cond" / "uncond" transformer calls (the branches
    one keyframe generation ran)."""
    handle = dcache.apply(calib.pipe, "keyframe", scope="call", count_flops=False)
    try:
        with quiet(), torch.no_grad():
            calib.generate()
        branches = set(handle.stats().branches)
    finally:
        handle.remove()
    return {"cond", "uncond"} <= branches


class L2PScores:
    """The calibration quality of keyframe placements served by L2P fitted on the calibration set for each: the
    uncached calibration run recorded once (its Gram matrices, on first use), a placement's statistics from them
    (one cadence generation), one scored generation per ridge (each saved in the book). The table is fitted at the
    calibration's step count; at another count the Taylor series serves instead."""

    def __init__(self, calib: Calibration, reference: torch.Tensor, book: ScoreBook, num_steps: int,
                 ridges: tuple[float, ...] = AUTO_RIDGES):
        self.calib, self.reference, self.book, self.num_steps, self.ridges = calib, reference, book, num_steps, ridges
        self._grams: list | None = None
        self._statistics: dict[tuple, dict] = {}

    @property
    def runs(self) -> list:
        """What the tables are fitted on: the calibration's fit runs (other seeds than the scored ones), or, where it
        has none, the scored calibration run itself (then every L2P score is in-sample)."""
        return list(self.calib.fit_runs) or [self.calib.generate]

    def grams(self) -> list:
        """The fit runs' Gram matrices (recorded uncached on first use)."""
        if self._grams is None:
            with quiet(), torch.no_grad():
                self._grams = delta_grams(self.calib.pipe, self.runs, progress=False)
        return self._grams

    def statistics(self, order: int, steps: list[int], uncond: list[int] | None = None) -> dict:
        """The L2P statistics of a placement (uncond: the unconditional branch's own keyframes)."""
        key = (order, tuple(steps), None if uncond is None else tuple(uncond))
        if key not in self._statistics:
            grams = self.grams()
            with quiet(), torch.no_grad():
                self._statistics[key] = l2p_statistics(
                    self.calib.pipe, self.runs, "keyframe", order=order,
                    progress=False, grams=grams, **self._placement(steps, uncond))
        return self._statistics[key]

    def _placement(self, steps: list[int], uncond: list[int] | None) -> dict:
        keyframes = {"keyframes": fractions(steps, self.num_steps)}
        return keyframes if uncond is None else {**keyframes, "uncond_keyframes": fractions(uncond, self.num_steps)}

    def best(self, order: int, scope: str, steps: list[int], difference: bool = False,
             uncond: list[int] | None = None) -> tuple[float, float]:
        """(quality, ridge) of the best ridge at this placement (difference: with cfg_difference=True, the
        unconditional branch served through the table for the CFG difference; uncond: its own keyframes)."""
        def measure_one(ridge: float) -> float:
            table = solve_l2p(self.statistics(order, steps, uncond), ridge)
            return _quality(self.calib, self.reference, scope, **self._placement(steps, uncond), order=order,
                            forecaster=table, **({"cfg_difference": True} if difference else {}))

        scored = [(self.book.get(_key(order, scope, steps, r, difference, uncond), lambda r=r: measure_one(r)), r)
                  for r in self.ridges]
        return max(scored, key=lambda item: item[0])

    def splits_cfg(self) -> bool:
        """Whether the calibration runs split CFG into a conditional and an unconditional call (their recording
        holds the CFG difference, so cfg_difference can be served from a fitted table)."""
        return any(kind == "difference" for _, _, kind in self.grams())

    def table(self, order: int, scope: str, steps: list[int], difference: bool = False,
              uncond: list[int] | None = None) -> dict:
        """The forecaster spec of the best ridge at this placement (difference: as scored with cfg_difference)."""
        return solve_l2p(self.statistics(order, steps, uncond), self.best(order, scope, steps, difference, uncond)[1])


def _quality(calib: Calibration, reference: torch.Tensor, scope: str, **knobs: Any) -> float:
    """The calibration quality of the keyframe method with `knobs` (a non-finite one as +-1e9: JSON-safe, ranked)."""
    handle = dcache.apply(calib.pipe, "keyframe", scope=scope, count_flops=False, **knobs)
    try:
        with quiet(), torch.no_grad():
            value = float(calib.quality_fn(calib.generate().detach().float().cpu(), reference))
    finally:
        handle.remove()
    return value if math.isfinite(value) else (1e9 if value > 0 else -1e9)


def _record_plan(calib: Calibration, setting: dict, scope: str, k: int | str):
    """The plan of one keyframe setting, recorded on the calibration set (count_flops: the front's compute ratio)."""
    handle = dcache.apply(calib.pipe, "keyframe", scope=scope, **setting)
    try:
        with quiet(), torch.no_grad():
            calib.generate()
        plan = handle.plan()
    finally:
        handle.remove()
    named = {"forecaster": setting["forecaster"]["name"]} if "forecaster" in setting else {}  # its table: extras
    lists = {key: list(setting[key]) for key in ("keyframes", "uncond_keyframes") if key in setting}
    plan.provenance.update(method="keyframe", config={**setting, **named, **lists, "scope": scope, "budget": k},
                           calibration=dict(calib.settings))
    return plan
