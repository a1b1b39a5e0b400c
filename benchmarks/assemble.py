"""Assemble BENCHMARKS.md from the result files each benchmark writes (each section keeps its own command)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SECTIONS = [
    ("Methods vs diffusers' caches and cache-dit (tiny model, CPU)", RESULTS / "methods.md"),
    ("Plan search vs dynamic schedules (tiny model, CPU)", RESULTS / "search.md"),
    ("Kernels (CPU torch path; GPU figures pending)", RESULTS / "kernels_cpu.md"),
]

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
        body = path.read_text().strip() if path.is_file() else f"_not run yet: {path.relative_to(ROOT)} is missing_"
        lines = body.splitlines()
        if lines and lines[0].startswith("# "):  # demote the file's own title
            lines = lines[1:]
        parts.append(f"## {title}\n\n" + "\n".join(lines).strip() + "\n")
    (ROOT / "BENCHMARKS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
