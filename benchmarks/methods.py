"""Every dcache method against diffusers' built-in caches and cache-dit, on a bundled model, in one process.

    python benchmarks/methods.py                      # full sweep (~45 min on 2 shared CPU cores) into benchmarks/out/
    python benchmarks/methods.py --out benchmarks/results   # the same, refreshing the tracked tables
    python benchmarks/methods.py --model motion --out benchmarks/results   # on tiny-motion: methods_motion.md
    python benchmarks/methods.py --quick              # a tiny subset in < 1 min (the smoke test runs this)
    python benchmarks/methods.py --only 'magcache|MagCache' --heldout-seeds 5 --out /tmp/m
    python benchmarks/methods.py --rerun 'dcache:(fora|pab)$'  # re-measure these; keep every other row of methods.json

Models (`--model`, `_models.py`): digits (tiny-digits, Flux, the default), motion (tiny-motion, Wan video, UniPC,
split CFG 5), shapes (tiny-shapes, SD3, batched CFG 4); each runs at its pipeline's default steps, guidance and CFG
mode, every contender in that mode unless it needs batched CFG. diffusers' caches need a `CacheMixin` transformer:
on tiny-shapes they are listed as not applicable.

Protocol (same for every library; one pipeline object, one transformer, caches put on and taken off in turn):
  * Tuning run: every class in one batch, seed 0, the model's steps and CFG mode (batched CFG for the peers that
    need it, see _peers.py). Calibrations (dcache MagCache ratios / TeaCache coefficients / ERTACache, BAC,
    InvarDiff and ProfilingDiT plans, diffusers MagCache's calibrate mode) use this run only.
  * Sweep: each method's main knob is searched (a log grid, then bisection) for the compute-ratio bands ~0.75, 0.5,
    0.33, 0.25 on the tuning run; every evaluated setting is a point (compute ratio, PSNR/SSIM of the tuning batch).
    Knob families (e.g. MagCache K=3 -> K=8) are only searched for the bands the previous family cannot reach.
  * Selected settings (per band, the setting whose compute ratio is closest to the band centre, within +-18%) are
    evaluated fully:
      - batch 1 (label 3, seed 0): compute ratio of that call, 1 warm-up, then `--repeats` cached runs interleaved
        with as many uncached runs of an identical twin pipeline (wall clock and process CPU time, medians);
        measured speed-up = median uncached / median cached; measured/ideal = speed-up * compute ratio.
      - held-out seeds 1000.. (`--heldout-seeds` x 10 labels): PSNR (over all pixels) and SSIM (torchmetrics, mean)
        vs the uncached images of the same seeds, classifier accuracy, and the Frechet distance between the digit
        classifier's features of the cached and the uncached samples; batch-10 speed-up from the process CPU time
        of these runs against the uncached ones (CPU time: the machine is shared, wall clock is not stable enough
        between rows that run minutes apart).
  * Compute ratio = block FLOPs computed / block FLOPs of the uncached run, counted for every library by the same
    FlopCounterMode meter on the blocks (_peers.BlockMeter); dcache's own stats() must agree (checked, reported).
  * After every contender the pipeline must give bit-identical uncached output again (checked; a failure is
    reported and the pipeline reloaded).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # cache-dit logs every context at info level
SCRATCH = Path(__file__).resolve().parent / "out"  # git-ignored default for --out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="digits", choices=("digits", "motion", "shapes"),
                    help="the bundled model to run on (default digits; others write methods_<model>.*)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny subset: one setting of a few methods, 10 steps (< 1 min)")
    ap.add_argument("--out", type=Path, default=SCRATCH,
                    help="folder for methods.md / .json / _pareto.png (default benchmarks/out/, git-ignored; --out "
                         "benchmarks/results refreshes the tables BENCHMARKS.md is assembled from, and --resume / "
                         "--rerun / --report-only read <out>/methods.json)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's; --quick 6)")
    ap.add_argument("--heldout-seeds", type=int, default=None, help="held-out seeds x every class (default 10; "
                                                                    "--quick: 1 seed x 4 labels)")
    ap.add_argument("--repeats", type=int, default=None, help="timed batch-1 runs per row (default 7; quick 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (fixed for the whole run)")
    ap.add_argument("--only", default=None, help="regex on 'library:method' of the contenders to run")
    ap.add_argument("--no-cache-dit", action="store_true",
                    help="leave cache-dit out (otherwise a missing cache-dit is an error naming the [bench] extra)")
    ap.add_argument("--no-fd-floor", action="store_true", help="skip the seed-to-seed FD reference")
    ap.add_argument("--resume", action="store_true", help="reuse contenders already in <out>/<stem>.json")
    ap.add_argument("--rerun", default=None, help="regex on 'library:method': measure these contenders again and "
                                                  "keep every other contender's results from <out>/<stem>.json "
                                                  "(which must have the same steps, seeds, repeats and threads)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the table and plot from <out>/<stem>.json")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad arguments answer here, before torch and diffusers load

# the heavy imports come after that argument check on purpose, hence the E402 exemptions
import numpy as np  # noqa: E402
import torch  # noqa: E402

from dcache.quality import frechet_distance as frechet  # noqa: E402
from dcache.quality import median, psnr, ssim_per_image  # noqa: E402


def _load_sibling(stem: str):
    """benchmarks/<stem>.py by path: benchmarks/ is not a package and must not become an importable name."""
    name = f"dcache_benchmark{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


peers = _load_sibling("_peers")
models = _load_sibling("_models")
Applied, Contender, Search, setting_text = peers.Applied, peers.Contender, peers.Search, peers.setting_text

# one decision per batched call, as every other library's cache takes it: the tables compare the methods at the same
# decisions (per-sample decisions, dcache's default, and what they cost: benchmarks/per_sample.py)
DECISIONS = "batch"
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BANDS = (0.75, 0.5, 0.33, 0.25)
BAND_TOL = 1.18  # a point is in band c if c / 1.18 <= ratio <= c * 1.18
GOOD_ENOUGH = 1.06  # the search stops refining a band once a point is this close
TUNE_SEED = 0
HELDOUT_SEED0 = 1000
FLOOR_SEED0 = 2000
B1_LABEL = 3
LIBRARIES = ("dcache", "diffusers", "cache-dit")


# ------------------------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------------------------

# psnr (whole batch, float64, images in [0, 1]), frechet (features, no regularisation) and median: dcache.quality

def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean over the batch of dcache.quality.ssim_per_image, on the images as float32."""
    return float(ssim_per_image(models.frames_as_images(a.float()), models.frames_as_images(b.float())).mean())


# ------------------------------------------------------------------------------------------------------------------
# The bench: pipelines, jobs, references
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class Bench:
    steps: int
    tune_labels: list[int] | None  # None: every class of the model
    heldout_seeds: list[int]
    repeats: int
    seed_labels: list[int] | None = None  # labels of each held-out seed (None: every class)
    warm_twin: bool = True
    model: Any = None  # a _models.BundledModel (None: tiny-digits)
    mode: str = "split"  # the model's CFG mode: the references' and every split-CFG contender's
    pipe: Any = None
    twin: Any = None  # an identical uncached pipeline: the interleaved baseline of the timing runs
    meter: Any = None
    classifier: Any = None
    refs: dict = field(default_factory=dict)

    def load(self) -> None:
        if self.model is None:
            self.model = models.MODELS["digits"]
        self.pipe = self.model.load()
        self.twin = self.model.load()
        self.meter = peers.BlockMeter(self.pipe.transformer)  # before any cache, see _peers.BlockMeter
        self.classifier = self.model.load_judge()
        self.mode = self.pipe.default_cfg_mode
        every_class = list(range(self.pipe.num_classes))
        self.tune_labels = every_class if self.tune_labels is None else self.tune_labels
        self.seed_labels = every_class if self.seed_labels is None else self.seed_labels

    def reload(self) -> None:
        self.meter.remove()
        self.pipe = self.model.load()
        self.meter = peers.BlockMeter(self.pipe.transformer)

    def run(self, pipe, labels: list[int], seed: int, mode: str) -> torch.Tensor:
        out = pipe(labels=labels, num_inference_steps=self.steps, generator=torch.Generator().manual_seed(seed),
                   cfg_mode=mode, output_type="pt")
        return self.model.samples(out)

    def tune(self, pipe, mode: str) -> torch.Tensor:
        return self.run(pipe, self.tune_labels, TUNE_SEED, mode)

    def b1(self, pipe, mode: str) -> torch.Tensor:
        return self.run(pipe, [B1_LABEL], TUNE_SEED, mode)

    def heldout_labels(self) -> list[int]:
        return self.seed_labels * len(self.heldout_seeds)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.classifier.features(images).double()

    def accuracy(self, images: torch.Tensor) -> float:
        with torch.no_grad():
            predicted = self.classifier.predict(images)
        return float((predicted == torch.tensor(self.heldout_labels())).double().mean())

    def timed(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - wall, time.process_time() - cpu

    def references(self, modes: set[str], fd_floor: bool) -> None:
        """Uncached outputs (per CFG mode in use), block FLOPs, held-out images/features/timings, FD floor."""
        r = self.refs
        for mode in (self.mode, *sorted(modes - {self.mode})):
            with self.meter.count():
                r[("tune", mode)] = self.tune(self.pipe, mode)
            r[("tune_flops", mode)] = self.meter.flops
            with self.meter.count():
                r[("b1", mode)] = self.b1(self.pipe, mode)
            r[("b1_flops", mode)] = self.meter.flops
        r["modes_identical"] = all(torch.equal(r[(job, self.mode)], r[(job, mode)]) for job in ("tune", "b1")
                                   for mode in modes)
        images, cpu, wall = [], [], []
        for seed in self.heldout_seeds:
            out, w, c = self.timed(lambda: self.run(self.pipe, self.seed_labels, seed, self.mode))
            images.append(out)
            wall.append(w)
            cpu.append(c)
        r[("heldout", self.mode)] = torch.cat(images)
        r[("heldout_cpu", self.mode)], r[("heldout_wall", self.mode)] = cpu, wall
        r["heldout_features"] = self.features(r[("heldout", self.mode)])
        r["heldout_acc"] = self.accuracy(r[("heldout", self.mode)])
        if fd_floor:  # the same number of uncached samples from other seeds: how far apart two sample sets are
            other = torch.cat([self.run(self.pipe, self.seed_labels, FLOOR_SEED0 + i, self.mode)
                               for i in range(len(self.heldout_seeds))])
            r["fd_floor"] = frechet(self.features(other), r["heldout_features"])
        else:
            r["fd_floor"] = float("nan")

    def heldout_ref(self, mode: str) -> tuple[torch.Tensor, list[float]]:
        """Uncached held-out images and CPU times in `mode` (batched CFG: computed on first use unless identical)."""
        key = ("heldout", mode)
        if key not in self.refs:
            images, cpu = [], []
            for seed in self.heldout_seeds:
                out, _, c = self.timed(lambda: self.run(self.twin, self.seed_labels, seed, mode))
                images.append(out)
                cpu.append(c)
            if self.refs["modes_identical"] and torch.equal(torch.cat(images), self.refs[("heldout", self.mode)]):
                self.refs[key] = self.refs[("heldout", self.mode)]
            else:
                self.refs[key] = torch.cat(images)
            self.refs[("heldout_cpu", mode)] = cpu
        return self.refs[key], self.refs[("heldout_cpu", mode)]


# ------------------------------------------------------------------------------------------------------------------
# dcache contenders
# ------------------------------------------------------------------------------------------------------------------

TIED = "@"  # a family value "@knob" takes the searched knob's value (e.g. PAB mlp_range follows spatial_range)


def resolve_setting(setting: dict) -> dict:
    return {k: (setting[v[1:]] if isinstance(v, str) and v.startswith(TIED) else v) for k, v in setting.items()}


def dcache_contenders(bench: Bench) -> list[Contender]:
    import dcache
    from dcache.schedules.tuning import calibrate as cal

    state: dict[str, Any] = {}
    tune_run = lambda pipe: (lambda: bench.tune(pipe, bench.mode))  # noqa: E731

    def applied_from(handle) -> Applied:
        def remove():
            handle.remove()

        def ratio():
            try:
                return float(handle.stats().compute_ratio)
            except Exception:  # no generation yet
                return None

        return Applied(remove=remove, compute_ratio=ratio)

    def plain(method: str, rename: dict | None = None):
        def enable(pipe, s):
            overrides = {(rename or {}).get(k, k): v for k, v in resolve_setting(s).items()}
            return applied_from(dcache.apply(pipe, method, decisions=DECISIONS, **overrides))

        return enable

    def calibrated(method: str):
        """MagCache / TeaCache: calibrated once on the tuning run with dcache's calibration API (registered)."""
        def enable(pipe, s):
            key = f"cal:{method}"
            if key not in state:
                if method == "magcache":
                    state[key] = cal.calibrate_magcache(pipe, tune_run(pipe), register=True)
                else:
                    state[key] = cal.calibrate_teacache(pipe, [tune_run(pipe)], register=True)
            return applied_from(dcache.apply(pipe, method, decisions=DECISIONS, **resolve_setting(s)))

        return enable

    def planned(method: str):
        """Plan methods: calibrate a plan per setting on the tuning run (memoized), apply the plan."""
        from dcache.methods import calibrator

        _, calibrate = calibrator(method)  # the calibrate function the method's config declares

        def enable(pipe, s):
            s = resolve_setting(s)
            key = f"plan:{method}:{setting_text(s)}"
            if key not in state:
                state[key] = calibrate(pipe, [tune_run(pipe)], **s)
            plan = state[key]
            return applied_from(dcache.apply(pipe, plan))  # a plan's step action (ERTACache's phi) runs in the engine

        return enable

    specs: dict[str, dict] = {
        "magcache": dict(search=Search("threshold", "log", 0.005, 2.0), enable=calibrated("magcache"),
                         families=[{"max_skip_steps": 3, "retention_ratio": 0.2},
                                   {"max_skip_steps": 8, "retention_ratio": 0.1}],
                         note="ratios from dcache.schedules.tuning.calibrate.calibrate_magcache on the tuning run"),
        "teacache": dict(search=Search("threshold", "log", 0.01, 8.0), enable=calibrated("teacache"),
                         families=[{}, {"ret_ratio": 0.1}],
                         note="coefficients from calibrate_teacache on the tuning run"),
        "fbcache": dict(search=Search("threshold", "log", 0.01, 1.0), quick={"threshold": 0.2}),
        "easycache": dict(search=Search("threshold", "log", 0.005, 2.0), families=[{}, {"ret_ratio": 0.1}]),
        "cg_taylor": dict(search=Search("threshold", "log", 0.005, 2.0), families=[{}, {"warmup_steps": 3}]),
        "seacache": dict(search=Search("threshold", "log", 0.01, 4.0),
                         families=[{"max_consecutive": 2}, {"max_consecutive": 5}],
                         note="the settings of the diffusers SeaCache rows (same indicator, same decisions)"),
        "flowcache": dict(search=Search("threshold", "log", 0.01, 4.0), families=[{}, {"max_consecutive": 6}],
                          note="chunk policy on a non-chunked model: whole-call reuse"),
        "taylorseer": dict(search=Search("interval", "values", values=(2, 3, 4, 5, 6, 8, 10))),
        "fora": dict(search=Search("interval", "values", values=(2, 3, 4, 5, 6, 8)), quick={"interval": 3}),
        "fixed_interval": dict(search=Search("interval", "values", values=(2, 3, 4, 5, 6, 8))),
        "delta_dit": dict(search=Search("interval", "values", values=(2, 3, 4, 6, 8)),
                          families=[{"cached_ratio": 0.5}, {"cached_ratio": 0.75}]),
        "pab": dict(search=Search("spatial_range", "values", values=(2, 3, 4, 6, 8, 12)),
                    families=[{}, {"window_low": 0.0, "window_high": 1000.0},
                              {"window_low": 0.0, "window_high": 1000.0, "mlp_range": TIED + "spatial_range"}]),
        "ertacache": dict(search=Search("threshold", "log", 0.01, 2.0), enable=planned("ertacache"),
                          families=[{}, {"max_consecutive": 6}],
                          note="plan calibrated per setting on the tuning run; timestep adjustment applied"),
        "bac": dict(search=Search("compute_ratio", "values", values=(0.8, 0.6, 0.45, 0.35, 0.27, 0.2)),
                    enable=planned("bac"), note="plan calibrated per setting on the tuning run"),
        "invardiff": dict(search=Search("step_quantile", "values", values=(0.2, 0.4, 0.6, 0.8, 0.95)),
                          enable=planned("invardiff"),
                          families=[{"module_quantile": TIED + "step_quantile"},
                                    {"module_quantile": TIED + "step_quantile", "max_consecutive": 6,
                                     "nonskip_ratio": 0.05}],
                          note="plan calibrated per setting on the tuning run"),
        "profilingdit": dict(search=Search("background_interval", "values", values=(2, 3, 4, 6, 8)),
                             enable=planned("profilingdit"),
                             families=[{"background_ratio": 0.5}, {"background_ratio": 0.75, "step_start": 0.1}],
                             note="plan calibrated per setting on the tuning run"),
    }
    contenders = []
    for method in sorted(dcache.methods()):
        spec = specs.get(method, {})
        contenders.append(Contender(
            "dcache", method, spec.get("search"), spec.get("enable") or plain(method),
            families=spec.get("families", [{}]), note=spec.get("note", "" if method in specs else
                                                              "not in this benchmark's knob table: defaults only"),
            quick=spec.get("quick")))
    # Same algorithm and settings as cache-dit's DBCache rows (F1B0, warm-up 4, then 2): an implementation check.
    contenders.append(Contender(
        "dcache", "fbcache F1B0W4", Search("threshold", "log", 0.01, 2.0), plain("fbcache"),
        families=[{"probe_blocks": 1, "tail_blocks": 0, "warmup_steps": 4},
                  {"probe_blocks": 1, "tail_blocks": 0, "warmup_steps": 2}],
        note="cache-dit DBCache F1B0W4 settings on dcache's fbcache"))
    # SeaCache with a quadratic instead of a linear residual forecast (dcache's order knob; SeaCache allows 0 / 1).
    contenders.append(Contender(
        "dcache", "seacache o2", Search("threshold", "log", 0.01, 4.0),
        lambda p, s: plain("seacache")(p, {**s, "order": 2}),
        families=[{"max_consecutive": 2}, {"max_consecutive": 5}], note="seacache order=2"))
    # MagCache's budget deciding where to compute, the skipped steps forecast (order) and the last step computed.
    contenders.append(Contender(
        "dcache", "magcache forecast", Search("threshold", "log", 0.005, 2.0), calibrated("magcache"),
        families=[{"max_skip_steps": 4, "retention_ratio": 0.0, "order": 1, "cutoff_steps": 1},
                  {"max_skip_steps": 6, "retention_ratio": 0.0, "order": 2, "cutoff_steps": 1}],
        note="magcache order>0 cutoff_steps=1, ratios from calibrate_magcache on the tuning run"))
    # Whole-stack TaylorSeer (the taylorseer-lite preset): the counterpart of diffusers' TaylorSeer use_lite_mode.
    contenders.append(Contender(
        "dcache", "taylorseer stack", Search("interval", "values", values=(2, 3, 4, 5, 6, 8)),
        lambda p, s: plain("taylorseer")(p, {**s, "granularity": "stack"}), note="taylorseer granularity=stack"))
    # Call scope (dcache.runtime.call_scope): the same schedules replacing the whole transformer call by x + Delta, so
    # a reused call also skips the embedders and the output head (the batch-1 regime where the cache path shows).
    call = {"scope": "call"}
    contenders.append(Contender(
        "dcache", "magcache forecast call", Search("threshold", "log", 0.005, 2.0), calibrated("magcache"),
        families=[{"max_skip_steps": 4, "retention_ratio": 0.0, "order": 1, "cutoff_steps": 1, **call},
                  {"max_skip_steps": 6, "retention_ratio": 0.0, "order": 2, "cutoff_steps": 1, **call}],
        note="magcache order>0 cutoff_steps=1 scope=call, ratios from calibrate_magcache on the tuning run"))
    contenders.append(Contender(
        "dcache", "magcache call", Search("threshold", "log", 0.005, 2.0), calibrated("magcache"),
        families=[{"max_skip_steps": 3, "retention_ratio": 0.2, **call},
                  {"max_skip_steps": 8, "retention_ratio": 0.1, **call}],
        note="magcache scope=call, ratios from calibrate_magcache on the tuning run"))
    contenders.append(Contender(
        "dcache", "seacache o2 call", Search("threshold", "log", 0.01, 4.0), plain("seacache"),
        families=[{"max_consecutive": 2, "order": 2, **call}, {"max_consecutive": 5, "order": 2, **call}],
        note="seacache order=2 scope=call"))
    contenders.append(Contender(
        "dcache", "seacache o2 cadence call", Search("max_consecutive", "values", values=(1, 2, 3, 4, 6)),
        plain("seacache"), families=[{"gate": False, "order": 2, **call}],
        note="seacache gate=False order=2 scope=call: the cadence of the open-gate rows without the SEA indicator"))
    contenders.append(Contender(
        "dcache", "taylorseer stack call", Search("interval", "values", values=(2, 3, 4, 5, 6, 8)),
        lambda p, s: plain("taylorseer")(p, {**s, "granularity": "stack", **call}),
        note="taylorseer granularity=stack scope=call"))
    contenders.append(Contender(
        "dcache", "easycache call", Search("threshold", "log", 0.005, 2.0), plain("easycache"),
        families=[dict(call), {"ret_ratio": 0.1, **call}], note="easycache scope=call (the reference's own "
                                                                  "formulation: Delta = v - x of the whole model)"))
    return contenders


# ------------------------------------------------------------------------------------------------------------------
# Sweep: search the knob for the bands, then evaluate the selected settings
# ------------------------------------------------------------------------------------------------------------------

def in_band(ratio: float, centre: float, tol: float = BAND_TOL) -> bool:
    return centre / tol <= ratio <= centre * tol


def band_of(ratio: float) -> float | None:
    hits = [c for c in BANDS if in_band(ratio, c)]
    return min(hits, key=lambda c: abs(math.log(ratio / c))) if hits else None


class Sweeper:
    def __init__(self, bench: Bench, log: Callable[[str], None]):
        self.bench = bench
        self.log = log

    # -- one setting on the tuning run -------------------------------------------------------------------------
    def evaluate(self, c: Contender, setting: dict) -> dict:
        b = self.bench
        mode = c.cfg_mode
        # dcache counts its block FLOPs itself (the same FlopCounterMode count, checked against the meter on every
        # selected row's batch-1 call); the meter's per-block FlopCounterMode costs ~60% extra time, so the search
        # uses it only for the peers, whose ratio nothing else reports.
        use_meter = c.library != "dcache"
        applied = c.enable(b.pipe, setting)
        try:
            with b.meter.count() if use_meter else contextlib.nullcontext():
                images = b.tune(b.pipe, mode)
            lib_ratio = applied.compute_ratio()
        finally:
            applied.remove()
        ref = b.refs[("tune", mode)]
        ratio = b.meter.flops / b.refs[("tune_flops", mode)] if use_meter else lib_ratio
        point = dict(setting=setting, text=setting_text(resolve_setting(setting)), ratio=ratio, lib_ratio=lib_ratio,
                     metered=use_meter, psnr=psnr(images, ref), ssim=ssim(images, ref))
        self.log(f"    {c.label:28s} {point['text']:48s} ratio {point['ratio']:.3f}"
                 + (f" (lib {lib_ratio:.3f})" if lib_ratio is not None else "") + f"  PSNR {point['psnr']:.2f}")
        return point

    def search(self, c: Contender, quick: bool) -> list[dict]:
        """Points of the tuning run for the settings the search visits."""
        points: dict[str, dict] = {}

        def visit(setting):
            key = setting_text(setting)
            if key not in points:
                points[key] = self.evaluate(c, setting)
            return points[key]

        if quick:
            visit(dict(c.quick or {}))
            return list(points.values())
        s = c.search
        if s is None:
            visit({})
            return list(points.values())
        missing = set(BANDS)
        for family in c.families:
            if not missing:
                break
            fam_points = []
            if s.kind == "values":
                for v in s.values:
                    p = visit({**family, s.knob: v})
                    fam_points.append((v, p))
                    if p["ratio"] < min(BANDS) / BAND_TOL:
                        break  # later values only reuse more
            else:
                fam_points = self._bisect_search(s, family, visit, missing)
            for _, p in fam_points:
                for centre in list(missing):
                    if in_band(p["ratio"], centre):
                        missing.discard(centre)
        return list(points.values())

    def _bisect_search(self, s: Search, family: dict, visit, missing: set) -> list[tuple[float, dict]]:
        """A 5-point grid over [lo, hi] (log or linear), up to 2 extensions past hi while the lowest band is out of
        reach, then per missing band up to 2 bisections of the bracket whose ratios straddle the band centre."""
        log = s.kind == "log"
        to_x = (lambda v: math.log(v)) if log else (lambda v: v)
        x_lo, x_hi = to_x(s.lo), to_x(s.hi)

        def value_at(x: float) -> float:
            v = math.exp(x) if log else x
            return float(round(v)) if s.integer else float(f"{v:.4g}")

        evaluated: dict[float, dict] = {}
        for i in range(5):
            x = x_lo + i * (x_hi - x_lo) / 4
            evaluated[x] = visit({**family, s.knob: value_at(x)})
        for ext in (1, 2):  # the range did not reach the lowest band: go past hi (x3 per step in log space)
            if min(p["ratio"] for p in evaluated.values()) <= min(missing) * BAND_TOL:
                break
            x = x_hi + ext * (math.log(3) if log else (x_hi - x_lo) / 2)
            try:
                evaluated[x] = visit({**family, s.knob: value_at(x)})
            except ValueError:  # past the knob's valid range
                break
        for centre in sorted(missing, reverse=True):
            for _ in range(2):
                xs = sorted(evaluated)
                best = min(xs, key=lambda x: abs(math.log(max(evaluated[x]["ratio"], 1e-9) / centre)))
                if abs(math.log(max(evaluated[best]["ratio"], 1e-9) / centre)) <= math.log(GOOD_ENOUGH):
                    break
                # the bracket: neighbouring points whose ratios straddle the centre (ratio falls as the knob grows)
                bracket = next(((a, b) for a, b in zip(xs, xs[1:])
                                if (evaluated[a]["ratio"] - centre) * (evaluated[b]["ratio"] - centre) < 0), None)
                if bracket is None or bracket[1] - bracket[0] < (x_hi - x_lo) / 32:
                    break  # the range never crosses the centre (another family may), or it is a step of the ratio
                x = (bracket[0] + bracket[1]) / 2
                evaluated[x] = visit({**family, s.knob: value_at(x)})
        return [(value_at(x), p) for x, p in sorted(evaluated.items())]

    # -- selection ---------------------------------------------------------------------------------------------
    @staticmethod
    def select(points: list[dict], quick: bool) -> list[tuple[float | None, dict]]:
        """(band, point) pairs: per band the closest point within tolerance, each point at most once."""
        if quick:
            return [(band_of(p["ratio"]), p) for p in points]
        pairs = sorted(((abs(math.log(p["ratio"] / c)), c, i) for c in BANDS for i, p in enumerate(points)
                        if p["ratio"] > 0 and in_band(p["ratio"], c)))
        taken_bands, taken_points, chosen = set(), set(), []
        for _, centre, i in pairs:
            if centre in taken_bands or i in taken_points:
                continue
            taken_bands.add(centre)
            taken_points.add(i)
            chosen.append((centre, points[i]))
        if not chosen and points:  # nothing in any band (e.g. a method with one fixed setting): its best point
            chosen.append((None, min(points, key=lambda p: p["ratio"])))
        return sorted(chosen, key=lambda bp: -bp[1]["ratio"])

    # -- full evaluation of a selected setting -----------------------------------------------------------------
    def full(self, c: Contender, band: float | None, point: dict) -> dict:
        b = self.bench
        mode = c.cfg_mode
        setting = point["setting"]
        row = dict(library=c.library, method=c.method, setting=point["text"], band=band, cfg_mode=mode,
                   ratio=point["ratio"], lib_ratio=point["lib_ratio"], psnr_tune=point["psnr"],
                   ssim_tune=point["ssim"], note=c.note)
        applied = c.enable(b.pipe, setting)
        try:
            row.update(self.time_b1(applied, mode))
            # held-out seeds, batch 10 each
            images, cpu, lib_ratios = [], [], []
            for seed in b.heldout_seeds:
                out, _, t = b.timed(lambda: b.run(b.pipe, b.seed_labels, seed, mode))
                images.append(out)
                cpu.append(t)
                lib_ratios.append(applied.compute_ratio())
        finally:
            applied.remove()
        ref_images, ref_cpu = b.heldout_ref(mode)
        images = torch.cat(images)
        features = b.features(images)
        row.update(
            psnr_heldout=psnr(images, ref_images), ssim_heldout=ssim(images, ref_images),
            acc_heldout=b.accuracy(images),
            fd_heldout=frechet(features, b.refs["heldout_features"]) if len(images) > 1 else float("nan"),
            b10_cpu_cached=median(cpu), b10_cpu_uncached=median(ref_cpu),
            heldout_lib_ratio=(float(np.mean(lib_ratios)) if all(r is not None for r in lib_ratios) else None))
        row["b10_speedup_cpu"] = row["b10_cpu_uncached"] / row["b10_cpu_cached"]
        row["ideal"] = 1.0 / row["ratio"] if row["ratio"] > 0 else float("inf")
        self.log(f"  => {c.label} [{row['setting']}] band {band}: ratio {row['ratio']:.3f}, "
                 f"b1 {row['b1_speedup_wall']:.2f}x "
                 f"wall ({row['b1_meas_over_ideal']:.2f} of ideal), held-out PSNR {row['psnr_heldout']:.2f} "
                 f"SSIM {row['ssim_heldout']:.3f} acc {row['acc_heldout']:.2f} FD {row['fd_heldout']:.3f}")
        return row

    def time_b1(self, applied: Applied, mode: str) -> dict:
        """Batch 1: the call's compute ratio (meter), a warm-up, then `repeats` cached runs interleaved with runs of
        the uncached twin pipeline; medians of wall clock and process CPU time."""
        b = self.bench
        row: dict[str, Any] = {}
        with b.meter.count():
            b.b1(b.pipe, mode)
        row["b1_ratio"] = b.meter.flops / b.refs[("b1_flops", mode)]
        row["b1_lib_ratio"] = applied.compute_ratio()
        if b.warm_twin:
            b.b1(b.pipe, mode)
            b.b1(b.twin, mode)
        cached_w, cached_c, unc_w, unc_c = [], [], [], []
        out_b1 = None
        for _ in range(b.repeats):
            _, w, t = b.timed(lambda: b.b1(b.twin, mode))
            unc_w.append(w)
            unc_c.append(t)
            out_b1, w, t = b.timed(lambda: b.b1(b.pipe, mode))
            cached_w.append(w)
            cached_c.append(t)
        row.update(b1_wall_cached=median(cached_w), b1_wall_uncached=median(unc_w),
                   b1_cpu_cached=median(cached_c), b1_cpu_uncached=median(unc_c),
                   psnr_b1=psnr(out_b1, b.refs[("b1", mode)]))
        row["b1_speedup_wall"] = row["b1_wall_uncached"] / row["b1_wall_cached"]
        row["b1_speedup_cpu"] = row["b1_cpu_uncached"] / row["b1_cpu_cached"]
        row["b1_ideal"] = 1.0 / row["b1_ratio"] if row["b1_ratio"] > 0 else float("inf")
        row["b1_meas_over_ideal"] = row["b1_speedup_wall"] * row["b1_ratio"]
        row["b1_meas_over_ideal_cpu"] = row["b1_speedup_cpu"] * row["b1_ratio"]
        return row

    def overhead(self, c: Contender) -> dict | None:
        """The cache path's own cost: threshold 0 (nothing reused), batch 1, timed like a row. None if n/a."""
        if c.search is None or c.search.knob != "threshold" or c.method == "ertacache":  # ertacache: a plan
            return None
        setting = {**c.families[0], "threshold": 0.0}
        applied = c.enable(self.bench.pipe, setting)
        try:
            row = self.time_b1(applied, c.cfg_mode)
        finally:
            applied.remove()
        row["setting"] = setting_text(resolve_setting(setting))
        self.log(f"  overhead {c.label}: b1 ratio {row['b1_ratio']:.3f}, {row['b1_speedup_wall']:.3f}x wall, "
                 f"{row['b1_speedup_cpu']:.3f}x CPU")
        return row

    def check_restored(self, c: Contender) -> bool:
        """The pipeline gives bit-identical uncached output after the contender's caches were taken off."""
        b = self.bench
        with b.meter.count():
            out = b.b1(b.pipe, b.mode)
        flops_ok = abs(b.meter.flops - b.refs[("b1_flops", b.mode)]) < 1e-6 * b.refs[("b1_flops", b.mode)]
        return bool(torch.equal(out, b.refs[("b1", b.mode)]) and flops_ok)

    def contender(self, c: Contender, quick: bool) -> dict:
        started = time.time()
        result = dict(library=c.library, method=c.method, note=c.note, cfg_mode=c.cfg_mode, points=[], rows=[],
                      error=None)
        try:
            self.log(f"[{c.label}] search")
            result["points"] = self.search(c, quick)
            for band, point in self.select(result["points"], quick):
                result["rows"].append(self.full(c, band, point))
            if not quick:
                result["overhead"] = self.overhead(c)
        except Exception as exc:  # a contender that crashes is a result, not the end of the benchmark
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc(limit=6)
            self.log(f"  !! {c.label} failed: {result['error']}")
        result["restored"] = self.check_restored(c)
        if not result["restored"]:
            self.log(f"  !! {c.label}: uncached output changed after removal; reloading the pipeline")
            self.bench.reload()
        result["seconds"] = time.time() - started
        return result


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------

def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        if math.isinf(v):
            return "∞"
        return f"{v:.{digits}f}"
    return str(v)


def all_rows(results: list[dict]) -> list[dict]:
    return [row for r in results for row in r["rows"]]


def band_analysis(rows: list[dict]) -> list[str]:
    lines = ["| band | rows | best PSNR (held-out) | best dcache | best diffusers | best cache-dit | lowest FD | "
             "lowest-FD dcache | lowest-FD peer |", "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for centre in BANDS:
        inb = [r for r in rows if r["band"] == centre and math.isfinite(r.get("psnr_heldout", float("nan")))]
        if not inb:
            lines.append(f"| ~{centre} | 0 | — | — | — | — | — | — | — |")
            continue

        def name(r, metric):
            return (f"{r['library']}:{r['method']} "
                    f"({fmt(r[metric], 2 if metric == 'psnr_heldout' else 3)} @ {r['ratio']:.2f})")

        def best(lib, metric, high):
            cand = [r for r in inb
                    if (lib is None or r["library"] == lib or (lib == "peer" and r["library"] != "dcache"))
                    and r.get(metric) is not None and math.isfinite(r[metric])]
            if not cand:
                return None
            return max(cand, key=lambda r: r[metric]) if high else min(cand, key=lambda r: r[metric])

        top, top_fd = best(None, "psnr_heldout", True), best(None, "fd_heldout", False)
        cells = [f"~{centre}", str(len(inb)), name(top, "psnr_heldout")]
        for lib in LIBRARIES:
            r = best(lib, "psnr_heldout", True)
            cells.append(name(r, "psnr_heldout") if r else "—")
        cells.append(name(top_fd, "fd_heldout") if top_fd else "—")
        for lib in ("dcache", "peer"):
            r = best(lib, "fd_heldout", False)
            cells.append(name(r, "fd_heldout") if r else "—")
        lines.append("| " + " | ".join(cells) + " |")
        d_psnr, p_psnr = best("dcache", "psnr_heldout", True), best("peer", "psnr_heldout", True)
        d_fd, p_fd = best("dcache", "fd_heldout", False), best("peer", "fd_heldout", False)
        parts = []
        if d_psnr and p_psnr:
            gap = d_psnr["psnr_heldout"] - p_psnr["psnr_heldout"]
            who = "dcache" if gap >= 0 else f"a peer ({p_psnr['library']}:{p_psnr['method']})"
            parts.append(f"PSNR: {who} leads by {abs(gap):.2f} dB")
        if d_fd and p_fd:
            who = "dcache" if d_fd["fd_heldout"] <= p_fd["fd_heldout"] else \
                f"a peer ({p_fd['library']}:{p_fd['method']})"
            parts.append(f"FD: {who} is lower ({fmt(d_fd['fd_heldout'], 3)} dcache vs "
                         f"{fmt(p_fd['fd_heldout'], 3)} peer)")
        if parts:
            verdicts.append(f"- ~{centre}: " + "; ".join(parts) + ".")
    return lines + [""] + verdicts


def envelope_table(results: list[dict]) -> list[str]:
    """Per library, the best tuning-batch PSNR among every setting the search tried with compute ratio <= c."""
    lines = ["| compute ratio <= | " + " | ".join(LIBRARIES) + " |", "|---|" + "---|" * len(LIBRARIES)]
    for c in (0.8, *BANDS):
        cells = []
        for lib in LIBRARIES:
            pts = [(p["psnr"], p["ratio"], r["method"], p["text"]) for r in results if r["library"] == lib
                   for p in r["points"] if p["ratio"] <= c + 1e-9 and math.isfinite(p["psnr"])]
            if pts:
                q, ratio, method, text = max(pts)
                cells.append(f"{q:.2f} dB — {method} [{text}] @ {ratio:.3f}")
            else:
                cells.append("—")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def ratio_03_table(rows: list[dict]) -> list[str]:
    sel = [r for r in rows if 0.25 <= r.get("b1_ratio", 0) <= 0.38]
    if not sel:
        return ["(no row with a batch-1 compute ratio in 0.25..0.38)"]
    lines = ["| library | method | setting | b1 compute ratio | b1 ideal | b1 measured (wall) | "
             "measured/ideal (wall) | measured/ideal (CPU) |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(sel, key=lambda r: (LIBRARIES.index(r["library"]), -r["b1_meas_over_ideal"])):
        lines.append(f"| {r['library']} | {r['method']} | {r['setting']} | {r['b1_ratio']:.3f} | "
                     f"{fmt(r['b1_ideal'])}x | {fmt(r['b1_speedup_wall'])}x | {fmt(r['b1_meas_over_ideal'])} | "
                     f"{fmt(r['b1_meas_over_ideal_cpu'])} |")
    for lib in LIBRARIES:
        vals = [r["b1_meas_over_ideal"] for r in sel if r["library"] == lib]
        if vals:
            lines.append(f"\n{lib}: median measured/ideal {median(vals):.2f} over {len(vals)} rows"
                         f" (range {min(vals):.2f}..{max(vals):.2f})")
    return lines


def write_report(results: list[dict], meta: dict, out: Path, stem: str) -> tuple[Path, Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = all_rows(results)
    md, js, png = out / f"{stem}.md", out / f"{stem}.json", out / f"{stem}_pareto.png"
    js.write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=_json_default))
    pareto_png(results, meta, png)
    rerun = meta.get("rerun")
    earlier = rerun.get("earlier", []) if rerun else []
    commands = [meta["command"]] if not rerun else [rerun["kept_from"]["command"],
                                                    *[e["command"] for e in earlier], meta["command"]]
    dating = []
    if rerun:
        dating.append(f"Rows of the contenders matching `{rerun['pattern']}` were measured by the last command on "
                      f"{meta['date']} (the line above)")
        for e in reversed(earlier):
            dating.append(f"rows matching `{e['pattern']}` (and no later pattern) by `{e['command']}` on {e['date']}")
        dating.append(f"every other row is from the first command's run of {rerun['kept_from']['date']} (same "
                      f"steps, seeds, repeats, threads and model weights: checked).")
    title = meta.get("model_title", "tiny-digits (Flux, split CFG 1.5, Euler, 28 steps)")
    lines = [f"# dcache methods vs diffusers caches vs cache-dit: {title}", "",
             "```", *commands, "```", "",
             f"{meta['date']} · {meta['runtime_s'] / 60:.1f} min · torch {meta['torch']} · "
             f"diffusers {meta['diffusers']}"
             f" · cache-dit {meta['cache_dit']} · weights {meta.get('weights', '?')} · "
             f"{meta['threads']} torch thread(s) · {meta['cpu']} · load average at "
             f"start {meta['load_start']}, end {meta.get('load_end', '?')}", "",
             *(["; ".join(dating), ""] if rerun else []),
             f"Bundled model {title}: {meta['steps']} steps, CFG {meta['guidance']} "
             f"({meta.get('cfg_mode', 'split')} unless a row says otherwise). Tuning run: labels "
             f"{meta['tune_labels']} seed {TUNE_SEED} (every calibration and "
             f"the knob search use it). Held-out: seeds {meta['heldout_seeds'][0]}..{meta['heldout_seeds'][-1]} x "
             f"labels {meta['seed_labels'][0]}..{meta['seed_labels'][-1]} = {meta['heldout_samples']} samples. "
             f"Batch 1: label {B1_LABEL}, seed {TUNE_SEED}.", "",
             "Columns: **ratio** = block FLOPs computed / uncached on the tuning batch (FlopCounterMode on the "
             "blocks, same meter for every library; dcache's own stats agree, see the check below); **ideal** = "
             "1/ratio; **b1 ratio** = the same at batch 1; **b1 × wall / CPU** = measured batch-1 speed-up (wall "
             f"clock / process CPU time), medians of {meta['repeats']} runs after a warm-up, interleaved with an "
             "uncached twin pipeline; **meas/ideal** = b1 × wall · b1 ratio; **b10 × CPU** = held-out batch-10 "
             "speed-up from process CPU time; **PSNR tune / b1 / "
             "held-out**, **SSIM**, **acc** (the model's judge, a classifier, on the held-out samples), **FD** = "
             "Fréchet distance of classifier features, cached vs uncached held-out samples.", ""]
    lines += [f"Uncached held-out accuracy {meta['uncached_acc']:.3f}; FD between the uncached held-out samples and "
              f"as many uncached samples of other seeds (the seed-to-seed scale of FD): {fmt(meta['fd_floor'], 3)}. "
              f"Split and batched CFG give bit-identical uncached outputs: {meta['modes_identical']}.", ""]
    header = ("| library | method | setting | band | ratio | ideal | b1 ratio | b1 × wall | b1 × CPU | meas/ideal | "
              "b10 × CPU | PSNR tune | PSNR b1 | PSNR held-out | SSIM | acc | FD |")
    lines += ["## Results", "", header, "|" + "---|" * 17]
    lines.append(f"| — | uncached | — | — | 1.000 | 1.00 | 1.000 | 1.00 | 1.00 | 1.00 | 1.00 | ∞ | ∞ | ∞ | 1.000 | "
                 f"{meta['uncached_acc']:.2f} | 0.000 |")
    for r in rows:
        lines.append(
            f"| {r['library']} | {r['method']} | {r['setting']} | {fmt(r['band'])} | {r['ratio']:.3f} | "
            f"{fmt(r['ideal'])} | {r['b1_ratio']:.3f} | {fmt(r['b1_speedup_wall'])} | {fmt(r['b1_speedup_cpu'])} | "
            f"{fmt(r['b1_meas_over_ideal'])} | {fmt(r['b10_speedup_cpu'])} | {fmt(r['psnr_tune'])} | "
            f"{fmt(r['psnr_b1'])} | {fmt(r['psnr_heldout'])} | {fmt(r['ssim_heldout'], 3)} | "
            f"{fmt(r['acc_heldout'])} | {fmt(r['fd_heldout'], 3)} |")
    notes = RESULTS / f"{stem}_notes.md"
    if notes.is_file():  # the hand-written reading of these numbers (kept across --report-only rewrites)
        lines += ["", notes.read_text().rstrip()]
    lines += ["", "## Best per compute-ratio band", "",
              f"Band c holds rows with c/{BAND_TOL} <= ratio <= c*{BAND_TOL} (one row per method and band, the "
              "setting closest to c). Quality on the held-out samples.", ""]
    lines += band_analysis(rows)
    lines += ["", "## Best quality reachable at a compute budget (every setting tried, tuning batch)", "",
              "The upper envelope of the search points per library: the best PSNR of the tuning batch among all "
              "settings with compute ratio <= the budget (no band tolerance, so libraries are compared at equal or "
              "lower compute). In-sample for the calibrated methods (their plans/tables were fitted on this batch): "
              "the held-out table above is the out-of-sample check.", ""]
    lines += envelope_table(results)
    lines += ["", "## Measured vs ideal speed-up at batch 1, compute ratio ~0.3", "",
              "Rows whose batch-1 compute ratio is 0.25..0.38. The tiny model spends a large share of a batch-1 call "
              "outside the blocks (embedders, RoPE, norms, the pipeline loop and Python dispatch), which no block "
              "cache removes; what differs between libraries is the overhead of the cache path itself.", ""]
    lines += ratio_03_table(rows)
    lines += ["", "## Cache-path overhead at zero reuse (batch 1)", "",
              "Threshold 0: the cache is on, its signals are computed, nothing is reused (compute ratio 1). Speed-up "
              "< 1 is the per-call cost of the cache machinery (hooks, signal reductions, host syncs), which the tiny "
              "model cannot hide; a large model amortises it over far more FLOPs per call.", "",
              "| library | method | setting | b1 ratio | speed-up (wall) | speed-up (CPU) |",
              "|---|---|---|---|---|---|"]
    for r in results:
        o = r.get("overhead")
        if o:
            lines.append(f"| {r['library']} | {r['method']} | {o['setting']} | {o['b1_ratio']:.3f} | "
                         f"{o['b1_speedup_wall']:.3f} | {o['b1_speedup_cpu']:.3f} |")
    lines += ["", "## Checks and failures", ""]
    for r in results:
        flags = []
        if r.get("error"):
            flags.append(f"**error**: `{r['error']}`")
        if not r.get("restored", True):
            flags.append("**uncached output changed after removal** (pipeline reloaded)")
        lib_checks = [(row["b1_ratio"], row["b1_lib_ratio"]) for row in r["rows"]
                      if row.get("b1_lib_ratio") is not None]
        if lib_checks:
            worst = max(abs(x - y) for x, y in lib_checks)
            flags.append(f"stats().compute_ratio vs the meter (batch-1 call of each row): max |Δ| {worst:.4f} over "
                         f"{len(lib_checks)} rows")
        no_reuse = [p for p in r["points"] if p["ratio"] > 0.999]
        if r["points"] and len(no_reuse) == len(r["points"]):
            flags.append("**no reuse at any setting tried**")
        if r.get("note"):
            flags.append(r["note"])
        lines.append(f"- {r['library']}:{r['method']} ({len(r['points'])} settings tried, "
                     f"{r.get('seconds', 0):.0f} s): " + "; ".join(flags))
    for name, reason in meta.get("unavailable", {}).items():
        lines.append(f"- {name}: not run — {reason}")
    lines += ["", f"![Pareto plot]({png.name})", ""]
    md.write_text("\n".join(lines) + "\n")
    return md, js, png


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, tuple):
        return list(obj)
    return str(obj)


MARKERS = {"dcache": "o", "diffusers": "s", "cache-dit": "^"}
LIB_COLORS = {"dcache": "#1f77b4", "diffusers": "#d62728", "cache-dit": "#2ca02c"}


def _front(points: list[tuple[float, float]], x_lower_better: bool,
           y_higher_better: bool) -> list[tuple[float, float]]:
    """The non-dominated points (better x and better y), sorted by x."""
    def better_or_equal(a, b, lower):
        return a <= b if lower else a >= b

    front = [(x, y) for x, y in points
             if not any(better_or_equal(x2, x, x_lower_better) and better_or_equal(y2, y, not y_higher_better)
                        and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(set(front))


def pareto_png(results: list[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = lambda v: isinstance(v, (int, float)) and math.isfinite(v)  # noqa: E731
    rows = [r for r in all_rows(results) if finite(r.get("psnr_heldout"))]
    points = [dict(p, library=r["library"], method=r["method"]) for r in results for p in r["points"]
              if finite(p.get("psnr")) and p.get("ratio")]
    methods = sorted({(r["library"], r["method"]) for r in rows + points},
                     key=lambda lm: (LIBRARIES.index(lm[0]), lm[1]))
    cmap = plt.get_cmap("tab20")
    color = {lm: cmap(i % 20) for i, lm in enumerate(methods)}
    fig, axes = plt.subplots(2, 2, figsize=(17, 12.5))
    panels = [
        (axes[0, 0], rows, "ratio", "compute ratio (block FLOPs computed / uncached)  ← more compute",
         "psnr_heldout", f"PSNR vs uncached, {meta['heldout_samples']} held-out samples (dB)",
         "Held-out quality vs compute (selected settings)"),
        (axes[0, 1], rows, "b1_speedup_wall", "measured speed-up at batch 1 (wall clock, vs uncached twin)",
         "psnr_heldout", "PSNR vs uncached, held-out (dB)", "Held-out quality vs measured batch-1 speed-up"),
        (axes[1, 0], rows, "ratio", "compute ratio  ← more compute", "fd_heldout",
         "Fréchet distance of classifier features to uncached (log; lower is better)",
         "Distribution distance vs compute (selected settings)"),
        (axes[1, 1], points, "ratio", "compute ratio  ← more compute", "psnr",
         f"PSNR vs uncached, tuning batch (seed {TUNE_SEED}) (dB)", "Every setting the search tried (tuning batch)"),
    ]
    for ax, data, xkey, xlabel, ykey, ylabel, title in panels:
        by_ratio = xkey == "ratio"
        higher_y = ykey != "fd_heldout"
        for lm in methods:
            pts = [r for r in data if (r["library"], r["method"]) == lm and finite(r.get(ykey)) and finite(r.get(xkey))
                   and (higher_y or r[ykey] > 0)]
            if pts:
                ax.scatter([r[xkey] for r in pts], [r[ykey] for r in pts], marker=MARKERS[lm[0]],
                           s=36 if data is points else 58, color=color[lm], edgecolors="black", linewidths=0.4,
                           zorder=3, alpha=0.85 if data is points else 1.0)
        for lib in LIBRARIES:
            pts = [(r[xkey], r[ykey]) for r in data if r["library"] == lib and finite(r.get(ykey))
                   and finite(r.get(xkey)) and (higher_y or r[ykey] > 0)]
            front = _front(pts, x_lower_better=by_ratio, y_higher_better=higher_y)
            if front:
                ax.plot([p[0] for p in front], [p[1] for p in front], color=LIB_COLORS[lib], lw=2.4, alpha=0.7,
                        zorder=2, drawstyle="default", label=f"{lib}: Pareto front")
        if by_ratio:
            ax.invert_xaxis()  # faster to the right
            for centre in BANDS:
                ax.axvspan(centre / BAND_TOL, centre * BAND_TOL, color="0.5", alpha=0.08, zorder=0)
                ax.text(centre, 1.0, f"~{centre}", transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                        fontsize=8, color="0.35")
        if not higher_y:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, pad=16 if by_ratio else 6)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower left" if higher_y else "upper left", fontsize=9)
    handles = [plt.Line2D([], [], marker=MARKERS[lm[0]], color="none", markerfacecolor=color[lm],
                          markeredgecolor="black", markersize=8, label=f"{lm[0]}: {lm[1]}") for lm in methods]
    fig.legend(handles=handles, loc="center right", fontsize=9, frameon=False, ncol=1,
               title="○ dcache   □ diffusers   △ cache-dit", title_fontsize=10)
    fig.suptitle(f"dcache vs diffusers caches vs cache-dit — tiny FLUX-class model, {meta['steps']} steps, "
                 f"CFG {meta['guidance']}, shaded: compute-ratio bands", fontsize=13)
    fig.tight_layout(rect=(0, 0, 0.84, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    quick = args.quick
    if not (args.no_cache_dit or quick or args.report_only):  # an error up front, not silently missing rows
        reason = peers.cache_dit_unavailable()
        if reason is not None:
            raise SystemExit(f"error: {reason}")
    spec = models.MODELS[args.model]
    heldout = args.heldout_seeds or (1 if quick else 10)
    repeats = args.repeats or (3 if quick else 7)
    out = args.out
    stem = ("methods" if args.model == "digits" else f"methods_{args.model}") + ("_quick" if quick else "")
    if args.report_only:
        data = json.loads((out / f"{stem}.json").read_text())
        md, _, _ = write_report(data["results"], data["meta"], out, stem)
        return md
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.time()
    command = "python benchmarks/methods.py" + "".join(" " + shlex.quote(a)
                                                       for a in (argv if argv is not None else sys.argv[1:]))

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)

    import diffusers

    bench = Bench(steps=0, tune_labels=[0, 1] if quick else None,
                  heldout_seeds=[HELDOUT_SEED0 + i for i in range(heldout)], repeats=repeats,
                  seed_labels=[0, 1, 2, 3] if quick else None, warm_twin=not quick, model=spec)
    bench.load()
    steps = bench.steps = args.steps or (6 if quick else bench.pipe.default_steps)

    unavailable: dict[str, str] = {}
    contenders = dcache_contenders(bench)
    if hasattr(bench.pipe.transformer, "enable_cache"):
        contenders += peers.diffusers_contenders(steps, lambda pipe: bench.tune(pipe, bench.mode), spec.raw_vision,
                                                 spec.tensor_format, spec.taylorseer_identifiers)
    else:
        unavailable["diffusers (every cache)"] = (
            f"{type(bench.pipe.transformer).__name__} is not a diffusers CacheMixin in diffusers "
            f"{diffusers.__version__}: `transformer.enable_cache` does not exist, so none of diffusers' caches can be "
            f"applied to it")
    cache_dit_version = "not installed"
    if not args.no_cache_dit and not quick:
        import cache_dit  # importable: checked at the start of main

        cache_dit_version = cache_dit.__version__
        contenders += peers.cache_dit_contenders(steps, spec.cache_dit_adapter, separate_cfg=bench.mode == "split",
                                                 encoder_calibrator=spec.cache_dit_encoder_calibrator)
    for c in contenders:  # every split-CFG contender runs in the model's own CFG mode
        if c.cfg_mode == "split":
            c.cfg_mode = bench.mode
    if quick:
        contenders = [c for c in contenders if c.quick is not None]
    all_contenders = list(contenders)
    if args.only:
        contenders = [c for c in contenders if re.search(args.only, c.label)]
    if args.rerun:
        contenders = [c for c in contenders if re.search(args.rerun, c.label)]
    log(f"references (uncached); {len(contenders)} contenders")
    bench.references({c.cfg_mode for c in contenders}, fd_floor=not (quick or args.no_fd_floor))

    meta = dict(command=command, date=time.strftime("%Y-%m-%d %H:%M"), model=spec.name, model_title=spec.title,
                cfg_mode=bench.mode, steps=steps, guidance=bench.pipe.default_guidance,
                tune_labels=bench.tune_labels, heldout_seeds=bench.heldout_seeds, seed_labels=bench.seed_labels,
                heldout_samples=len(bench.heldout_labels()), repeats=repeats, threads=args.threads,
                torch=torch.__version__, diffusers=diffusers.__version__, cache_dit=cache_dit_version,
                cpu=f"{platform.machine()} x{os.cpu_count()}", load_start=_load(), quick=quick,
                uncached_acc=bench.refs["heldout_acc"], fd_floor=bench.refs["fd_floor"],
                modes_identical=bench.refs["modes_identical"], unavailable=unavailable, weights=spec.weights_id(),
                uncached_b10_cpu=median(bench.refs[("heldout_cpu", bench.mode)]),
                uncached_b10_wall=median(bench.refs[("heldout_wall", bench.mode)]))

    previous: dict[str, dict] = {}
    if (args.resume or args.rerun) and (out / f"{stem}.json").is_file():
        old = json.loads((out / f"{stem}.json").read_text())
        same = all(old["meta"].get(k) == meta[k] for k in ("steps", "heldout_seeds", "repeats", "threads"))
        if same:
            previous = {f"{r['library']}:{r['method']}": r for r in old["results"] if not r.get("error")}
        if args.rerun:
            same = same and old["meta"].get("weights") == meta["weights"]
            if not same:
                raise SystemExit(f"--rerun keeps the other rows of {out / (stem + '.json')}, but that run used other "
                                 f"steps / seeds / repeats / threads / model weights; rerun everything instead (no "
                                 f"--rerun).")
            kept = [r for r in old["results"] if not re.search(args.rerun, f"{r['library']}:{r['method']}")]
            previous = {f"{r['library']}:{r['method']}": r for r in kept}
            # the kept rows come from the first full run and from every earlier rerun whose rows survive: keep
            # that history (oldest first) so the report can date each row group
            old_rerun = old["meta"].get("rerun")
            base = old_rerun["kept_from"] if old_rerun else dict(command=old["meta"]["command"],
                                                                 date=old["meta"]["date"])
            earlier = [*old_rerun.get("earlier", []),
                       dict(pattern=old_rerun["pattern"], command=old["meta"]["command"],
                            date=old["meta"]["date"])] if old_rerun else []
            meta["rerun"] = dict(pattern=args.rerun, kept_from=base, earlier=earlier)
            labels = {c.label for c in contenders}
            contenders += [c for c in all_contenders if c.label not in labels and c.label in previous]
            order = {f"{r['library']}:{r['method']}": i for i, r in enumerate(old["results"])}
            last = {r["library"]: i for i, r in enumerate(old["results"])}  # new contenders: after their library's
            contenders.sort(key=lambda c: order.get(c.label, last.get(c.library, len(order)) + 0.5))
    sweeper = Sweeper(bench, log)
    results: list[dict] = []
    for c in contenders:
        if c.label in previous:
            log(f"[{c.label}] reused from {out / (stem + '.json')}")
            results.append(previous[c.label])
            continue
        results.append(sweeper.contender(c, quick))
        meta.update(runtime_s=time.time() - started, load_end=_load())
        write_report(results, meta, out, stem)  # after every contender: a crash keeps what was measured
    meta.update(runtime_s=time.time() - started, load_end=_load())
    md, _, png = write_report(results, meta, out, stem)
    log(f"wrote {md} and {png} in {(time.time() - started) / 60:.1f} min")
    return md


def _weights_id() -> str:
    """sha256 prefix of tiny-digits' transformer weights (the assets may be retrained between runs)."""
    return models.MODELS["digits"].weights_id()


def _load() -> str:
    try:
        return " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
