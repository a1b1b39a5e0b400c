"""Write docs/methods.md from the code and the committed benchmark results:

    python benchmarks/methods_page.py

Per method: its config's documentation (summary, paper, when to use it, example, knobs with defaults and ranges:
dcache.method_docs.describe), its formulation (the docstring of its module in schedules/), and its measured rows on
the bundled tiny model (benchmarks/results/methods.json: held-out PSNR, compute ratio, batch-1 speed-up). Then the
forecasters a forecasting method can use instead of Taylor (dcache.schedules.forecasters: each file's formulation,
its settings, and its rows in benchmarks/results/forecasters.json). The page is generated so that it always says
what the code does; tests/meta/test_method_docs.py checks it is up to date.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=__doc__.split("\n")[0] + " Takes no arguments.")


if __name__ == "__main__":
    build_parser().parse_args()  # --help answers here, before dcache (torch, diffusers) loads, and writes nothing

import dcache  # noqa: E402
from dcache.method_docs import describe, summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "methods.json"
FORECASTER_RESULTS = ROOT / "benchmarks" / "results" / "forecasters.json"
PAGE = ROOT / "docs" / "methods.md"


def measured_rows(name: str, methods: dict) -> list[str]:
    """Table rows of the dcache variants of `name` (e.g. magcache, magcache forecast, magcache call)."""
    rows = [r for result in methods["results"] for r in result["rows"]
            if r["library"] == "dcache" and r["method"].split()[0] == name and r.get("psnr_heldout")]
    return [f"| {r['method']} | {r['setting']} | {r['ratio']:.3f} | {r['psnr_heldout']:.2f} | "
            f"{r['b1_speedup_wall']:.2f}x |" for r in sorted(rows, key=lambda r: (r["method"], -r["ratio"]))]


def page(methods_results: dict | None) -> str:
    known, presets = dcache.methods(), dcache.presets()
    out = ["# Methods", "",
           "Every caching method of dcache, generated from the code by `python benchmarks/methods_page.py` "
           "(`dcache methods NAME` prints the same documentation). Each section gives the method's documentation "
           "and knobs (defaults and the ranges validation enforces), its formulation as implemented "
           "(`schedules/<method>.py`), and its measured rows on the bundled tiny model from "
           "[benchmarks/results/methods.json](../benchmarks/results/methods.json) (held-out PSNR vs the uncached "
           "samples, compute ratio = block FLOPs computed / uncached, measured batch-1 wall-clock speed-up on a "
           "2-core CPU; see [BENCHMARKS.md](../BENCHMARKS.md)).", "",
           "```python", "import dcache", "from dcache.method_docs import describe", "",
           "print(describe(dcache.methods()[\"magcache\"], dcache.presets()))  # the text of a section below",
           "```", "",
           "| method | summary |", "|---|---|"]
    out += [f"| [{name}](#{name.replace('_', '-')}) | {summary(cls)} |" for name, cls in sorted(known.items())]
    for name, cls in sorted(known.items()):
        module = inspect.getmodule(cls)
        out += ["", f"## {name.replace('_', '-')}", "", "```text", describe(cls, presets), "```", "",
                "**Formulation** (`" + Path(module.__file__).relative_to(ROOT).as_posix() + "`):", "", "```text",
                inspect.cleandoc(module.__doc__ or ""), "```"]
        rows = measured_rows(name, methods_results) if methods_results else []
        out += ["", "**Measured** (bundled tiny model, 28 steps, CFG 1.5, 100 held-out samples):", ""]
        if rows:
            out += ["| variant | setting | compute ratio | PSNR held-out (dB) | batch-1 speed-up |",
                    "|---|---|---|---|---|", *rows]
        else:
            out.append("not in the methods benchmark.")
    forecasts = json.loads(FORECASTER_RESULTS.read_text()) if FORECASTER_RESULTS.is_file() else None
    return "\n".join(out + forecasters_section(forecasts)) + "\n"


def _range(knob) -> str:
    """A setting's allowed range ("-" for one without bounds, e.g. L2P's table)."""
    return "-" if knob.low is None and knob.high is None else f"{knob.low:g} to {knob.high:g}"


def forecasters_section(results: dict | None) -> list[str]:
    """## Forecasters: per forecaster its formulation (the file's docstring), settings and measured rows."""
    from dcache.schedules.forecasters import FORECASTERS

    out = ["", "## Forecasters", "",
           "What a FORECAST serves instead of the Taylor table: `forecaster=` on taylorseer, keyframe, fixed_interval "
           "and seacache (a name, or `{\"name\": ..., setting: value}`), or a plan's `extras[\"forecaster\"]`; every "
           "unit kind and the call "
           "scope. Measured rows: [benchmarks/results/forecasters.json](../benchmarks/results/forecasters.json) "
           "(keyframe in call scope, uniform keyframes, held-out PSNR vs uncached; `taylor-o1` / `taylor-o2` are the "
           "Taylor table the forecasters replace).", "",
           "```python", "import dcache", "from dcache.pipelines.bundled import load_tiny_pipeline", "",
           "pipe = load_tiny_pipeline()",
           "with dcache.apply(pipe, \"keyframe\", scope=\"call\", forecaster=\"foca\"):",
           "    pipe(\"3\", num_inference_steps=8)",
           "with dcache.apply(pipe, \"taylorseer\", "
           "forecaster={\"name\": \"spectrum\", \"degree\": 2, \"ridge\": 0.0}):",
           "    pipe(\"3\", num_inference_steps=8)",
           "",
           "# L2P learns its weights on calibration runs of your own prompts (seeded, returning tensors), at the step",
           "# count and keyframes it will serve; ridge=\"auto\" picks, on the first run, the pull towards Taylor",
           "import torch",
           "from dcache.schedules.tuning.l2p_fit import fit_l2p",
           "",
           "frames = (0.0, 0.3, 0.6, 0.9)",
           "runs = [lambda seed=seed: pipe(\"3\", num_inference_steps=8, output_type=\"pt\",",
           "                               generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]",
           "spec = fit_l2p(pipe, runs, \"keyframe\", keyframes=frames, ridge=\"auto\")",
           "with dcache.apply(pipe, \"keyframe\", scope=\"call\", keyframes=frames, forecaster=spec):",
           "    pipe(\"3\", num_inference_steps=8)",
           "```"]
    for name, cls in sorted(FORECASTERS.items()):
        module = inspect.getmodule(cls)
        out += ["", f"### {name}", "", "```text", inspect.cleandoc(module.__doc__ or ""), "```", "",
                "| setting | default | range | meaning |", "|---|---|---|---|"]
        out += [f"| {key} | {k.default!r} | {_range(k)} | {k.doc} |" for key, k in cls.knobs.items()]
        rows = [r for r in (results or {}).get("rows", []) if r["forecaster"] in (name, "taylor-o2")]
        if any(r["forecaster"] == name for r in rows):  # a forecaster newer than the results has no rows yet
            out += ["", f"| model | compute ratio | {name} PSNR (dB) | taylor-o2 PSNR (dB) |",
                    "|---|---|---|---|"]
            for model, ratio in sorted({(r["model"], r["target_ratio"]) for r in rows}, key=lambda m: (m[0], -m[1])):
                cell = {r["forecaster"]: r for r in rows if (r["model"], r["target_ratio"]) == (model, ratio)}
                out.append(f"| {model} | {cell[name]['compute_ratio']:.3f} | {cell[name]['psnr']:.2f} | "
                           f"{cell['taylor-o2']['psnr']:.2f} |")
    return out


def main() -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else None
    PAGE.write_text(page(results))
    print(f"wrote {PAGE.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
