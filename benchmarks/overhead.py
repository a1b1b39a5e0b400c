"""Where a batch-1 call's time goes, and how close each cache comes to the speed-up its compute ratio allows.

A block cache removes block compute only. On the bundled tiny model at batch 1 a large share of each transformer
call is spent outside the blocks (embedders, RoPE, norms, Python dispatch, the pipeline loop and scheduler), so
"ideal = 1 / compute ratio" is out of reach for every library. This script measures that share directly:

    T_bare   time per generation, no cache
    T_floor  time per generation with every block replaced by a pass-through (no block compute at all)
    T(r)     achievable time at block compute ratio r = T_floor + r * (T_bare - T_floor)
    overhead = T_measured - T(r): what the cache path itself costs (hooks, signals, host syncs, cache writes)

and reports, for dcache, diffusers' FirstBlockCache and cache-dit's DBCache at equal settings (one probe block, no
warm-up, thresholds from 0 = cache on but nothing reused, to heavy reuse), and for MagCache with one shared ratio
table (diffusers' own calibration) in dcache's block scope, dcache's call scope (`scope="call"`: a reused call is
x + Delta of the whole transformer, dcache.runtime.call_scope) and diffusers, at identical decisions: the compute ratio
(block FLOPs, counted by an outside meter), measured speed-up, ideal (1 / r), achievable (T_bare / T(r)),
measured/ideal and measured/achievable. T_pipe, the generation with the transformer call itself replaced by an
identity, is the floor of call scope: what the pipeline does per step around the transformer (label encoder, scheduler
step). Timings are thread CPU time (the machine is shared; CPU time does not count waiting), rounds interleave every
contender with the bare and floor runs so that drift cancels, and each figure is the median.

    python benchmarks/overhead.py                   # ~6 min on an idle 2-core machine
    python benchmarks/overhead.py --rounds 3        # quicker, noisier
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
SCRATCH = BENCH / "out"  # git-ignored default for --out
RESULTS = BENCH / "results"  # the tracked tables BENCHMARKS.md is assembled from (and the hand-written notes)
STEPS = 28
LABEL = 3
THRESHOLDS = (0.0, 0.1, 0.2, 0.4)
MAGCACHE_THRESHOLDS = (0.06, 0.5)  # with K=4, retention 0.1: compute ratios ~0.5 and ~0.3 on this model
MAGCACHE_K, MAGCACHE_RETENTION = 4, 0.1
# --magcache-thresholds entries are "threshold" (K and retention above) or "threshold:K:retention"; e.g. 100:4:0 and
# 100:7:0 reuse as often as K allows: compute ratios ~0.2 and ~0.14, the frontier's bands.


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median reported)")
    ap.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS),
                    help="comma-separated probe thresholds, the same for every library")
    ap.add_argument("--magcache-thresholds", default=",".join(f"{t:g}" for t in MAGCACHE_THRESHOLDS),
                    help=f"comma-separated MagCache settings, 'threshold' (K={MAGCACHE_K}, retention "
                         f"{MAGCACHE_RETENTION:g}) or 'threshold:K:retention' (one shared ratio table) for the "
                         f"block-scope / call-scope / diffusers rows; '' for none")
    ap.add_argument("--keyframes", default="",
                    help="comma-separated names of benchmarks/frontier.py's no-CFG keyframe plans (e.g. 6,4: 6 and 4 "
                         "computed steps of 28) for keyframe rows in block and call scope; '' for none")
    ap.add_argument("--forecasters", default="",
                    help="comma-separated forecasters (foca, hyca, spectrum, dmd, l2p) served between the --keyframes "
                         "plans' keyframes in call scope: their cost per call beside the Taylor rows; '' for none")
    ap.add_argument("--adaptive", default="",
                    help="comma-separated compute ratios for adaptive_keyframe rows in call scope (e.g. 0.214,0.143); "
                         "'' for none")
    ap.add_argument("--out", type=Path, default=SCRATCH,
                    help="folder for overhead.md (default benchmarks/out/, git-ignored; --out benchmarks/results "
                         "refreshes the table BENCHMARKS.md is assembled from)")
    ap.add_argument("--no-cache-dit", action="store_true",
                    help="leave cache-dit's rows out (otherwise a missing cache-dit is an error naming the extra)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch and diffusers load

import torch  # noqa: E402

sys.path.insert(0, str(BENCH))

import dcache  # noqa: E402
from dcache.model.families import adapter_for  # noqa: E402
from dcache.runtime.step_invariant import install_memos  # noqa: E402
from dcache.pipelines.bundled import load_tiny_pipeline  # noqa: E402
from dcache.runtime.block_io import StreamSlots  # noqa: E402

from _peers import BlockMeter, cache_dit_unavailable, enable_cache_dit, transformer_blocks  # noqa: E402


@dataclass
class Row:
    library: str
    method: str
    setting: str
    enable: Callable[[object], Callable[[], None]]  # enable(pipe) -> remove()
    ratio: float = 1.0
    times: list[float] | None = None
    pipe: object = None  # each row on its own copy of the pipeline: no library's leftovers reach another's rows


def generate(pipe) -> None:
    pipe(labels=[LABEL], num_inference_steps=STEPS, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
         output_type="pt")


def cpu_time(fn: Callable[[], None]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


class Floor:
    """Every block returns its inputs in its own output format: what is left is the time outside the blocks."""

    def __init__(self, pipe, memoize: bool = False):
        from diffusers.hooks import ModelHook

        class PassThrough(ModelHook):
            def __init__(self, slots: StreamSlots):
                super().__init__()
                self.slots = slots

            def new_forward(self, module, *args, **kwargs):
                return self.slots.make_output(*self.slots.read(args, kwargs))

        adapter = adapter_for(pipe.transformer)
        self.transformer, self.invariants = pipe.transformer, adapter.invariants if memoize else ()
        self.hooks = [(block, PassThrough(StreamSlots.for_block(block, adapter.block_lists[li])))
                      for li, block in adapter.blocks(pipe.transformer)]
        self._pre = None

    def __enter__(self):
        from diffusers.hooks import HookRegistry

        for block, hook in self.hooks:
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, "floor")
        if self.invariants:  # dcache's step-invariant memo (RoPE tables) on top of the pass-through blocks
            call = {}
            self._pre = self.transformer.register_forward_pre_hook(
                lambda m, a, kw: call.update(kwargs=kw), with_kwargs=True)
            install_memos(self.transformer, self.invariants, "floor", lambda: call.get("kwargs"))
        return self

    def __exit__(self, *exc):
        from diffusers.hooks import HookRegistry

        for block, _ in self.hooks:
            HookRegistry.check_if_exists_or_initialize(block).remove_hook("floor", recurse=False)
        if self._pre is not None:
            self._pre.remove()
            HookRegistry.check_if_exists_or_initialize(self.transformer).remove_hook("floor", recurse=True)


class NoTransformer:
    """The transformer call returns its latent input: what is left is the pipeline's own per-step work."""

    def __init__(self, pipe):
        self.transformer = pipe.transformer

    def __enter__(self):
        self.transformer.forward = lambda hidden_states, return_dict=True, **kw: (hidden_states,)
        return self

    def __exit__(self, *exc):
        del self.transformer.forward


def parse_magcache(text: str) -> tuple[tuple[float, int, float], ...]:
    """'0.06,100:7:0' -> ((0.06, K, retention), (100.0, 7, 0.0)) with the default K and retention."""
    out = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        parts = entry.split(":")
        if len(parts) not in (1, 3):
            raise SystemExit(f"error: --magcache-thresholds entry {entry!r} must be 'threshold' or "
                             f"'threshold:K:retention'")
        thr, k, retention = (float(parts[0]), MAGCACHE_K, MAGCACHE_RETENTION) if len(parts) == 1 else (
            float(parts[0]), int(parts[1]), float(parts[2]))
        out.append((thr, k, retention))
    return tuple(out)


def keyframe_contenders(names: list[str]) -> list[Row]:
    """benchmarks/frontier.py's no-CFG keyframe plans in block scope and call scope (identical decisions)."""
    from frontier import KEYFRAMES

    rows = []
    for name in names:
        setting = dict(KEYFRAMES["nocfg"][name])
        text = f"plan {name} (frontier nocfg)"
        for scope in ("blocks", "call"):
            rows.append(Row("dcache", f"keyframe scope={scope}", text,
                            lambda p, c=setting, sc=scope: dcache.apply(p, "keyframe", scope=sc, **c).remove))
    return rows


def forecaster_contenders(names: list[str], forecasters: list[str]) -> list[Row]:
    """The same no-CFG keyframe plans in call scope with another forecaster between the keyframes
    (dcache.schedules.forecasters at its defaults): what each costs per call beside the Taylor rows. L2P is fitted
    once, on one generation of the timed input (its default ridge): its table's cost, not its quality, is timed."""
    from frontier import KEYFRAMES

    rows = []
    for name in names:
        setting = dict(KEYFRAMES["nocfg"][name])
        for forecaster in forecasters:
            def enable(p, c=setting, f=forecaster, fitted={}):  # noqa: B006  (one fit per row, kept across rounds)
                if f == "l2p" and "spec" not in fitted:
                    from dcache.schedules.tuning.l2p_fit import fit_l2p

                    fitted["spec"] = fit_l2p(p, [lambda: generate(p)], "keyframe", progress=False, **c)
                spec = fitted["spec"] if f == "l2p" else f
                return dcache.apply(p, "keyframe", scope="call", forecaster=spec, **c).remove

            rows.append(Row("dcache", f"keyframe scope=call {forecaster}", f"plan {name} (frontier nocfg)", enable))
    return rows


def adaptive_contenders(ratios: list[float]) -> list[Row]:
    """adaptive_keyframe in call scope at each compute ratio: the cost of measuring its forecast error after every
    computed call and placing the next one."""
    return [Row("dcache", "adaptive_keyframe scope=call", f"compute_ratio={r:g}",
                lambda p, r=r: dcache.apply(p, "adaptive_keyframe", scope="call", compute_ratio=r).remove)
            for r in ratios]


def magcache_contenders(ratios: list[float], settings: tuple[tuple[float, int, float], ...]) -> list[Row]:
    """MagCache at identical decisions: the same ratio table, threshold, K and retention in all three rows."""
    from diffusers import MagCacheConfig

    rows = []
    for thr, k, retention in settings:
        setting = f"threshold={thr:g} K={k} retention={retention:g}"
        common = dict(ratios=list(ratios), threshold=thr, max_skip_steps=k, retention_ratio=retention)
        for scope in ("blocks", "call"):
            rows.append(Row("dcache", f"magcache scope={scope}", setting,
                            lambda p, c=common, sc=scope: dcache.apply(p, "magcache", scope=sc, **c).remove))

        def diffusers_mag(p, t=thr, k=k, retention=retention):
            p.transformer.enable_cache(MagCacheConfig(threshold=t, max_skip_steps=k, retention_ratio=retention,
                                                      mag_ratios=list(ratios), num_inference_steps=STEPS))
            return p.transformer.disable_cache

        rows.append(Row("diffusers", "MagCache", setting, diffusers_mag))
    return rows


def contenders(thresholds: tuple[float, ...] = THRESHOLDS, cache_dit: bool = True) -> list[Row]:
    """The probe-threshold rows; cache_dit=False leaves cache-dit's out (main() checks that it imports)."""
    from diffusers import FirstBlockCacheConfig

    rows = []
    for thr in thresholds:
        rows.append(Row("dcache", "fbcache", f"threshold={thr:g} warmup_steps=0",
                        lambda p, t=thr: dcache.apply(p, "fbcache", threshold=t, warmup_steps=0).remove))

        def diffusers_fbc(p, t=thr):
            p.transformer.enable_cache(FirstBlockCacheConfig(threshold=t))
            return p.transformer.disable_cache

        rows.append(Row("diffusers", "FirstBlockCache", f"threshold={thr:g}", diffusers_fbc))
        if cache_dit:
            def cache_dit_db(p, t=thr):
                applied = enable_cache_dit(p, {"F": 1, "B": 0, "W": 0, "threshold": t}, STEPS)
                return applied.remove

            rows.append(Row("cache-dit", "DBCache", f"F=1 B=0 W=0 threshold={thr:g}", cache_dit_db))
    return rows


def measure_ratio(pipe, meter: BlockMeter, bare_flops: float, row: Row) -> None:
    remove = row.enable(pipe)
    try:
        generate(pipe)  # warm: calibrations, first-call allocations
        with meter.count():
            generate(pipe)
        row.ratio = meter.flops / bare_flops
    finally:
        remove()


def run(rounds: int, log: Callable[[str], None], thresholds: tuple[float, ...] = THRESHOLDS,
        magcache_thresholds: tuple[tuple[float, int, float], ...] = tuple(
            (t, MAGCACHE_K, MAGCACHE_RETENTION) for t in MAGCACHE_THRESHOLDS),
        cache_dit: bool = True, keyframes: tuple[str, ...] = (), forecasters: tuple[str, ...] = (),
        adaptive: tuple[float, ...] = ()) -> tuple[dict, list[Row]]:
    from _peers import calibrate_diffusers_magcache

    torch.set_num_threads(1)
    pipe = load_tiny_pipeline()
    meter = BlockMeter(pipe.transformer)
    with meter.count():
        generate(pipe)
    bare_flops = meter.flops
    meter.remove()
    rows = contenders(thresholds, cache_dit)
    if magcache_thresholds:
        ratios, _ = calibrate_diffusers_magcache(pipe, lambda: generate(pipe), STEPS)
        rows += magcache_contenders(ratios, magcache_thresholds)
    rows += keyframe_contenders(list(keyframes))
    rows += forecaster_contenders(list(keyframes), list(forecasters))
    rows += adaptive_contenders(list(adaptive))
    for row in rows:
        row.pipe = load_tiny_pipeline()
        row_meter = BlockMeter(row.pipe.transformer)  # before the cache, see _peers.BlockMeter
        measure_ratio(row.pipe, row_meter, bare_flops, row)
        log(f"  ratio {row.library}:{row.method} {row.setting}: {row.ratio:.3f}")
        row.times = []
    bare, floor, floor_memo, floor_pipe = [], [], [], []
    generate(pipe)
    for i in range(rounds):
        bare.append(cpu_time(lambda: generate(pipe)))
        with NoTransformer(pipe):
            generate(pipe)
            floor_pipe.append(cpu_time(lambda: generate(pipe)))
        with Floor(pipe):
            generate(pipe)
            floor.append(cpu_time(lambda: generate(pipe)))
        with Floor(pipe, memoize=True):
            generate(pipe)
            floor_memo.append(cpu_time(lambda: generate(pipe)))
        for row in rows:
            remove = row.enable(row.pipe)
            try:
                generate(row.pipe)
                row.times.append(cpu_time(lambda: generate(row.pipe)))
            finally:
                remove()
        log(f"round {i + 1}/{rounds}: bare {bare[-1] * 1e3 / STEPS:.2f} ms/call, floor {floor[-1] * 1e3 / STEPS:.2f}")
    meta = {"t_bare": statistics.median(bare), "t_floor": statistics.median(floor),
            "t_floor_memo": statistics.median(floor_memo), "t_pipe": statistics.median(floor_pipe),
            "rounds": rounds,
            "blocks": len(transformer_blocks(pipe.transformer)), "torch": torch.__version__}
    return meta, rows


def report(meta: dict, rows: list[Row]) -> list[str]:
    tb, tf = meta["t_bare"], meta["t_floor"]
    per_call = 1e3 / STEPS
    lines = [
        f"Bundled tiny model, batch 1, {STEPS} steps, no CFG, 1 thread; thread CPU time, median of {meta['rounds']} "
        f"interleaved rounds; torch {meta['torch']}.",
        "",
        f"- no cache: **{tb * per_call:.2f} ms** per transformer call (including the pipeline's per-step work)",
        f"- every block skipped (pass-through, no block compute): **{tf * per_call:.2f} ms** per call, i.e. "
        f"**{tf / tb:.0%}** of a call is outside the blocks",
        f"- so at compute ratio 0.3 no block cache can exceed {1 / (tf / tb + 0.3 * (1 - tf / tb)):.2f}x "
        f"(measured/ideal <= {0.3 / (tf / tb + 0.3 * (1 - tf / tb)):.2f})",
    ]
    if "t_floor_memo" in meta:
        tm = meta["t_floor_memo"]
        lines.append(
            f"- with dcache's step-invariant memo (RoPE tables computed once, `dcache.runtime.step_invariant`) that "
            f"work is **{tm * per_call:.2f} ms** per call ({tm / tb:.0%}); dcache's own cap at ratio 0.3 is then "
            f"{1 / (tm / tb + 0.3 * (1 - tf / tb)):.2f}x (measured/ideal <= "
            f"{0.3 / (tm / tb + 0.3 * (1 - tf / tb)):.2f}). The columns below use the plain floor, the same for "
            f"every library, so dcache's measured/achievable can exceed 1")
    if "t_pipe" in meta:
        tp = meta["t_pipe"]
        lines.append(
            f"- the pipeline's own per-step work (transformer call replaced by an identity): **{tp * per_call:.2f} "
            f"ms** per call ({tp / tb:.0%}); dcache's call scope skips everything else in a reused call, so its cap "
            f"at ratio 0.3 is {1 / (0.3 + 0.7 * tp / tb):.2f}x (measured/ideal <= {0.3 / (0.3 + 0.7 * tp / tb):.2f})"
            f". In call scope the 'achievable' column still assumes the plain floor, so measured/achievable can "
            f"exceed 1")
    lines += [
        "",
        "| library | method | setting | compute ratio | ms/call | cache-path overhead ms/call | speed-up | ideal | "
        "achievable | measured/ideal | measured/achievable |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t = statistics.median(row.times)
        achievable_t = tf + row.ratio * (tb - tf)
        lines.append(
            f"| {row.library} | {row.method} | {row.setting} | {row.ratio:.3f} | {t * per_call:.2f} | "
            f"{(t - achievable_t) * per_call:+.2f} | {tb / t:.2f} | {1 / row.ratio:.2f} | {tb / achievable_t:.2f} | "
            f"{(tb / t) * row.ratio:.2f} | {achievable_t / t:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> Path:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    missing = None if args.no_cache_dit else cache_dit_unavailable()
    if missing:
        ap.error(missing)
    t0 = time.time()
    thresholds = tuple(float(t) for t in args.thresholds.split(","))
    mag = parse_magcache(args.magcache_thresholds)
    keyframes = tuple(k.strip() for k in args.keyframes.split(",") if k.strip())
    forecasters = tuple(f.strip() for f in args.forecasters.split(",") if f.strip())
    adaptive = tuple(float(r) for r in args.adaptive.split(",") if r.strip())
    if forecasters and not keyframes:
        ap.error("--forecasters serves between the --keyframes plans' keyframes: pass --keyframes too (e.g. 6,4)")
    meta, rows = run(args.rounds, lambda m: print(m, flush=True), thresholds, mag, cache_dit=not args.no_cache_dit,
                     keyframes=keyframes, forecasters=forecasters, adaptive=adaptive)
    lines = report(meta, rows)
    lines += ["", f"Command: `python benchmarks/overhead.py --rounds {args.rounds} --thresholds {args.thresholds} "
                  f"--magcache-thresholds {args.magcache_thresholds}"
                  + (f" --keyframes {args.keyframes}" if keyframes else "")
                  + (f" --forecasters {args.forecasters}" if forecasters else "")
                  + (f" --adaptive {args.adaptive}" if adaptive else "")
                  + (" --no-cache-dit" if args.no_cache_dit else "")
                  + f"` ({(time.time() - t0) / 60:.1f} min)."]
    notes = RESULTS / "overhead_notes.md"
    if notes.is_file():  # the hand-written reading of these numbers (kept across reruns)
        lines += ["", notes.read_text().rstrip()]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "overhead.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    print("\n".join(lines))
    return path


if __name__ == "__main__":
    main()
