"""Searched plans vs every dynamic schedule (dcache's and the peers') on the bundled tiny digit model, plus the DisCa
learned forecaster vs Taylor forecasting at equal compute.

    python benchmarks/search.py --out /tmp/search-bench        # full run (1-2 h on 2 busy CPU cores); searches are
                                                               # cached in --out, a rerun only re-scores; tables go
                                                               # to benchmarks/out/ (--results benchmarks/results:
                                                               # the tracked ones)
    python benchmarks/search.py --quick --no-write             # minutes: 12 steps, tiny searches, 2 held-out seeds

Protocol (the held-out set is the one of benchmarks/methods.py, so its dynamic rows are reused when they match):
  * Search calibration: labels 0..9, seed 0, split CFG, guidance 1.5 (the pipeline default). DisCa trains on seeds
    0..train_seeds-1 of the same labels. Nothing is tuned on the held-out seeds.
  * Held-out: seeds 1000..1000+H-1 x labels 0..9 (H = --heldout-seeds, default 10 = 100 samples). Every plan is
    scored there: PSNR over all pixels vs the uncached images of the same seeds, the digit classifier's accuracy on
    the requested labels, and the compute ratio = block FLOPs computed / uncached (counted from shapes,
    dcache.schedules.tuning.search.Template; the DisCa rows also give the predictor's own FLOPs).
  * Dynamic schedules: the held-out rows of benchmarks/results/methods.json (dcache, diffusers, cache-dit; same
    seeds, labels, steps, guidance and weights: checked) or, when they do not match, dcache's dynamic methods swept
    here on the held-out set.
  * Forecast variants of the step-level (stack) searched plans, at the same compute: every reused step forecast by
    Taylor order 1 / 2 (+taylor1, +taylor2) or by the DisCa predictor (+disca; trained for those plans).
  * Target check, per searched method (variants count as their own method) and ratio r in (0.5, 0.33): every dynamic
    row whose compute ratio lies in [r / 1.18, r * 1.18] (the band of benchmarks/methods.py) must be Pareto-dominated
    by one of the method's plans: compute ratio <= the row's, PSNR >= the row's and accuracy >= the row's. DisCa plans
    are checked with the predictor's FLOPs added to their ratio.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path

SCRATCH = Path(__file__).resolve().parent / "out"  # git-ignored default for --results


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--pop-size", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-span", type=int, default=6)
    ap.add_argument("--budgets", default="8,9,10,13,14,15",
                    help="LeMiCa / DP: computed steps of the plans (default: both target bands, 28 steps)")
    ap.add_argument("--methods", default="ecad,lemica,lemica-f1,dp,harmonica,l2c,ecad-f1",
                    help="lemica-f1: LeMiCa with the skipped steps forecast (Taylor 1) when measuring and replaying; "
                         "ecad-f1: ECAD over step genomes whose skipped steps are forecast (Taylor 1) when evaluated "
                         "and replayed, seeded with the forecasting dynamic schedules' recorded plans and the step "
                         "plans of the methods listed before it, then hill-climbed at --polish-steps")
    ap.add_argument("--forecast-pop-size", type=int, default=24, help="ecad-f<k>: NSGA-II population")
    ap.add_argument("--forecast-generations", type=int, default=4, help="ecad-f<k>: NSGA-II generations")
    ap.add_argument("--polish-steps", default="14,13,10",
                    help="ecad-f<k>: computed-step counts whose best plan is then hill-climbed (one computed step "
                         "moved at a time); default: ratios 0.5, 0.464 and 0.357 at 28 steps")
    ap.add_argument("--polish-evaluations", type=int, default=60, help="ecad-f<k>: neighbours per polish ratio")
    ap.add_argument("--disca-bases", default="lemica,lemica-f1,dp",
                    help="searched methods whose step-level plans get a DisCa twin (the predictor is trained for "
                         "all of them together)")
    ap.add_argument("--router-iterations", type=int, default=60)
    ap.add_argument("--heldout-seeds", type=int, default=10)
    ap.add_argument("--train-seeds", type=int, default=4, help="DisCa calibration runs (seeds 0..n-1, labels 0..9)")
    ap.add_argument("--disca-iterations", type=int, default=300, help="DisCa offline (residual) iterations")
    ap.add_argument("--disca-online", type=int, default=0, help="DisCa closed-loop iterations over all its plans")
    ap.add_argument("--disca-per-plan", type=int, default=12,
                    help="then closed-loop iterations per base plan (each DisCa plan gets its own fine-tuned copy)")
    ap.add_argument("--no-call-scope", dest="call_scope", action="store_false",
                    help="do not score the call-scope twins (<method>+call) of the step-level plans")
    ap.add_argument("--quick", action="store_true", help="12 steps, pop 8 x 3, span 4, routers 4 its, 2 held-out "
                                                         "seeds, DisCa 60 + 6 iterations on 2 seeds")
    ap.add_argument("--out", default=None, help="search output folder; searches found there are reused "
                                                "(default: a temporary folder)")
    ap.add_argument("--no-write", action="store_true", help="do not write <results>/search.{md,json} "
                                                            "(search.md = these tables + search_notes.md)")
    ap.add_argument("--results", type=Path, default=SCRATCH,
                    help="folder for search.md / search.json (default benchmarks/out/, git-ignored; --results "
                         "benchmarks/results refreshes the tables BENCHMARKS.md is assembled from)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch and diffusers load

# the heavy imports come after that argument check on purpose, hence the E402 exemptions
import torch  # noqa: E402

import dcache  # noqa: E402
from dcache.actions import Granularity  # noqa: E402
from dcache.pipelines.runner import GenerationJob  # noqa: E402
from dcache.pipelines.search_cli import FORECAST_SEEDS, REUSE_SEEDS, dynamic_seed_plans, make_calibration  # noqa: E402
from dcache.plans.plan import Plan  # noqa: E402
from dcache.quality import psnr  # noqa: E402
from dcache.schedules.tuning import search  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TARGETS = (0.5, 0.33)
BAND_TOL = 1.18  # benchmarks/methods.py: a point is in band c if c / 1.18 <= ratio <= c * 1.18
HELDOUT_SEED0 = 1000
VALIDATION_SEED0 = 500  # DisCa's choice between its candidates (never trained on, not held out)
LABELS = list(range(10))
DYNAMIC_SWEEPS = {  # fallback when methods.json does not match this protocol
    "fbcache": [dict(threshold=t) for t in (0.1, 0.2, 0.3, 0.5)],
    "easycache": [dict(threshold=t) for t in (0.05, 0.1, 0.2, 0.4)],
    "magcache": [dict(threshold=t) for t in (0.06, 0.12, 0.25, 0.5)],
    "teacache": [dict(threshold=t) for t in (0.1, 0.2, 0.3)],
    "taylorseer": [dict(interval=k) for k in (2, 3, 4)],
    "fixed_interval": [dict(interval=k) for k in (2, 3, 4)],
}


class HeldOut:
    """The held-out set as one deterministic callable: seeds x labels, one batch of 10 labels per seed."""

    def __init__(self, pipe, steps: int, seeds: list[int]):
        self.jobs = [GenerationJob(pipe, True, prompts=[str(x) for x in LABELS], steps=steps, seed=s) for s in seeds]
        self.labels = torch.tensor(LABELS * len(seeds))

    def __call__(self) -> torch.Tensor:
        return torch.cat([job() for job in self.jobs])


def weights_id() -> str:
    from dcache.pipelines.bundled import TINY_MODEL_DIR

    path = TINY_MODEL_DIR / "transformer" / "diffusion_pytorch_model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else "?"


def methods_rows(steps: int, seeds: list[int]) -> tuple[list[dict], str]:
    """Held-out rows of benchmarks/results/methods.json when its protocol matches this one, else ([], why not)."""
    from dcache.pipelines.tiny_pipeline import DEFAULT_GUIDANCE

    path = RESULTS / "methods.json"
    if not path.is_file():
        return [], f"{path.relative_to(ROOT)} is missing"
    data = json.loads(path.read_text())
    meta = data["meta"]
    want = dict(steps=steps, heldout_seeds=seeds, seed_labels=LABELS, guidance=DEFAULT_GUIDANCE, weights=weights_id())
    diff = [f"{k}: {meta.get(k)!r} there, {v!r} here" for k, v in want.items() if meta.get(k) != v]
    if diff:
        return [], "methods.json protocol differs (" + "; ".join(diff) + ")"
    rows = []
    for result in data["results"]:
        for r in result.get("rows", []):
            if r.get("psnr_heldout") is None or not math.isfinite(r["psnr_heldout"]):
                continue
            rows.append({"library": r["library"], "method": r["method"], "config": r["setting"],
                         "compute_ratio": r["ratio"], "psnr": r["psnr_heldout"], "accuracy": r.get("acc_heldout"),
                         "cfg_mode": r.get("cfg_mode")})
    return rows, f"{path.relative_to(ROOT)} ({meta['command']}, {meta['date']}, weights {meta['weights']})"


def sweep_dynamic(pipe, heldout: search.Calibration, template, classifier) -> list[dict]:
    rows = []
    ref = heldout.reference()
    for name, sweep in DYNAMIC_SWEEPS.items():
        for overrides in sweep:
            handle = dcache.apply(pipe, name, count_flops=False, **overrides)
            try:
                with torch.no_grad():
                    images = heldout.generate().float().cpu()
                plan = handle.plan()
            finally:
                handle.remove()
            rows.append({"library": "dcache", "method": name, "config": str(overrides),
                         "compute_ratio": template.compute_ratio(plan), "psnr": psnr(images, ref),
                         "accuracy": accuracy(classifier, images, heldout.generate.labels), "cfg_mode": "split"})
    return rows


def accuracy(classifier, images: torch.Tensor, labels: torch.Tensor) -> float | None:
    if classifier is None:
        return None
    with torch.no_grad():
        return float((classifier.predict(images).cpu() == labels).double().mean())


def score(heldout: search.Calibration, template, classifier, plan: Plan) -> dict:
    images = search.run_plan(heldout, plan)
    return {"compute_ratio": template.compute_ratio(plan), "psnr": psnr(images, heldout.reference()),
            "accuracy": accuracy(classifier, images, heldout.generate.labels)}


def plan_key(plan: Plan, seeds: list[int]) -> str:
    """What a held-out score depends on: the decisions, the forecast (Taylor order or predictor) and the seeds."""
    forecaster = plan.extras.get("forecaster") or {}
    what = [plan.model_class, plan.granularity, plan.units, plan.num_steps, plan.actions, plan.probe_blocks,
            plan.tail_blocks, plan.forecast_order, forecaster.get("sha256"), seeds]
    if plan.extras.get("scope", "blocks") != "blocks":  # keys of block-scope plans stay those of earlier runs
        what.append(plan.extras["scope"])
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def in_band(ratio: float, target: float) -> bool:
    return target / BAND_TOL <= ratio <= target * BAND_TOL


def dominates(p: dict, d: dict) -> bool:
    ratio = p["compute_ratio"] + p.get("predictor_ratio", 0.0)
    acc_ok = p["accuracy"] is None or d["accuracy"] is None or p["accuracy"] >= d["accuracy"]
    return ratio <= d["compute_ratio"] + 1e-9 and p["psnr"] >= d["psnr"] and acc_ok


def plan_name(plan: str) -> str:
    """'plans/ecad-07-r0.500.plan.json' -> 'ecad-07-r0.500': the reports name a plan, whose file lives in the search
    folder (--out), not in the repository."""
    return Path(plan).name.removesuffix(".plan.json")


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> str:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.pop_size, args.generations, args.max_span = 12, 8, 3, 4
        args.router_iterations, args.heldout_seeds, args.train_seeds = 4, 2, 2
        args.disca_iterations, args.disca_online, args.disca_per_plan, args.budgets = 60, 0, 3, "3,4,5,6,7"
        args.forecast_pop_size, args.forecast_generations, args.polish_steps = 8, 3, "6,4"
    torch.set_num_threads(1)
    t0 = time.time()
    from dcache.pipelines.bundled import load_digit_classifier, load_tiny_pipeline
    from dcache.schedules.tuning.search import disca, router

    pipe = load_tiny_pipeline()
    classifier = load_digit_classifier()
    calib = make_calibration(pipe, True, [str(x) for x in LABELS], steps=args.steps, seed=0)
    seeds = [HELDOUT_SEED0 + i for i in range(args.heldout_seeds)]
    heldout = search.Calibration(pipe, HeldOut(pipe, args.steps, seeds), lambda a, b: psnr(a, b))
    template = search.make_template(calib)
    held_template = search.make_template(search.Calibration(pipe, heldout.generate.jobs[0], psnr))
    out = Path(args.out) if args.out else Path(__import__("tempfile").mkdtemp(prefix="dcache-search-bench-"))
    budgets = tuple(int(b) for b in args.budgets.split(",") if b.strip())
    max_ratio = max(TARGETS) * BAND_TOL

    # ---------------------------------------------------------------------------------------------- searches
    fronts: dict[str, dict] = {}
    timings: dict[str, float] = {}
    for method in [m for m in args.methods.split(",") if m]:
        t = time.time()
        folder = out / method
        if method == "ecad":
            fronts[method] = search.ecad_search(
                calib, folder, search.ECADConfig(pop_size=args.pop_size, generations=args.generations),
                seed_plans=dynamic_seed_plans(pipe, calib), template=template, resume=True, progress=False)
        elif method.startswith("ecad-f") and method[6:].isdigit():
            cfg = search.ECADConfig(pop_size=args.forecast_pop_size, generations=args.forecast_generations,
                                    granularity="stack", forecast_order=int(method[6:]),
                                    polish_ratios=tuple(int(k) / args.steps for k in args.polish_steps.split(",")
                                                        if k.strip()),
                                    polish_evaluations=args.polish_evaluations)
            # seeds: the forecasting dynamic schedules' recorded plans, the step plans of the searches run before
            # this one (LeMiCa / DP paths, scored here with the skipped steps forecast), the reuse schedules
            searched = {f"{m}/{Path(q['plan']).name.removesuffix('.plan.json')}": Plan.load(out / m / q["plan"])
                        for m, front in fronts.items() for q in front["points"] if not m.startswith("ecad")}
            ecad_seeds = {**dynamic_seed_plans(pipe, calib, FORECAST_SEEDS),
                          **{k: v for k, v in searched.items() if Granularity(v.granularity) is Granularity.STACK},
                          **dynamic_seed_plans(pipe, calib, REUSE_SEEDS)}
            fronts[method] = search.ecad_search(calib, folder, cfg, seed_plans=ecad_seeds, template=template,
                                                resume=True, progress=False)
        elif method in ("lemica", "lemica-f1"):
            cfg = search.LeMiCaConfig(budgets=budgets, max_span=args.max_span,
                                      forecast_order=int(method == "lemica-f1"))
            fronts[method] = search.lemica_search(calib, folder, cfg, template=template, progress=False)
        elif method == "dp":
            fronts[method] = search.dp_search(calib, folder, search.DPConfig(budgets=budgets), template=template,
                                              progress=False)
        elif method in ("harmonica", "l2c"):
            cfg = router.RouterConfig(objective=method, iterations=args.router_iterations, target_ratios=TARGETS)
            fronts[method] = router.router_search(calib, folder, cfg, template=template, resume=True, progress=False)
        else:
            raise SystemExit(f"--methods: unknown method {method!r}")
        timings[method] = time.time() - t
        print(f"[{time.time() - t0:.0f}s] {method} searched", flush=True)

    # ---------------------------------------------------------------------------------------------- plans to score
    plans: dict[str, list[tuple[str, Plan]]] = {}
    for method, front in fronts.items():
        for p in front["points"]:
            if p["compute_ratio"] <= max_ratio:  # the targets' bands only (the rest of a front is in front.json)
                plans.setdefault(method, []).append((p["plan"], Plan.load(out / method / p["plan"])))
    bases = {f"{m}/{Path(name).name.removesuffix('.plan.json')}": plan for m, entries in plans.items()
             for name, plan in entries if set("RF") & set("".join(r for rows in plan.actions.values() for r in rows))}
    stack_bases = {k: p for k, p in bases.items() if Granularity(p.granularity) is Granularity.STACK}
    disca_methods = {m for m in args.disca_bases.split(",") if m}
    disca_bases = {k: p for k, p in stack_bases.items() if k.split("/")[0] in disca_methods}
    for key, base in bases.items():  # Taylor twins of every searched plan (order 2 for the step-level ones)
        for order in (1, 2) if key in stack_bases else (1,):
            if base.forecast_order != order:  # a forecasting plan (lemica-f1) is its own Taylor-1 twin
                plans.setdefault(f"{key.split('/')[0]}+taylor{order}", []).append((key, disca.taylor_plan(base,
                                                                                                          order)))
    disca_summary = None
    if disca_bases:
        t = time.time()
        runs = [GenerationJob(pipe, True, prompts=[str(x) for x in LABELS], steps=args.steps, seed=s)
                for s in range(args.train_seeds)]
        cfg = disca.DisCaConfig(iterations=args.disca_iterations, online_iterations=args.disca_online,
                                rollout=("taylor",))
        tag = hashlib.sha256(json.dumps([sorted(disca_bases), args.train_seeds, repr(cfg)]).encode()).hexdigest()[:10]
        disca_dir = out / "disca" / tag  # one checkpoint per set of base plans and config (resumable)
        predictor, disca_summary = disca.train_disca(calib, list(disca_bases.values()), disca_dir, cfg, runs=runs,
                                                     resume=True, progress=False)
        # validation runs: seeds the predictor never trained on and the held-out set does not contain
        validation = search.Calibration(pipe, HeldOut(pipe, args.steps, [VALIDATION_SEED0 + i for i in range(2)]),
                                        lambda a, b: psnr(a, b))
        plan_cfg = dataclasses.replace(cfg, online_iterations=args.disca_per_plan)
        choices = {}
        for key, base in disca_bases.items():
            # candidates, each fine-tuned in closed loop on this plan only (resumable, own folders): from the shared
            # regression predictor and from the Taylor start; chosen with the untouched ones on the validation runs
            tuned = copy.deepcopy(predictor)
            disca.finetune_online(pipe, [base], runs, tuned, disca_dir / key.replace("/", "-"), plan_cfg,
                                  progress=False)
            fresh = disca.DisCaPredictor(predictor.streams, order=cfg.order, hidden=cfg.hidden,
                                         time_dim=cfg.time_dim, layout=predictor.layout)
            disca.finetune_online(pipe, [base], runs, fresh, disca_dir / (key.replace("/", "-") + "-from-taylor"),
                                  plan_cfg, progress=False)
            candidates = {"taylor": None, "regression": predictor, "regression+closed-loop": tuned,
                          "closed-loop": fresh}
            name, val = disca.choose_predictor(validation, base, candidates, cfg.order)
            choices[key] = (name, val)
            print(f"[{time.time() - t0:.0f}s] disca {key}: validation PSNR "
                  + ", ".join(f"{k} {v:.2f}" for k, v in val.items()) + f" -> {name}", flush=True)
            chosen = candidates[name]  # Taylor chosen: the plan forecasts with Taylor, no predictor (and no FLOPs)
            plan = disca.taylor_plan(base, cfg.order) if chosen is None else disca.disca_plan(base, chosen,
                                                                                               disca_summary)
            plan.save(disca_dir / f"{key.replace('/', '-')}+disca.plan.json")
            plans.setdefault(f"{key.split('/')[0]}+disca", []).append((key, plan))
        timings["disca"] = time.time() - t
        print(f"[{time.time() - t0:.0f}s] disca trained", flush=True)

    # call-scope twins of the step-level plans (dcache.runtime.call_scope: x + Delta of the whole call)
    if args.call_scope:
        for method in [m for m in plans if not m.endswith("+disca")]:
            for name, plan in plans[method]:
                if Granularity(plan.granularity) is Granularity.STACK and not (plan.probe_blocks or plan.tail_blocks) \
                        and "forecaster" not in plan.extras:
                    twin = Plan.from_dict({**plan.to_dict(), "extras": {**plan.extras, "scope": "call"}})
                    plans.setdefault(f"{method}+call", []).append((name, twin))

    # ---------------------------------------------------------------------------------------------- scoring
    scored: dict[str, list[dict]] = {}
    cache_path = out / "heldout_scores.json"  # a rerun scores only plans it has not seen
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    for method, entries in plans.items():
        for name, plan in entries:
            key = plan_key(plan, seeds)
            if key not in cache:
                cache[key] = score(heldout, held_template, classifier, plan)
                cache_path.write_text(json.dumps(cache, indent=1))
            row = {"method": method, "plan": name, **cache[key]}
            if method.endswith("+disca") and "forecaster" in plan.extras:
                row["predictor_ratio"] = disca.predictor_flops_ratio(predictor, plan, held_template,
                                                                     disca_summary["tokens_per_call"])
            scored.setdefault(method, []).append(row)
            print(f"[{time.time() - t0:.0f}s] {method} {name}: ratio {row['compute_ratio']:.3f} "
                  f"PSNR {row['psnr']:.2f} acc {fmt(row['accuracy'], '.2f')}", flush=True)
    dynamic, source = methods_rows(args.steps, seeds)
    if not dynamic:
        print(f"dynamic rows: {source}; sweeping dcache's dynamic methods on the held-out set", flush=True)
        dynamic = sweep_dynamic(pipe, heldout, held_template, classifier)
        source = f"swept here on the held-out set ({source})"

    # ---------------------------------------------------------------------------------------------- report
    command = "python benchmarks/search.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Searched plans vs dynamic schedules (tiny digit model, {args.steps} steps)", "",
             f"Command: `{command.strip()}`  ",
             f"Weights {weights_id()}. Search calibration: labels 0-9, seed 0 (DisCa: seeds "
             f"0-{args.train_seeds - 1}). Held-out: seeds {seeds[0]}..{seeds[-1]} x labels 0-9 = {len(seeds) * 10} "
             f"samples, split CFG 1.5; PSNR over all pixels vs the uncached images, classifier accuracy, compute "
             f"ratio = block FLOPs computed / uncached. Dynamic rows: {source}. Search / training wall time (s): "
             + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + f"; total {time.time() - t0:.0f} s on a "
             f"shared 2-core CPU.", ""]
    lines += ["## Target: Pareto-dominate every dynamic schedule at compute ratios 0.5 and 0.33", "",
              f"A dynamic row is at ratio r when r / {BAND_TOL} <= its ratio <= r * {BAND_TOL}. It is dominated when "
              f"one of the method's plans has compute ratio <= its ratio (DisCa: + the predictor's FLOPs), PSNR >= "
              f"and accuracy >= its own.", "",
              "| ratio | method | dynamic rows at r | dominated | target met | strongest undominated row | "
              "best plan against it |", "|---|---|---|---|---|---|---|"]
    block_only = []  # DisCa verdicts counting block FLOPs only (the predictor's own FLOPs left out)
    verdicts = {}
    for target in TARGETS:
        band = [d for d in dynamic if in_band(d["compute_ratio"], target)]
        for method, rows in scored.items():
            undominated = [d for d in band if not any(dominates(p, d) for p in rows)]
            met = not undominated and bool(band)
            verdicts[(target, method)] = met
            if method.endswith("+disca"):
                free = [{**p, "predictor_ratio": 0.0} for p in rows]
                n_free = sum(any(dominates(p, d) for p in free) for d in band)
                block_only.append(f"{method} at {target}: {n_free} of {len(band)} dominated"
                                  + (" (target met)" if n_free == len(band) and band else ""))
            worst = max(undominated, key=lambda d: d["psnr"]) if undominated else None
            against = ""
            if worst is not None:
                ok = [p for p in rows if p["compute_ratio"] + p.get("predictor_ratio", 0.0)
                      <= worst["compute_ratio"] + 1e-9]
                best = max(ok, key=lambda p: p["psnr"]) if ok else None
                against = (f"`{plan_name(best['plan'])}` "
                           f"{best['compute_ratio'] + best.get('predictor_ratio', 0.0):.3f} / "
                           f"{best['psnr']:.2f} dB" if best else "no plan at or under its ratio")
            lines.append(
                f"| {target} | {method} | {len(band)} | {len(band) - len(undominated)} | {'yes' if met else 'no'} | "
                + (f"{worst['library']}:{worst['method']} [{worst['config']}] {worst['compute_ratio']:.3f} / "
                   f"{worst['psnr']:.2f} dB / acc {fmt(worst['accuracy'], '.2f')}" if worst else "-")
                + f" | {against} |")
    if block_only:
        lines += ["", "Counting block FLOPs only (without the DisCa predictor's own): " + "; ".join(block_only) + "."]
    if disca_summary is not None:
        lines += ["", "## DisCa learned forecaster vs Taylor forecasting at equal compute", "",
                  "Same stack plans (the searched step schedules), every skipped step forecast instead of reused: "
                  "Taylor order 1 / 2 from the cached history, or the DisCa predictor (trained on the calibration "
                  f"seeds for these plans: {args.disca_iterations} residual-regression iterations on the teacher and "
                  f"Taylor-rollout trajectories of all of them, {args.disca_online} closed-loop iterations on the "
                  f"output error over all of them, then {args.disca_per_plan} closed-loop iterations per plan; "
                  f"{predictor.num_params()} parameters = "
                  f"{predictor.num_params() / sum(p.numel() for p in pipe.transformer.parameters()):.1%} of the "
                  f"transformer). Per plan, four candidates: Taylor-{cfg.order} (no predictor), the shared "
                  f"regression predictor, and both after {args.disca_per_plan} closed-loop iterations on that plan "
                  f"alone; the one with the best PSNR on validation seeds {VALIDATION_SEED0}-{VALIDATION_SEED0 + 1} "
                  f"(not trained on, not held out) is the DisCa plan. Held-out numbers; 'pred. FLOPs' = the "
                  f"predictor's FLOPs / uncached block FLOPs.", "",
                  "| base plan | compute ratio | reuse PSNR / acc | Taylor-1 PSNR / acc | Taylor-2 PSNR / acc | "
                  "DisCa PSNR / acc | pred. FLOPs | DisCa variant (validation PSNR) |",
                  "|---|---|---|---|---|---|---|---|"]
        by = {(m, p["plan"]): p for m, rows in scored.items() for p in rows}
        for key in disca_bases:
            m, name = key.split("/")
            base = next(p for p in scored[m] if Path(p["plan"]).name.removesuffix(".plan.json") == name)
            own = f"{base['psnr']:.2f} / {fmt(base['accuracy'], '.2f')}"
            cells = [own] if disca_bases[key].forecast_order == 0 else ["-"]  # a forecasting plan: own = Taylor-1
            for v in ("+taylor1", "+taylor2", "+disca"):
                r = by.get((m + v, key))
                cells.append(f"{r['psnr']:.2f} / {fmt(r['accuracy'], '.2f')}" if r else
                             own if v == "+taylor1" and disca_bases[key].forecast_order == 1 else "-")
            extra = by.get((m + "+disca", key), {}).get("predictor_ratio")
            name, val = choices[key]
            picked = f"{name} ({', '.join(f'{k} {v:.2f}' for k, v in val.items())})"
            lines.append(f"| {key} | {base['compute_ratio']:.3f} | " + " | ".join(cells)
                         + f" | {fmt(extra, '.4f')} | {picked} |")
    lines += ["", "## All scored plans (held-out)", "", "| method | plan | compute ratio | PSNR | accuracy |",
              "|---|---|---|---|---|"]
    for method, rows in scored.items():
        for p in sorted(rows, key=lambda p: p["compute_ratio"]):
            extra = f" (+{p['predictor_ratio']:.4f} predictor)" if "predictor_ratio" in p else ""
            lines.append(f"| {method} | `{plan_name(p['plan'])}` | {p['compute_ratio']:.3f}{extra} | "
                         f"{p['psnr']:.2f} | {fmt(p['accuracy'], '.2f')} |")
    lines += ["", "## Dynamic rows at the target ratios", "", "| library | method | config | compute ratio | PSNR | "
              "accuracy |", "|---|---|---|---|---|---|"]
    for d in sorted((d for d in dynamic if any(in_band(d["compute_ratio"], t) for t in TARGETS)),
                    key=lambda d: d["compute_ratio"]):
        lines.append(f"| {d['library']} | {d['method']} | {d['config']} | {d['compute_ratio']:.3f} | "
                     f"{d['psnr']:.2f} | {fmt(d['accuracy'], '.2f')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    payload = {"command": command.strip(), "heldout_seeds": seeds, "dynamic_source": source, "dynamic": dynamic,
               "scored": scored, "verdicts": {f"{t}:{m}": v for (t, m), v in verdicts.items()},
               "disca": disca_summary and {k: v for k, v in disca_summary.items() if k != "rows"}}
    (out / "benchmark.json").write_text(json.dumps(payload, indent=1, default=str))
    if not args.no_write:
        from dcache.plans.plan import atomic_write_text

        notes = RESULTS / "search_notes.md"  # hand-written reading of the numbers, kept across reruns
        head, _, rest = text.partition("\n\n")
        body = f"{head}\n\n{notes.read_text().strip()}\n\n{rest}" if notes.is_file() else text
        args.results.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.results / "search.md", body)
        atomic_write_text(args.results / "search.json", json.dumps(payload, indent=1, default=str))
    return text


if __name__ == "__main__":
    main()
