"""BENCHMARKS.md's GPU section from benchmarks/results/gpu/*.json (written by benchmarks/gpu.py, one file per part
and model). Dry-run results (CPU, tiny configs) are never shown."""

from __future__ import annotations

import json
from pathlib import Path

RUN_ALL = ("python benchmarks/gpu.py --part speed --model flux.1-dev   # and --model wan2.1-t2v-1.3b / qwen-image; "
           "--part memory / kernels / compile / offload")


def load(folder: Path) -> list[dict]:
    results = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        for result in data if isinstance(data, list) else [data]:
            if not result.get("dry_run"):
                results.append(result)
    return results


def _mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:,.1f}"


def _header(r: dict) -> str:
    s = r["setting"]
    frames = f"x{s['frames']} frames" if s["frames"] > 1 else ""
    return (f"**{r['model']}** on {r['device']}: {s['width']}x{s['height']}{frames}, {s['steps']} steps, CFG "
            f"{s['cfg']}, {s['dtype'].removeprefix('torch.')}, random weights; torch {r['torch']}, diffusers "
            f"{r['diffusers']}, triton {r['triton']}; median of {r['runs']} runs.  \n`{r['command']}`")


def speed_table(r: dict) -> str:
    stopped = " (the run stopped at its time limit: the methods it finished)" if r.get("complete") is False else ""
    lines = [_header(r) + stopped, "", "| method | scope | compute ratio | ideal | uncached s | cached s | measured | "
             "measured / ideal |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['method']} | {row['scope']} | {row['compute_ratio']:.3f} | {row['ideal_speedup']:.2f}x "
                     f"| {row['uncached_s']:.2f} | {row['cached_s']:.2f} | {row['measured_speedup']:.2f}x "
                     f"| {row['measured_over_ideal']:.2f} |")
    return "\n".join(lines)


def memory_table(r: dict) -> str:
    lines = [_header(r), "", f"Uncached generation peak: {_mib(r['uncached_peak_bytes'])} MiB.", "",
             "| method | scope | measured extra peak MiB | handle.memory() MiB | dcache.memory.estimate MiB |",
             "|---|---|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['method']} | {row['scope']} | {_mib(row['measured_extra_bytes'])} "
                     f"| {_mib(row['handle_memory_bytes'])} | {_mib(row['estimate_bytes'])} |")
    return "\n".join(lines)


def compile_table(r: dict) -> str:
    return "\n".join([_header(r), "", "| eager s | compiled s | compiled + dcache s | on top of compile | graphs | "
                      "graph breaks | recompiles |", "|---:|---:|---:|---:|---:|---:|---:|",
                      f"| {r['eager_uncached_s']:.2f} | {r['compiled_uncached_s']:.2f} | {r['compiled_cached_s']:.2f} "
                      f"| {r['speedup_on_top_of_compile']:.2f}x ({r['method']}, ratio {r['compute_ratio']:.3f}) "
                      f"| {r['unique_graphs']} | {r['graph_breaks']} | {r['recompiles']} |"])


def cudagraphs_table(r: dict) -> str:
    head = ("| backend / mode | compiled s | compiled + dcache s | on top of compile | graphs (after warm-up) | graph "
            "breaks | max abs diff vs eager dcache |")
    row = (f"| {r['backend']} / {r['mode']} | {r['compiled_uncached_s']:.2f} | {r['compiled_cached_s']:.2f} "
           f"| {r['speedup_on_top_of_compile']:.2f}x ({r['method']}, ratio {r['compute_ratio']:.3f}) "
           f"| {r['unique_graphs']} (+{r['graphs_after_warmup']}) | {r['graph_breaks']} "
           f"| {r['max_abs_diff_vs_eager_dcache']:.3g} (of {r['output_scale']:.3g}) |")
    return "\n".join([_header(r), "", head, "|---|---:|---:|---:|---:|---:|---:|", row])


def offload_table(r: dict) -> str:
    lines = [_header(r), "", "| method | on device s | offloaded s | slowdown | bit-identical | cache MiB |",
             "|---|---:|---:|---:|---|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['method']} | {row['on_device_s']:.2f} | {row['offloaded_s']:.2f} | "
                     f"{row['slowdown']:.2f}x | {row['bit_identical']} | {_mib(row['cache_bytes'])} |")
    return "\n".join(lines)


def kernels_table(r: dict) -> str:
    return f"On {r['device']}, `{r['command']}`:\n\n" + "\n".join(r["table"])


TABLES = {"speed": speed_table, "memory": memory_table, "compile": compile_table, "cudagraphs": cudagraphs_table,
          "offload": offload_table, "kernels": kernels_table}


def gpu_part(folder: Path) -> str:
    results = load(folder) if folder.is_dir() else []
    if not results:
        return ("No GPU figures yet: every figure above comes from a CPU. On a machine with an H100 / H200, each part "
                f"is one command under 10 minutes: `{RUN_ALL}`; then `python benchmarks/assemble.py`.")
    order = {part: i for i, part in enumerate(TABLES)}
    results.sort(key=lambda r: (order.get(r["part"], 99), r["model"]))
    sections = [f"### {r['part']}\n\n{TABLES[r['part']](r)}" for r in results]
    reading = folder / "reading.md"  # what the figures say, written by whoever ran them
    if reading.is_file():
        sections.insert(0, reading.read_text().strip())
    return "\n\n".join(sections)
