"""Assemble BENCHMARKS.md from the result files each benchmark writes (each section keeps its own command)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SECTIONS = [
    ("Methods vs diffusers' caches and cache-dit (tiny model, CPU)", RESULTS / "methods.md"),
    ("`dcache eval` report (tiny model, CPU)", RESULTS / "eval_tiny"),
    ("Cache-path overhead and the achievable speed-up (tiny model, batch 1, CPU)", RESULTS / "overhead.md"),
    ("Plan search vs dynamic schedules (tiny model, CPU)", RESULTS / "search.md"),
    ("Kernels (CPU torch path; GPU figures pending)", RESULTS / "kernels_cpu.md"),
]


def eval_section(folder: Path, script: str = "benchmarks/eval_tiny.sh") -> str:
    """The main table of a `dcache eval` report folder, with the command that produced it, a link to the rest and
    the folder's hand-written notes.md (what the numbers say) if there is one."""
    results = json.loads((folder / "results.json").read_text())
    report = (folder / "report.md").read_text()
    table = report.split("## Results", 1)[1].split("\n## ", 1)[0].strip()
    facts = [line for line in report.splitlines() if line.startswith("- **")]
    rel = folder.relative_to(ROOT)
    env = results["environment"]
    return "\n".join([
        "```", f"bash {script}   # makes the plans it evaluates, then runs:", results["command"], "```",
        "", *facts, "",
        table, "",
        f"Produced by `dcache eval` itself: the table is copied from [{rel}/report.md]({rel}/report.md) (the full "
        f"report, also as [report.html]({rel}/report.html); every number in [results.json]({rel}/results.json)). "
        f"Wall-clock columns are noisy here: {env['num_processes']} process on a 2-core machine shared with other "
        f"jobs; the CPU-time speed-up (process CPU seconds) and the compute ratio (block FLOPs) are the stable ones.",
        "", f"![speed-up vs quality]({rel}/pareto.png)", "",
        *([(folder / "notes.md").read_text().strip(), ""] if (folder / "notes.md").is_file() else []),
    ])

HEADER = """# Benchmarks

Every table below was produced by the command printed at its top; rerun it to refresh the section, then
`python benchmarks/assemble.py` to rebuild this file. No GPU was lent to the session that wrote these figures:
all numbers are from the 2-core CPU machine, shared with other jobs (wall-clock speed-ups there are noisy; the
methods table also reports CPU-time and FLOP-ratio columns). The Triton kernels have been verified on CPU under
`TRITON_INTERPRET=1` only; their GPU bandwidth table (`python benchmarks/kernels.py --device cuda`) is still to be
recorded on an H100/H200.
"""


def main() -> None:
    parts = [HEADER]
    for title, path in SECTIONS:
        if path.is_dir() and (path / "results.json").is_file():
            body = eval_section(path)
        elif path.is_file():
            body = path.read_text().strip()
        else:
            body = f"_not run yet: {path.relative_to(ROOT)} is missing_"
        lines = body.splitlines()
        if lines and lines[0].startswith("# "):  # demote the file's own title
            lines = lines[1:]
        parts.append(f"## {title}\n\n" + "\n".join(lines).strip() + "\n")
    (ROOT / "BENCHMARKS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
