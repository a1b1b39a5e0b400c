"""What one forecast costs per forecaster, at the bundled model's size and at FLUX's, with its fit kept between
computed steps (what dcache does) and made again at every forecast (what a forecaster that keeps nothing pays).

    python benchmarks/forecast_cost.py --out benchmarks/results            # CPU, 1 thread (~3 min)
    python benchmarks/forecast_cost.py --device cuda --out benchmarks/out  # on a GPU (bfloat16 values)

One cached unit's history is filled with K computed values (steps 0, 5, 11, 17 of 28, random tensors: the cost does
not depend on the values), then the unit is forecast at the five steps 18..22 that follow, as between two keyframes.
Per forecaster: milliseconds per forecast, averaged over the five (median of `--repeats` gaps):

    kept     the library path, forecaster(hist, step): a fit that reads the kept values only (HyCa's backtests, DMD's
             Gram matrices and modes, Spectrum's weight solve) is made at the first forecast after a computed value
             and kept in the history until the next one (dcache.schedules.forecasters.base)
    refit    the same forecasts with the fit made at every one (`extrapolate`; Spectrum's weight cache cleared before
             each): what every forecast cost before fits were kept
    taylor   the engine's Taylor table of order 2 (hist.forecast), for scale

Sizes: the bundled tiny-digits call-scope Delta [1, 64, 4], FLUX.1 at 1024x1024's call-scope Delta (the packed latent,
[1, 4096, 64]) and one FLUX block's residual ([1, 4608, 3072]: 4096 image + 512 text tokens, width 3072): in block
scope every one of its 57 blocks is forecast so, at every forecast step. Writes <out>/forecast_cost.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

SIZES = {
    "tiny-digits call Delta": (1, 64, 4),
    "FLUX 1024² call Delta": (1, 4096, 64),
    "FLUX 1024² block residual": (1, 4608, 3072),
}
FORECASTERS = ("foca", "hyca", "spectrum", "dmd")
COMPUTED = (0, 5, 11, 17)  # the kept values' steps (of 28)
TARGETS = (18, 19, 20, 21, 22)  # the forecasts until the next computed step


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="torch device (cpu: float32 values; cuda: bfloat16)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=5, help="gaps timed per cell (the median is reported)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                    help="folder for forecast_cost.json / forecast_cost.md")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch loads

import torch  # noqa: E402

from dcache.eval.runner import _git_commit  # noqa: E402  (the script's own checkout: it may run an installed dcache)
from dcache.runtime.cache_state import UnitHistory  # noqa: E402
from dcache.schedules.forecasters import build_forecaster, spectrum  # noqa: E402


def history(forecaster, shape: tuple[int, ...], device: str, dtype: torch.dtype) -> UnitHistory:
    """One unit's history with the forecaster's window (and an order-2 Taylor table) filled at COMPUTED."""
    hist = UnitHistory(2, depth=forecaster.depth if forecaster is not None else 0)
    g = torch.Generator(device=device).manual_seed(0)
    for s in COMPUTED:
        hist.update([torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)], s)
    return hist


def timed_gap(serve, device: str) -> float:
    """Seconds for the forecasts of one gap (TARGETS), the device drained before and after."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in TARGETS:
        serve(step)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(name: str, shape: tuple[int, ...], device: str, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """ms per forecast, kept and refit (median over `repeats` gaps; one warm-up gap each)."""
    f = build_forecaster(name)
    f.num_steps = 28
    hist = history(f, shape, device, dtype)
    steps = [float(s) for s, _ in hist.samples]
    values = [v[0] for _, v in hist.samples]

    def kept(step):
        f(hist, step)

    def refit(step):
        spectrum._weights.cache_clear()
        f.extrapolate(steps, values, float(step))

    out = {}
    for label, serve, before in (("kept", kept, lambda: hist.fitted.clear()), ("refit", refit, lambda: None)):
        before()
        timed_gap(serve, device)
        runs = []
        for _ in range(repeats):
            before()  # each gap starts right after a computed value: nothing kept yet
            runs.append(timed_gap(serve, device))
        out[label] = 1000 * statistics.median(runs) / len(TARGETS)
    return out


def taylor(shape: tuple[int, ...], device: str, dtype: torch.dtype, repeats: int) -> float:
    hist = history(None, shape, device, dtype)
    timed_gap(hist.forecast, device)
    return 1000 * statistics.median(timed_gap(hist.forecast, device) for _ in range(repeats)) / len(TARGETS)


def write(data: dict, out: Path) -> Path:
    lines = [f"ms per forecast of one cached unit (median of {data['repeats']} gaps of {len(TARGETS)} forecasts, "
             f"window values at steps {list(COMPUTED)}), {data['machine']}, {data['dtype']} values; "
             f"kept: the fit kept between computed steps (dcache); refit: made at every forecast.", "",
             "| tensor | shape | taylor o2 | " + " | ".join(f"{n} kept | {n} refit" for n in FORECASTERS) + " |",
             "|---|---|---|" + "---|---|" * len(FORECASTERS)]
    for label, row in data["rows"].items():
        cells = [f"{row[n]['kept']:.3f} | {row[n]['refit']:.3f}" for n in FORECASTERS]
        lines.append(f"| {label} | {list(row['shape'])} | {row['taylor']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", f"`{data['command']}` (commit {data['git_commit']}, {data['seconds']:.0f} s)."]
    path = out / "forecast_cost.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "forecast_cost.json").write_text(json.dumps(data, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    machine = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
               else f"{platform.machine()} CPU, {args.threads} thread(s)")
    started = time.time()
    rows = {}
    for label, shape in SIZES.items():
        row = {"shape": shape, "taylor": taylor(shape, args.device, dtype, args.repeats)}
        for name in FORECASTERS:
            row[name] = measure(name, shape, args.device, dtype, args.repeats)
            print(f"{label} {name}: kept {row[name]['kept']:.3f} ms, refit {row[name]['refit']:.3f} ms "
                  f"(taylor {row['taylor']:.3f})", flush=True)
        rows[label] = row
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/forecast_cost.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    data = {"command": command.strip(), "git_commit": _git_commit(Path(__file__).resolve().parents[1]),
            "machine": machine, "dtype": str(dtype).removeprefix("torch."), "repeats": args.repeats, "rows": rows,
            "seconds": time.time() - started}
    path = write(data, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
