"""Beyond 4x: dcache's best settings against diffusers' caches and cache-dit at compute ratios 0.20 and 0.125.

    python benchmarks/frontier.py --out benchmarks/results    # every scenario (~2 h on one CPU core)
    python benchmarks/frontier.py --quick                     # one scenario, few samples, dcache + one peer (~1 min)
    python benchmarks/frontier.py --search --only cfg1.5      # search the keyframes on the tuning batch first
    python benchmarks/frontier.py --only "^cfg3$" --search-cfg-difference --no-robustness   # CFG 3 with cfg_difference
    python benchmarks/frontier.py --model motion --out benchmarks/results   # tiny-motion: frontier_motion.md

Scenarios (one pipeline, same seeds for every library; `benchmarks/methods.py`'s protocol, its Bench and Sweeper):
  * cfg1.5:  28 steps, split CFG 1.5 (the methods sweep's setting), bands 0.20 and 0.125;
  * cfg3:    28 steps, split CFG 3.0 (real guidance), bands 0.20 and 0.125;
  * nocfg:   28 steps, guidance 1 (one call per step), bands 0.20 and 0.125;
  * steps10: 10 steps, split CFG 1.5, bands 0.5 and 0.3.
Models (`--model`, `_models.py`): on tiny-digits the scenarios above, with the keyframes of KEYFRAMES (searched on
its tuning batch), uniform keyframes, the same keyframes with the FoCa forecaster and adaptive_keyframe. On tiny-
motion (Wan video, UniPC, 20 steps, split CFG 5) and tiny-shapes (SD3, 28 steps, batched CFG 4): the model's own
steps and CFG mode at its guidance ("cfg5" / "cfg4") and without CFG ("nocfg"), bands 0.20 and 0.125 (0.25, 0.2 and
0.15 at tiny-motion's 20 steps); their keyframes are searched on that model's tuning batch (seed 0, never a reported
seed) and shown beside keyframes nobody tuned (uniform spacing), the same keyframes with the FoCa forecaster and with
L2P (its keyframes searched again on seed 0 with L2P fitted per candidate on tuning seeds 1 and 2, its ridge chosen
on seed 0), adaptive_keyframe and, where the step count matches, the keyframes searched on tiny-digits.

Per scenario: the uncached references (tuning batch: labels 0-9, seed 0; held-out: seeds 1000.. x labels 0-9; the
seed-to-seed FD scale from as many uncached samples of seeds 2000..), then each contender's knob is searched on the
tuning batch for the bands (band c: c / 1.18 .. c * 1.18), and the settings closest to each band are measured:
batch-1 compute ratio and speed-up interleaved with an uncached twin (wall and CPU time; measured / ideal), held-out
PSNR / SSIM / classifier accuracy / FD. dcache's keyframes (`schedules/keyframe.py`) are the ones KEYFRAMES lists
(searched on the tuning batch by `--search`, which redoes it and uses the new ones).

Robustness: the keyframes searched for cfg1.5 exported as a step plan (`handle.plan()`, `interpolate_steps=True`)
and replayed at other guidance scales and step counts, against the same keyframes in normalised time and against
dynamic SeaCache (gated, order 2, call scope), on held-out seeds.

Writes <out>/frontier.json, frontier.md and frontier_pareto.png with the command, the commit and the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path

SCRATCH = Path(__file__).resolve().parent / "out"
MODEL_SCENARIOS = {"digits": ("cfg1.5", "cfg3", "nocfg", "steps10"), "motion": ("cfg5", "nocfg"),
                   "shapes": ("cfg4", "nocfg")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="steps10 only, 1 held-out seed x 4 labels, dcache keyframe "
                                                         "and diffusers TaylorSeer-lite, 3 timing repeats")
    ap.add_argument("--out", type=Path, default=SCRATCH, help="folder for frontier.md / .json / _pareto.png (default "
                                                              "benchmarks/out/, git-ignored; benchmarks/results "
                                                              "refreshes the tracked tables)")
    ap.add_argument("--model", default="digits", choices=tuple(MODEL_SCENARIOS),
                    help="bundled model (benchmarks/_models.py); other than digits writes frontier_<model>.*")
    ap.add_argument("--only", default=None, help=f"regex on the scenario names {MODEL_SCENARIOS}")
    ap.add_argument("--contenders", default=None, help="regex on 'library:method' of the contenders to run")
    ap.add_argument("--heldout-seeds", type=int, default=None, help="held-out seeds x 10 labels (default 10)")
    ap.add_argument("--repeats", type=int, default=None, help="timed batch-1 runs per row (default 7)")
    ap.add_argument("--search", action="store_true", help="search the keyframes on the tuning batch (coordinate "
                                                          "descent) instead of using KEYFRAMES")
    ap.add_argument("--search-cfg-difference", action="store_true", help="search the cfg_difference keyframes of "
                                                                         "the uneven CFG budgets on the tuning batch "
                                                                         "instead of using CFG_DIFFERENCE")
    ap.add_argument("--no-robustness", action="store_true", help="skip the plan-replay robustness table")
    ap.add_argument("--no-cache-dit", action="store_true", help="leave cache-dit out")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                    help="measure nothing: write one report from these frontier.json files (the first one's run, "
                         "plus each scenario it lacks from the next ones, marked with the run that measured it)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad arguments answer here, before torch and diffusers load

import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent


def _load_script(stem: str):
    """benchmarks/<stem>.py by path (benchmarks/ is not a package and must not become an importable name)."""
    name = f"dcache_benchmark_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


methods = _load_script("methods")  # its Bench, Sweeper, metrics and peers
summary = _load_script("summary")  # frontier_best, shared with assemble.py
peers = methods.peers
Applied, Contender, Search = peers.Applied, peers.Contender, peers.Search

# Searched on the tuning batch (labels 0-9, seed 0) by `--search`: scenario -> plan name -> keyframe config. A plan's
# name is its call budget per generation, "<cond>+<uncond>" keyframes with CFG, "<n>" with one branch. Every entry is
# what `--search` finds at commit c31d743 (CFG 3's 6+6 and 4+4 were older placements until then, searched before the
# keyframe schedule's later changes); search again after a change to what the keyframe schedule serves.
KEYFRAMES: dict[str, dict[str, dict]] = {
    "cfg1.5": {  # 6+5 = 11 of 56 calls (0.196), 6+6 = 0.214, 4+3 = 0.125, 4+4 = 0.143
        "6+5": dict(keyframes=(0.0, 0.2222, 0.4074, 0.6296, 0.8148, 1.0),
                    uncond_keyframes=(0.0, 0.2222, 0.4074, 0.6296, 0.8148), order=2),
        "6+6": dict(keyframes=(0.0, 0.1852, 0.3704, 0.5926, 0.8148, 1.0), order=2),
        "4+3": dict(keyframes=(0.0, 0.2963, 0.5926, 0.8889), uncond_keyframes=(0.0, 0.3704, 0.7778), order=2),
        "4+4": dict(keyframes=(0.0, 0.2963, 0.5556, 0.8519), order=2),
    },
    "cfg3": {
        "6+5": dict(keyframes=(0.0, 0.1852, 0.4074, 0.5926, 0.8148, 1.0),
                    uncond_keyframes=(0.0, 0.1852, 0.4074, 0.5926, 0.8148), order=2),
        "6+6": dict(keyframes=(0.0, 0.1852, 0.4074, 0.6296, 0.8148, 0.963), order=2),
        "4+3": dict(keyframes=(0.0, 0.2963, 0.7037, 1.0), uncond_keyframes=(0.0, 0.2963, 0.7037), order=2),
        "4+4": dict(keyframes=(0.0, 0.2963, 0.6296, 0.8889), order=2),
    },
    "nocfg": {  # one call per step: 5 of 28 (0.179), 6 (0.214), 3 (0.107), 4 (0.143)
        "5": dict(keyframes=(0.0, 0.2222, 0.4074, 0.6667, 0.8889), order=2),
        "6": dict(keyframes=(0.0, 0.2222, 0.3704, 0.5926, 0.8148, 1.0), order=2),
        "3": dict(keyframes=(0.0, 0.3704, 0.7037), order=2),
        "4": dict(keyframes=(0.0, 0.2963, 0.4815, 0.8148), order=2),
    },
    "steps10": {  # 10 of 20 calls (0.5), 6 of 20 (0.3)
        "5+5": dict(keyframes=(0.0, 0.2222, 0.4444, 0.6667, 0.8889), order=2),
        "3+3": dict(keyframes=(0.0, 0.4444, 0.8889), order=2),
    },
}


# Uneven CFG budgets with cfg_difference=True (dcache.runtime.cfg_difference): the uncond keyframes are the cond ones
# minus one (the CFG difference is known only where both branches computed). Searched on the tuning batch by
# `--search-cfg-difference` (search_cfg_difference, commit 5607507); scenarios without an entry derive them from
# KEYFRAMES.
CFG_DIFFERENCE: dict[str, dict[str, dict]] = {
    "cfg1.5": {
        "6+5 cfg-diff": dict(keyframes=(0.0, 0.2222, 0.4074, 0.6296, 0.8148, 0.963),
                             uncond_keyframes=(0.0, 0.2222, 0.4074, 0.6296, 0.8148), order=2, cfg_difference=True),
        "4+3 cfg-diff": dict(keyframes=(0.0, 0.2963, 0.6296, 0.8889), uncond_keyframes=(0.0, 0.2963, 0.6296),
                             order=2, cfg_difference=True),
    },
    "cfg3": {
        "6+5 cfg-diff": dict(keyframes=(0.0, 0.1852, 0.4074, 0.6296, 0.8519, 0.963),
                             uncond_keyframes=(0.0, 0.1852, 0.4074, 0.6296, 0.8519), order=2, cfg_difference=True),
        "4+3 cfg-diff": dict(keyframes=(0.0, 0.3704, 0.7407, 0.8889), uncond_keyframes=(0.0, 0.3704, 0.7407),
                             order=2, cfg_difference=True),
    },
}


# ------------------------------------------------------------------------------------------------------------------
# Scenarios and their bench
# ------------------------------------------------------------------------------------------------------------------

class Scenario:
    def __init__(self, name: str, steps: int, guidance: float, bands: tuple[float, ...], mode: str = "split"):
        """mode: the model's CFG mode ("split": one call per branch; "batched": both branches in one call, so one
        decision per step covers both and the budgets count steps)."""
        self.name, self.steps, self.guidance, self.bands, self.mode = name, steps, guidance, bands, mode

    @property
    def branches(self) -> int:
        """Calls per step that can decide apart: 2 with split CFG, else 1."""
        return 2 if self.guidance > 1.0 and self.mode == "split" else 1

    def targets(self) -> dict[float, float]:
        """Held-out PSNR targets per band: 5x >= 42 dB and 8x (the lowest band) >= 35 dB without CFG, 40 / 33 dB
        with it."""
        low = self.bands[-1]
        return {0.2: 42.0, low: 35.0} if self.guidance <= 1.0 else {0.2: 40.0, low: 33.0}

    def budgets(self) -> list[tuple[float, int, int]]:
        """(band, cond keyframes, uncond keyframes) to search per band: the most computed calls at or below the
        band's ratio, and one call more where that is still in the band and the floor is an uneven CFG split or
        there is one branch (0.125 at 28 steps with CFG: 4 + 3 = 0.125 and 4 + 4 = 0.143)."""
        out = []
        total = self.steps * self.branches
        for band in self.bands:
            calls = int(math.floor(band * total + 1e-9))
            for n in (calls, calls + 1):
                if n > calls and not ((self.branches == 1 or calls % 2) and n / total <= band * methods.BAND_TOL):
                    continue
                cond = math.ceil(n / self.branches)
                out.append((band, cond, n - cond if self.branches == 2 else cond))
        return out


LOW = (0.2, 0.125)  # 5x and 8x
ALL = {  # model -> scenario name -> Scenario; steps, guidance and CFG mode are each model's pipeline defaults
    "digits": {s.name: s for s in (Scenario("cfg1.5", 28, 1.5, LOW), Scenario("cfg3", 28, 3.0, LOW),
                                   Scenario("nocfg", 28, 1.0, LOW), Scenario("steps10", 10, 1.5, (0.5, 0.3)))},
    # 20 steps: 0.125 falls between 2 and 3 computed steps per branch, so its low band is 0.15 (3 of 20, 6.7x)
    # 0.25 as well: the methods sweep's lowest band, where dcache's untuned rows only tie diffusers' SeaCache on it
    "motion": {s.name: s for s in (Scenario("cfg5", 20, 5.0, (0.25, 0.2, 0.15)),
                                   Scenario("nocfg", 20, 1.0, (0.25, 0.2, 0.15)))},
    "shapes": {s.name: s for s in (Scenario("cfg4", 28, 4.0, LOW, "batched"),
                                   Scenario("nocfg", 28, 1.0, LOW, "batched"))},
}
assert all(tuple(ALL[m]) == names for m, names in MODEL_SCENARIOS.items())


class GuidedBench(methods.Bench):
    """methods.Bench at a chosen guidance scale (the sweep's bench always runs the pipeline's default)."""

    guidance: float = 1.5

    def run(self, pipe, labels: list[int], seed: int, mode: str) -> torch.Tensor:
        out = pipe(labels=labels, num_inference_steps=self.steps, generator=torch.Generator().manual_seed(seed),
                   guidance_scale=self.guidance, cfg_mode=mode, output_type="pt")
        return self.model.samples(out)


# ------------------------------------------------------------------------------------------------------------------
# Contenders
# ------------------------------------------------------------------------------------------------------------------

def _applied(handle) -> Applied:
    def ratio():
        try:
            return float(handle.stats().compute_ratio)
        except Exception:  # no generation yet
            return None

    return Applied(remove=handle.remove, compute_ratio=ratio)


def keyframe_contender(plans: dict[str, dict], scope: str, name: str | None = None,
                       note: str = "keyframes searched on the tuning batch (benchmarks/frontier.py KEYFRAMES)"
                       ) -> Contender:
    import dcache

    def enable(pipe, s):
        return _applied(dcache.apply(pipe, "keyframe", scope=scope, decisions=methods.DECISIONS, **plans[s["plan"]]))

    return Contender("dcache", name or f"keyframe {scope}", Search("plan", "values", values=tuple(plans)), enable,
                     note=note, quick={"plan": next(iter(plans))})


def uniform_plans(scenario: Scenario) -> dict[str, dict]:
    """Per budget of the scenario, keyframes nobody tuned: k per branch at 0, 1/(k-1), ..., 1 (order 2)."""
    def spaced(k: int) -> tuple[float, ...]:
        return tuple(round(i / (k - 1), 4) for i in range(k)) if k > 1 else (0.0,)

    plans = {}
    for _, cond, uncond in scenario.budgets():
        name = f"{cond}+{uncond}" if scenario.branches == 2 else f"{cond}"
        plans[name] = dict(keyframes=spaced(cond), order=2)
        if scenario.branches == 2 and uncond != cond:
            plans[name]["uncond_keyframes"] = spaced(uncond)
    return plans


def transferred_plans(model: str, scenario: Scenario) -> dict[str, dict]:
    """tiny-digits' searched keyframes for the same budgets, where the step count matches (28): its no-CFG plans
    for one decision per step, its CFG-3 plans for split CFG. Empty where nothing matches."""
    if model == "digits" or scenario.steps != 28:
        return {}
    source = KEYFRAMES["nocfg" if scenario.branches == 1 else "cfg3"]
    wanted = uniform_plans(scenario)
    return {name: plan for name, plan in source.items() if name in wanted}


def contenders(scenario: Scenario, plans: dict[str, dict], quick: bool, cache_dit: bool,
               calibration_run, diff_plans: dict[str, dict] | None = None, bench=None,
               model: str = "digits", l2p_plans: dict[str, dict] | None = None) -> list[Contender]:
    """dcache's keyframes (searched on this model's tuning batch), uniform keyframes nobody tuned (and on
    tiny-motion / tiny-shapes tiny-digits' ones where the step count matches), its FoCa forecaster on the searched
    keyframes, adaptive_keyframe, SeaCache's cadence, and the peers that apply to the model's transformer in its
    CFG mode."""
    import dataclasses

    import dcache

    spec = methods.models.MODELS[model]

    def plain(method: str, **fixed):
        return lambda pipe, s: _applied(dcache.apply(pipe, method, decisions=methods.DECISIONS, **fixed, **s))

    searched_on = f"{spec.asset}'s tuning batch (seed 0)"
    tuned_note = ("keyframes searched on the tuning batch (benchmarks/frontier.py KEYFRAMES)" if model == "digits"
                  else f"keyframes searched on {searched_on} by this run")
    # every peer's knob widened to reach the low bands (methods.py's ranges stop near 0.25)
    wide = {"TaylorSeer-lite": Search("interval", "values", values=(4, 6, 8, 10, 12, 16, 20)),
            "SeaCache": None}
    out = [keyframe_contender(plans, "call", note=tuned_note), keyframe_contender(plans, "blocks", note=tuned_note),
           Contender("dcache", "seacache o2 cadence call", Search("max_consecutive", "values",
                                                                  values=(3, 4, 5, 6, 7, 8, 10, 12)),
                     plain("seacache", gate=False, order=2, scope="call"),
                     note="dcache's best row at ~0.25 in the methods sweep, its cadence stretched")]
    foca = {name: {**plan, "forecaster": "foca"} for name, plan in plans.items()}
    out += [keyframe_contender(uniform_plans(scenario), "call", "keyframe call uniform",
                               note="uniform keyframes, order 2: no knob tuned on any model"),
            keyframe_contender(foca, "call", "keyframe call foca",
                               note=f"the searched keyframes with the FoCa forecaster ({searched_on})"),
            Contender("dcache", "adaptive_keyframe call",
                      Search("compute_ratio", "values", values=(0.25, 0.2, 0.15, 0.125, 0.1)),
                      plain("adaptive_keyframe", scope="call"),
                      note="placement chosen at run time from measured errors; defaults from tiny-digits")]
    even = {name: plan for name, plan in plans.items() if "uncond_keyframes" not in plan}
    show_even = scenario.branches == 2 and 0 < len(even) < len(plans)  # else every budget's row is already even
    if show_even:
        # With split CFG the band's closest budget is uneven (6 + 5 of 56 calls at 0.2, 4 + 3 at 0.125), so the rows
        # above never show the even one beside it (6 + 6 = 0.214, 4 + 4 = 0.143): both branches computed on the same
        # steps, where their forecast errors enter the guided output as g e_c - (g - 1) e_u and largely cancel.
        out += [keyframe_contender(even, "call", "keyframe call even",
                                   note=f"the searched even budgets only: both CFG branches on the same keyframes "
                                        f"({searched_on})"),
                keyframe_contender({name: foca[name] for name in even}, "call", "keyframe call even foca",
                                   note=f"the searched even budgets with the FoCa forecaster ({searched_on})")]
    digits_plans = transferred_plans(model, scenario)
    if digits_plans:
        out.append(keyframe_contender(digits_plans, "call", "keyframe call digits-tuned",
                                      note="tiny-digits' searched keyframes (KEYFRAMES) replayed unchanged"))
    if l2p_plans:
        l2p_note = (f"keyframes searched again for L2P, fitted per candidate placement on tuning seeds "
                    f"{L2P_FIT_SEEDS}; placement, ridge and (split CFG) cfg_difference chosen on {searched_on}")
        out.append(keyframe_contender(l2p_plans, "call", "keyframe call l2p", note=l2p_note))
        if show_even:  # L2P is fitted per searched budget, so its plans have the same names
            out.append(keyframe_contender({name: l2p_plans[name] for name in even}, "call", "keyframe call l2p even",
                                          note=f"the even budgets only; {l2p_note}"))
    if diff_plans:
        out.insert(1, keyframe_contender(diff_plans, "call", "keyframe call cfg-diff",
                                         note="uneven CFG budgets with the uncond branch served through the CFG "
                                              "difference (cfg_difference=True; keyframes: CFG_DIFFERENCE)"))
    if bench is None or hasattr(bench.pipe.transformer, "enable_cache"):  # diffusers' caches need a CacheMixin
        for c in peers.diffusers_contenders(scenario.steps, calibration_run, spec.raw_vision, spec.tensor_format,
                                            spec.taylorseer_identifiers):
            if c.cfg_mode != "split" or c.method not in ("FirstBlockCache", "MagCache", "TaylorSeer-lite",
                                                          "SeaCache"):
                continue  # PAB / FasterCache need batched CFG and do not reach these ratios (methods.md)
            if c.method == "SeaCache":
                c = dataclasses.replace(c, families=[{"max_consecutive": 5}, {"max_consecutive": 9}])
            elif c.method in wide:
                c = dataclasses.replace(c, search=wide[c.method])
            if c.method == "TaylorSeer-lite":
                c = dataclasses.replace(c, quick={"interval": 4})
            out.append(c)
    if cache_dit:
        out += peers.cache_dit_contenders(scenario.steps, spec.cache_dit_adapter,
                                          separate_cfg=scenario.mode == "split",
                                          encoder_calibrator=spec.cache_dit_encoder_calibrator)
    for c in out:  # "split" stands for the model's own CFG mode (methods.py does the same)
        if c.cfg_mode == "split":
            c.cfg_mode = scenario.mode
    if quick:
        out = [c for c in out if c.quick is not None and (c.library != "dcache" or c.method == "keyframe call")]
    return out


# ------------------------------------------------------------------------------------------------------------------
# Keyframe search (coordinate descent on the tuning batch)
# ------------------------------------------------------------------------------------------------------------------

def search_keyframes(bench, scenario: Scenario, cond: int, uncond: int, order: int, log, measure=None,
                     also: tuple[list[int], list[int]] | None = None, served: str = "Taylor") -> dict:
    """Keyframes for `cond` (+ `uncond`) computed calls maximising the tuning batch's PSNR, by the keyframe search's
    own starts and ascent (dcache.schedules.tuning.search.keyframe_search, default rounds and min_gain): uniform
    spacings ending at 80 / 90 / 100 % of the generation and `also` (cond, uncond step indices), then one keyframe
    at a time moved by -2..+2 steps while the PSNR rises by > 0.03 dB. With an uncond branch one keyframe short (an
    uneven budget), each start's uncond keyframes are its cond ones minus one (every choice tried), and each pass
    moves the cond keyframes, then the uncond ones.
    measure(setting) -> tuning PSNR of a keyframe setting (default: the Taylor series of `order`, call scope);
    `served` names what it serves in the log."""
    from dcache.schedules.tuning.search.keyframe_search import (KeyframeSearchConfig, ascend, best_placement,
                                                                fractions, left_out, uniform_starts)

    n = scenario.steps
    tied = scenario.branches == 1 or uncond == cond
    seen: dict[tuple, float] = {}
    measure = measure or (lambda setting: _tuning_psnr(bench, **setting))
    config = KeyframeSearchConfig()

    def score(sc: list[int], su: list[int]) -> float:
        key = (tuple(sc), tuple(su))
        if key not in seen:
            setting = dict(keyframes=fractions(sc, n), order=order)
            if not tied:
                setting["uncond_keyframes"] = fractions(su, n)
            seen[key] = measure(setting)
        return seen[key]

    if tied:
        p, sc = best_placement(lambda s: score(s, s), cond, n, config, also=None if also is None else list(also[0]))
        su = sc
    else:
        if uncond != cond - 1:
            raise ValueError(f"search_keyframes: an uneven budget leaves out exactly one uncond keyframe "
                             f"({cond}+{cond - 1}), not {cond}+{uncond}; fix the scenario's budgets or the plan")
        best = None
        for sc in uniform_starts(cond, n):
            for su in (left_out(sc, i) for i in range(1, len(sc))):
                p = score(sc, su)
                if best is None or p > best[0]:
                    best = (p, sc, su)
        if also is not None and score(*also) > best[0]:
            best = (score(*also), *also)
        p, sc, su = best
        for _ in range(config.rounds):
            q, sc = ascend(lambda s: score(s, su), p, sc, n, config, 1)
            q, su = ascend(lambda s: score(sc, s), q, su, n, config, 1)
            improved, p = q > p, q
            if not improved:
                break
    log(f"    keyframes {cond}+{uncond if not tied or scenario.branches == 2 else 0} order {order}: cond {sc} uncond "
        f"{su} -> tuning PSNR {p:.2f} ({served}, {len(seen)} settings)")
    return dict(keyframes=fractions(sc, n), uncond_keyframes=None if tied else fractions(su, n), order=order,
                tune_psnr=p)


def searched_plans(bench, scenario: Scenario, log) -> dict[str, dict]:
    """Per budget: keyframes searched with order 2, then order 1 tried on them; the better order is kept."""
    import dcache

    plans = {}
    for _, cond, uncond in scenario.budgets():
        found = search_keyframes(bench, scenario, cond, uncond, 2, log)
        setting = {k: v for k, v in found.items() if k != "tune_psnr" and v is not None}
        with dcache.apply(bench.pipe, "keyframe", scope="call", **{**setting, "order": 1}):
            linear = methods.psnr(bench.tune(bench.pipe, bench.mode), bench.refs[("tune", bench.mode)])
        if linear > found["tune_psnr"]:
            setting["order"] = 1
        log(f"    order {setting['order']} kept (order 2 {found['tune_psnr']:.2f} dB, order 1 {linear:.2f} dB)")
        plans[f"{cond}+{uncond}" if scenario.branches == 2 else f"{cond}"] = setting
    return plans


L2P_FIT_SEEDS = (1, 2)  # calibration runs of the L2P fit: tuning seeds, neither the one that scores nor a held-out one


def l2p_plans(bench, scenario: Scenario, plans: dict[str, dict], log,
              diff_plans: dict[str, dict] | None = None) -> dict[str, dict]:
    """Per searched plan: keyframes searched again (search_keyframes, its starts and the plan's own placement) for the
    L2P forecaster (dcache.schedules.forecasters.l2p) fitted per candidate placement on the tuning batch's labels at
    seeds L2P_FIT_SEEDS (recorded once: l2p_fit.delta_grams), each candidate scored on the tuning batch (seed 0) at
    every ridge of AUTO_RIDGES, its best ridge its score; with split CFG the found placement is then scored with
    cfg_difference=True (the uncond branch served through L2P's table for the CFG difference) at every ridge, kept
    where it gains more than 0.03 dB; as `dcache search --method keyframe --forecaster l2p` does on a user's prompts.
    An uneven budget with a cfg-diff plan (`diff_plans["<name> cfg-diff"]`, placed for the difference) also scores
    L2P with its difference table on that placement, kept where it beats both by more than 0.03 dB: the two searches
    place the keyframes for different servings, and the difference's placement suits the difference's table. Last,
    an uneven budget is searched once more served by L2P with the difference (`search_left_out`, from the plan's,
    the band's even budget's, the cfg-diff and L2P's own cond keyframes), kept where it gains 0.03 dB more: the
    cfg-diff search places the keyframes for the Taylor forecast of the difference, and the fitted difference table
    wants its own (on tiny-digits at CFG 3, 4 + 3: tuning 31.61 dB on the cfg-diff keyframes, 34.09 searched).
    The plan's order stays (the ridge's prior and the fallback)."""
    from dcache.schedules.tuning.l2p_fit import AUTO_RIDGES, delta_grams, l2p_statistics, solve_l2p
    from dcache.schedules.tuning.search.keyframe_search import fractions, step_indices

    n = scenario.steps
    runs = [lambda seed=seed: bench.run(bench.pipe, bench.tune_labels, seed, bench.mode) for seed in L2P_FIT_SEEDS]
    grams = delta_grams(bench.pipe, runs, progress=False)
    statistics: dict[tuple, dict] = {}  # placement -> its L2P statistics (one cadence generation each)
    fitted: dict[tuple, tuple[float, float, dict]] = {}  # (placement, cfg_difference) -> (tuning PSNR, ridge, table)

    def key(setting: dict) -> tuple:
        return tuple(setting["keyframes"]), tuple(setting.get("uncond_keyframes") or ()), setting["order"]

    def best_ridge(setting: dict, cfg_difference: bool = False) -> float:
        """The tuning PSNR of `setting` served by L2P fitted for its placement, at the best ridge."""
        placement = key(setting)
        if placement not in statistics:
            knobs = {k: v for k, v in setting.items() if k != "order"}
            statistics[placement] = l2p_statistics(bench.pipe, runs, "keyframe", order=setting["order"],
                                                   progress=False, grams=grams, **knobs)
        if (placement, cfg_difference) not in fitted:
            tables = {r: solve_l2p(statistics[placement], r) for r in AUTO_RIDGES}
            coupling = {"cfg_difference": True} if cfg_difference else {}
            fitted[placement, cfg_difference] = max(
                (_tuning_psnr(bench, **setting, forecaster=t, **coupling), r, t) for r, t in tables.items())
        return fitted[placement, cfg_difference][0]

    out = {}
    for name, setting in plans.items():
        order = setting.get("order", 2)
        sc = step_indices(setting["keyframes"], n)
        su = step_indices(setting.get("uncond_keyframes") or setting["keyframes"], n)
        found = search_keyframes(bench, scenario, len(sc), len(su), order, log, measure=best_ridge, also=(sc, su),
                                 served="L2P")
        placed = {k: v for k, v in found.items() if k != "tune_psnr" and v is not None}
        psnr, ridge, table = fitted[key(placed), False]
        if table.get("difference_weights"):  # split CFG: the uncond calls through the CFG difference's table
            coupled = best_ridge(placed, cfg_difference=True)
            log(f"    l2p {name} with cfg_difference: {coupled:.2f} dB at ridge {fitted[key(placed), True][1]:g} "
                f"(without {psnr:.2f})")
            if coupled > psnr + 0.03:
                (psnr, ridge, table), placed = fitted[key(placed), True], {**placed, "cfg_difference": True}
        diff_placed = (diff_plans or {}).get(f"{name} cfg-diff")
        if diff_placed and table.get("difference_weights"):
            diff_placed = {k: v for k, v in diff_placed.items() if k != "cfg_difference"}
            on_diff = best_ridge(diff_placed, cfg_difference=True)
            log(f"    l2p {name} with cfg_difference on the cfg-diff keyframes {diff_placed['keyframes']}: "
                f"{on_diff:.2f} dB at ridge {fitted[key(diff_placed), True][1]:g} (best so far {psnr:.2f})")
            if on_diff > psnr + 0.03:
                (psnr, ridge, table), placed = fitted[key(diff_placed), True], {**diff_placed, "cfg_difference": True}
        if len(su) < len(sc) and table.get("difference_weights"):  # the uneven budget searched for L2P + difference
            even = plans.get(f"{len(sc)}+{len(sc)}")  # the band's even budget: both branches on its keyframes
            starts = [sc] + [step_indices(p["keyframes"], n) for p in (even, diff_placed, placed) if p]
            joint = search_left_out(scenario, starts, order, lambda s: best_ridge(s, True), "l2p cfg-diff", log)
            if fitted[key(joint), True][0] > psnr + 0.03:
                (psnr, ridge, table), placed = fitted[key(joint), True], {**joint, "cfg_difference": True}
        on_plan = dict(keyframes=fractions(sc, n), order=order,
                       **({} if len(su) == len(sc) else {"uncond_keyframes": fractions(su, n)}))
        log(f"    l2p {name}: ridge {ridge:g}, keyframes {placed['keyframes']} (tuning PSNR {psnr:.2f}; "
            f"{best_ridge(on_plan):.2f} on the Taylor placement)")
        out[name] = {**placed, "forecaster": table}
    return out


def _tuning_psnr(bench, **setting) -> float:
    import dcache

    with dcache.apply(bench.pipe, "keyframe", scope="call", **setting):
        return methods.psnr(bench.tune(bench.pipe, bench.mode), bench.refs[("tune", bench.mode)])


def search_left_out(scenario: Scenario, starts: list[list[int]], order: int, score, label: str, log) -> dict:
    """Cond keyframes and the one the uncond branch leaves out, as a setting (keyframes, uncond_keyframes, order)
    maximising `score(setting)` (memoised per placement): the keyframe search's left-out ascent (dcache.schedules.
    tuning.search.keyframe_search.ascend_left_out, at its default rounds and min_gain) from each distinct start."""
    from dcache.schedules.tuning.search.keyframe_search import (KeyframeSearchConfig, ascend_left_out, fractions,
                                                                left_out)

    n = scenario.steps
    seen: dict[tuple, float] = {}

    def setting(sc: list[int], drop: int) -> dict:
        return dict(keyframes=fractions(sc, n), uncond_keyframes=fractions(left_out(sc, drop), n), order=order)

    def scored(sc: list[int], drop: int) -> float:
        if (tuple(sc), drop) not in seen:
            seen[tuple(sc), drop] = score(setting(sc, drop))
        return seen[tuple(sc), drop]

    distinct = [s for i, s in enumerate(starts) if s not in starts[:i]]
    p, sc, drop = ascend_left_out(scored, distinct, n, KeyframeSearchConfig())
    log(f"    {label} keyframes {len(sc)}+{len(sc) - 1} order {order}: cond {sc} uncond {left_out(sc, drop)} -> "
        f"tuning PSNR {p:.2f} ({len(seen)} settings)")
    return setting(sc, drop)


def search_cfg_difference(bench, scenario: Scenario, start: tuple[float, ...], order: int, log) -> dict:
    """Cond keyframes and the one the uncond branch leaves out, with cfg_difference (the Taylor forecast of the
    difference): `search_left_out` from `start` (the searched cond keyframes of the budget) alone, scored on the
    tuning batch."""
    from dcache.schedules.tuning.search.keyframe_search import step_indices

    found = search_left_out(scenario, [step_indices(start, scenario.steps)], order,
                            lambda setting: _tuning_psnr(bench, **setting, cfg_difference=True), "cfg-diff", log)
    return {**found, "cfg_difference": True}


def cfg_difference_plans(bench, scenario: Scenario, plans: dict[str, dict], search: bool, log) -> dict[str, dict]:
    """The uneven budgets ("<c>+<c - 1>") of `plans` with cfg_difference: searched, from CFG_DIFFERENCE, or the
    plan's cond keyframes with the uncond branch leaving out the last one."""
    if scenario.branches != 2:
        return {}
    out = {}
    for name, setting in plans.items():
        cond, _, uncond = name.partition("+")
        if not uncond or int(uncond) != int(cond) - 1:
            continue
        label = f"{name} cfg-diff"
        if search:
            out[label] = search_cfg_difference(bench, scenario, setting["keyframes"], setting.get("order", 2), log)
        elif label in CFG_DIFFERENCE.get(scenario.name, {}):
            out[label] = CFG_DIFFERENCE[scenario.name][label]
        else:
            keys = tuple(setting["keyframes"])
            out[label] = dict(keyframes=keys, uncond_keyframes=keys[:-1], order=setting.get("order", 2),
                              cfg_difference=True)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Run one scenario with methods.py's sweep
# ------------------------------------------------------------------------------------------------------------------

def run_scenario(model: str, scenario: Scenario, args, log) -> dict:
    quick = args.quick
    methods.BANDS = scenario.bands  # the sweep's search and selection read the module's bands
    heldout = args.heldout_seeds or (1 if quick else 10)
    bench = GuidedBench(steps=scenario.steps, tune_labels=[0, 1] if quick else None,
                        heldout_seeds=[methods.HELDOUT_SEED0 + i for i in range(heldout)],
                        repeats=args.repeats or (3 if quick else 7),
                        seed_labels=[0, 1, 2, 3] if quick else None, warm_twin=not quick,
                        model=methods.models.MODELS[model])
    bench.guidance = scenario.guidance
    bench.load()
    if bench.mode != scenario.mode:
        raise SystemExit(f"error: scenario {scenario.name} expects CFG mode {scenario.mode!r}, {model}'s pipeline "
                         f"runs {bench.mode!r}: fix ALL in benchmarks/frontier.py")
    started = time.time()
    log(f"== {model} {scenario.name}: {scenario.steps} steps, guidance {scenario.guidance} ({scenario.mode}), bands "
        f"{scenario.bands}")
    bench.references({bench.mode}, fd_floor=not quick)
    searched = args.search or model != "digits" or scenario.name not in KEYFRAMES
    plans = searched_plans(bench, scenario, log) if searched else KEYFRAMES[scenario.name]
    diff_plans = cfg_difference_plans(bench, scenario, plans, args.search or args.search_cfg_difference, log)
    fitted = {} if quick else l2p_plans(bench, scenario, plans, log, diff_plans)
    calibrate = lambda pipe: bench.tune(pipe, bench.mode)  # noqa: E731
    sweeper = methods.Sweeper(bench, log)
    results = []
    for c in contenders(scenario, plans, quick, cache_dit=not (args.no_cache_dit or quick),
                        calibration_run=calibrate, diff_plans=diff_plans, bench=bench, model=model,
                        l2p_plans=fitted):
        if args.contenders and not re.search(args.contenders, c.label):
            continue
        t0 = time.time()
        result = dict(library=c.library, method=c.method, note=c.note, points=[], rows=[], error=None)
        log(f"[{c.label}] search")
        try:
            result["points"] = sweeper.search(c, quick)
            for band, point in sweeper.select(result["points"], quick):
                result["rows"].append(sweeper.full(c, band, point))
        except Exception as exc:  # a contender that fails is a result
            result["error"] = f"{type(exc).__name__}: {exc}"
            log(f"  !! {c.label}: {result['error']}")
        result["restored"] = sweeper.check_restored(c)
        if not result["restored"]:
            bench.reload()
        result["seconds"] = time.time() - t0
        results.append(result)
    robust = None if (args.no_robustness or scenario.name != "cfg1.5") else robustness(bench, plans, log)
    return dict(name=scenario.name, steps=scenario.steps, guidance=scenario.guidance, bands=list(scenario.bands),
                mode=scenario.mode, targets=scenario.targets(), plans_searched_here=searched,
                plans={**plans, **diff_plans}, results=results, robustness=robust, heldout_seeds=bench.heldout_seeds,
                seed_labels=bench.seed_labels, uncached_acc=bench.refs["heldout_acc"], fd_floor=bench.refs["fd_floor"],
                seconds=time.time() - started)


# ------------------------------------------------------------------------------------------------------------------
# Robustness: a plan searched at one setting, replayed at others
# ------------------------------------------------------------------------------------------------------------------

ROBUST_SETTINGS = ((28, 1.5), (28, 3.0), (10, 1.5), (50, 1.5))  # (steps, guidance)
ROBUST_KINDS = ("replay", "keyframes", "seacache")


def robustness(bench, plans: dict[str, dict], log, seeds: int = 3) -> list[dict]:
    """Each cfg1.5 keyframe setting as (a) the step plan it makes at 28 steps, replayed with interpolate_steps
    (nearest planned step), (b) the same keyframes in normalised time, against (c) dynamic SeaCache (SEA gate, order
    2, call scope) at a fixed setting, on `seeds` held-out seeds x the labels, at other guidance / step counts."""
    import dcache

    pipe, rows = bench.pipe, []
    seeds_used = bench.heldout_seeds[:seeds]

    def images(steps, guidance):
        return torch.cat([pipe(labels=bench.seed_labels, num_inference_steps=steps, guidance_scale=guidance,
                               generator=torch.Generator().manual_seed(s), output_type="pt").images.float()
                          for s in seeds_used])

    def measured(target, steps, guidance, ref, **kw):
        with dcache.apply(pipe, target, **kw) as handle:
            out = images(steps, guidance)
            ratio = handle.stats().compute_ratio
        return dict(ratio=ratio, psnr=methods.psnr(out, ref))

    exported, caps = {}, {}
    for name, setting in plans.items():  # (a): the plan this setting makes at 28 steps, CFG 1.5
        with dcache.apply(pipe, "keyframe", scope="call", **setting) as handle:
            bench.tune(pipe, bench.mode)
            plan = handle.plan()
        plan.interpolate_steps = True
        exported[name] = plan
        caps[name] = max(1, round(1 / plan.compute_ratio()) - 1)  # SeaCache: 1 compute per 1 + cap calls at most
    for steps, guidance in ROBUST_SETTINGS:
        ref = images(steps, guidance)
        for name, setting in plans.items():
            row = dict(plan=name, steps=steps, guidance=guidance,
                       replay=measured(exported[name], steps, guidance, ref, scope="call"),
                       keyframes=measured("keyframe", steps, guidance, ref, scope="call", **setting),
                       seacache=measured("seacache", steps, guidance, ref, scope="call", order=2,
                                         threshold=4.0, max_consecutive=caps[name]))
            log(f"  robustness {name} @ {steps} steps CFG {guidance}: " + ", ".join(
                f"{k} {row[k]['ratio']:.3f}/{row[k]['psnr']:.2f} dB" for k in ROBUST_KINDS))
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------

TARGETS = {0.2: 42.0, 0.125: 35.0}  # held-out PSNR targets of the 28-step bands of tiny-digits' first runs
FD_SHARE = 0.05  # FD target: within 5 % of the uncached seed-to-seed FD


def _fmt(v, digits=2) -> str:
    return methods.fmt(v, digits)


def stem(model: str) -> str:
    """frontier (tiny-digits) or frontier_<model>."""
    return "frontier" if model == "digits" else f"frontier_{model}"


def _targets(sc: dict) -> dict[float, float]:
    """The scenario's PSNR targets per band (runs written before targets were stored: TARGETS at 28 steps)."""
    if "targets" in sc:
        return {float(k): v for k, v in sc["targets"].items()}
    return TARGETS if sc["steps"] == 28 else {}


def _provenance(sc: dict) -> list[str]:
    """A scenario kept from another run when runs' scenarios are merged (merge_runs) says where it is from."""
    m = sc.get("measured")
    if not m:
        return []
    return [f"Measured by another run, kept unchanged: `{m['command']}` at commit {m['git_commit']}, {m['date']}, "
            f"load average {m['load_start']} at the start, {m.get('load_end', '?')} at the end.", ""]


def merge_runs(new: dict, old: dict) -> dict:
    """`new` with the scenarios only `old` has, each stamped with old's command, commit, date and load (shown by
    write_report): how two runs that measured different scenarios make one report."""
    have = {sc["name"] for sc in new["scenarios"]}
    keep = {key: old["meta"][key] for key in ("command", "git_commit", "date", "load_start", "load_end")
            if key in old["meta"]}
    kept = [{**sc, "measured": sc.get("measured", keep)} for sc in old["scenarios"] if sc["name"] not in have]
    order = [sc["name"] for sc in old["scenarios"]]
    merged = sorted(new["scenarios"] + kept, key=lambda sc: order.index(sc["name"]) if sc["name"] in order else 99)
    return {**new, "scenarios": merged}


def write_report(data: dict, out: Path) -> tuple[Path, Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = stem(data["meta"].get("model", "digits"))
    md, js, png = out / f"{name}.md", out / f"{name}.json", out / f"{name}_pareto.png"
    js.write_text(json.dumps(data, indent=1, default=methods._json_default))
    pareto_png(data, png)
    meta = data["meta"]
    title = meta.get("model_title", "tiny-digits (Flux)")
    l2p = (f"L2P, where a row has it: its own keyframes searched on seed 0 in this run, fitted per candidate on "
           f"tuning seeds {L2P_FIT_SEEDS[0]}-{L2P_FIT_SEEDS[-1]}, its ridge chosen on seed 0")
    digits = meta.get("model", "digits") == "digits"
    tuned = (f"keyframes searched on tiny-digits' tuning batch (seed 0; KEYFRAMES, and the cfg-diff plans' "
             f"CFG_DIFFERENCE or this run's `--search-cfg-difference`) ({l2p})" if digits
             else f"keyframes searched on {title}'s tuning batch (seed 0) in this run ({l2p}); every other dcache "
                  f"default chosen on tiny-digits")
    lines = [f"# Beyond 4x: the frontier below compute ratio 0.25 on {title}", "", "```", meta["command"], "```", "",
             f"**Tuned on:** {tuned}. **Measured on:** {title}'s held-out seeds (below), never searched on.", "",
             f"Commit {meta['git_commit']} · {meta['date']} · {meta.get('runtime_s', 0) / 60:.1f} min · torch "
             f"{meta['torch']} · diffusers {meta['diffusers']} · cache-dit {meta['cache_dit']} · 1 torch thread · "
             f"load average at start {meta['load_start']}, end {meta.get('load_end', '?')}", "",
             "Columns: **ratio** = block FLOPs computed / uncached (tuning batch; call scope counts the whole call); "
             "**b1 ×** = batch-1 speed-up, median of interleaved runs against an uncached twin (wall clock / CPU "
             "time); **m/i** = measured / ideal speed-up (b1 × · b1 ratio); **PSNR**, **SSIM**, **acc** (the model's "
             "classifier), **FD** (Fréchet distance of classifier features, cached vs uncached) on the held-out "
             "samples; **FD %** = FD / the uncached seed-to-seed FD.", ""]
    for sc in data["scenarios"]:
        floor = sc["fd_floor"]
        lines += [f"## {sc['name']}: {sc['steps']} steps, guidance {sc['guidance']}"
                  + (f" ({sc['mode']} CFG)" if sc.get("mode") and sc["guidance"] > 1 else ""), "",
                  f"Held-out: seeds {sc['heldout_seeds'][0]}..{sc['heldout_seeds'][-1]} x labels "
                  f"{sc['seed_labels'][0]}..{sc['seed_labels'][-1]}; uncached accuracy {sc['uncached_acc']:.2f}; "
                  f"seed-to-seed FD {_fmt(floor, 3)}; {sc['seconds'] / 60:.1f} min. Keyframes: " + "; ".join(
                      f"`{k}` {v}" for k, v in sc["plans"].items()), "", *_provenance(sc),
                  "| library | method | setting | band | ratio | b1 ratio | b1 × wall | m/i wall | m/i CPU | PSNR | "
                  "SSIM | acc | FD | FD % |", "|" + "---|" * 14]
        for r in sc["results"]:
            for row in r["rows"]:
                share = row["fd_heldout"] / floor * 100 if floor and math.isfinite(floor) else float("nan")
                lines.append(f"| {row['library']} | {row['method']} | {row['setting']} | {_fmt(row['band'])} | "
                             f"{row['ratio']:.3f} | {row['b1_ratio']:.3f} | {_fmt(row['b1_speedup_wall'])} | "
                             f"{_fmt(row['b1_meas_over_ideal'])} | {_fmt(row['b1_meas_over_ideal_cpu'])} | "
                             f"{_fmt(row['psnr_heldout'])} | {_fmt(row['ssim_heldout'], 3)} | "
                             f"{_fmt(row['acc_heldout'])} | {_fmt(row['fd_heldout'], 3)} | {_fmt(share, 1)} |")
            if r.get("error") or not r["rows"]:
                lines.append(f"| {r['library']} | {r['method']} | — | — | no setting in a band"
                             f"{': ' + r['error'] if r.get('error') else ''} (lowest ratio tried: "
                             f"{min((p['ratio'] for p in r['points']), default=float('nan')):.3f}) |" + " |" * 9)
        lines += ["", "**Best per band** (held-out PSNR @ ratio):", "", "| band | dcache | diffusers | cache-dit |",
                  "|---|---|---|---|"]
        for band, best in summary.frontier_best(sc).items():
            cells = [f"{best[lib]['psnr_heldout']:.2f} dB · {best[lib]['method']} ({best[lib]['setting']}) @ "
                     f"{best[lib]['ratio']:.3f}" if lib in best else "—" for lib in methods.LIBRARIES]
            lines.append(f"| ~{band:g} | " + " | ".join(cells) + " |")
        lines.append("")
        targets = _targets(sc)
        for band, best in summary.frontier_best(sc).items():
            row = best.get("dcache")
            if row is None or band not in targets:
                continue
            peer = max((best[lib] for lib in best if lib != "dcache"), key=lambda r: r["psnr_heldout"], default=None)
            margin = (f"; margin over the best peer ({peer['library']} {peer['method']}, {peer['psnr_heldout']:.2f} "
                      f"dB at {peer['ratio']:.3f}): {row['psnr_heldout'] - peer['psnr_heldout']:+.2f} dB"
                      if peer else "; no peer row in this band")
            met = "met" if row["psnr_heldout"] >= targets[band] else "not met"
            fd_ok = math.isfinite(floor) and row["fd_heldout"] <= FD_SHARE * floor
            lines.append(f"- ~{band:g}: best dcache row ({row['method']}) {row['psnr_heldout']:.2f} dB at ratio "
                         f"{row['ratio']:.3f} (target >= {targets[band]:g} dB: {met}){margin}; "
                         f"FD {row['fd_heldout']:.3f} = "
                         f"{row['fd_heldout'] / floor * 100:.1f} % of the seed-to-seed FD "
                         f"({'within' if fd_ok else 'above'} 5 %); accuracy {row['acc_heldout']:.2f} vs uncached "
                         f"{sc['uncached_acc']:.2f}; batch-1 measured/ideal {row['b1_meas_over_ideal']:.2f}.")
        if sc.get("robustness"):
            lines += ["", "### Robustness of the searched keyframes", "",
                      f"The {sc['name']} keyframes as a 28-step plan replayed with `interpolate_steps` (nearest "
                      "planned step), as keyframes in normalised time, and dynamic SeaCache (SEA gate, order 2, call "
                      "scope, threshold 4, the cap nearest the plan's ratio), on 3 held-out seeds x 10 labels; "
                      "ratio / PSNR (dB):", "",
                      "| plan | steps | guidance | plan replay | keyframes | seacache o2 call |", "|" + "---|" * 6]
            for row in sc["robustness"]:
                cells = [f"{row[k]['ratio']:.3f} / {row[k]['psnr']:.2f}" for k in ROBUST_KINDS]
                lines.append(f"| {row['plan']} | {row['steps']} | {row['guidance']} | " + " | ".join(cells) + " |")
        lines.append("")
    notes = methods.RESULTS / f"{name}_notes.md"
    if notes.is_file():
        lines += [notes.read_text().rstrip(), ""]
    lines += [f"![Pareto plot]({png.name})", ""]
    md.write_text("\n".join(lines))
    return md, js, png


def pareto_png(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = data["scenarios"]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.2 * len(scenarios), 4.6), squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        for lib in methods.LIBRARIES:
            rows = [row for r in sc["results"] if r["library"] == lib for row in r["rows"]
                    if math.isfinite(row.get("psnr_heldout", float("nan")))]
            if not rows:
                continue
            ax.scatter([r["ratio"] for r in rows], [r["psnr_heldout"] for r in rows], marker=methods.MARKERS[lib],
                       color=methods.LIB_COLORS[lib], edgecolors="black", linewidths=0.4, s=50, zorder=3)
            front = methods._front([(r["ratio"], r["psnr_heldout"]) for r in rows], True, True)
            ax.plot([p[0] for p in front], [p[1] for p in front], color=methods.LIB_COLORS[lib], lw=2, alpha=0.7,
                    label=lib)
            if lib == "dcache":
                for r in rows:
                    if r["method"].startswith("keyframe"):
                        ax.annotate(r["method"].split()[-1], (r["ratio"], r["psnr_heldout"]), fontsize=7,
                                    xytext=(3, 3), textcoords="offset points")
        for band in sc["bands"]:
            ax.axvspan(band / methods.BAND_TOL, band * methods.BAND_TOL, color="0.5", alpha=0.08)
            if band in _targets(sc):
                ax.plot([band / methods.BAND_TOL, band * methods.BAND_TOL], [_targets(sc)[band]] * 2, "k--", lw=1)
        ax.invert_xaxis()
        ax.set_title(f"{sc['name']}: {sc['steps']} steps, guidance {sc['guidance']}", fontsize=10)
        ax.set_xlabel("compute ratio  \u2190 more compute")
        ax.set_ylabel("held-out PSNR vs uncached (dB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Below compute ratio 0.25 on {data['meta'].get('model_title', 'tiny-digits (Flux)')}\ndcache vs "
                 f"diffusers vs cache-dit (dashed: PSNR targets)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.merge:
        data = json.loads(args.merge[0].read_text())
        for other in args.merge[1:]:
            data = merge_runs(data, json.loads(other.read_text()))
        return write_report(data, args.out)[0]
    if not (args.no_cache_dit or args.quick):
        reason = peers.cache_dit_unavailable()
        if reason is not None:
            raise SystemExit(f"error: {reason}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.time()
    command = "python benchmarks/frontier.py" + "".join(
        " " + shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)

    import diffusers

    from dcache.eval.runner import _git_commit

    cache_dit_version = "not run"
    if not (args.no_cache_dit or args.quick):
        import cache_dit

        cache_dit_version = cache_dit.__version__
    scenarios = MODEL_SCENARIOS[args.model]
    names = scenarios[-1:] if args.quick else [n for n in scenarios if not args.only or re.search(args.only, n)]
    spec = methods.models.MODELS[args.model]
    meta = dict(command=command, git_commit=_git_commit(BENCH_DIR.parent), date=time.strftime("%Y-%m-%d %H:%M"),
                model=args.model, model_title=spec.title,
                torch=torch.__version__, diffusers=diffusers.__version__, cache_dit=cache_dit_version,
                weights=spec.weights_id(), load_start=methods._load(), quick=args.quick)
    data = dict(meta=meta, scenarios=[])
    out = args.out
    for name in names:
        data["scenarios"].append(run_scenario(args.model, ALL[args.model][name], args, log))
        meta.update(runtime_s=time.time() - started, load_end=methods._load())
        write_report(data, out)  # after every scenario: a crash keeps what was measured
    md, _, png = write_report(data, out)
    log(f"wrote {md} and {png} in {(time.time() - started) / 60:.1f} min")
    return md


if __name__ == "__main__":
    main()
