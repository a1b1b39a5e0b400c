"""Speed of the fused cache-path kernels against the unfused torch composition.

    python benchmarks/kernels.py                                   # CUDA if present, else a CPU smoke run
    python benchmarks/kernels.py --device cuda --dtype bf16 --out BENCHMARKS-kernels.md
    python benchmarks/kernels.py --device cuda --peak-gbps 3350    # when the GPU name is not recognised

For each op at FLUX.1 1024² shapes (B=1, 512 text + 4096 image tokens, D=3072) and Wan2.1-1.3B
480p shapes (B=1 per CFG branch, 32760 tokens, D=1536) it times the public function on the Triton
backend and on the torch backend (the `<op>_reference` composition), both with the same fp32 math,
and reports:
    MB moved       the bytes the op must read and write at least (each input read once, each output
                   written once); the same count is used for both backends
    µs             median time: triton.testing.do_bench on CUDA (CUDA events, L2 flushed between runs),
                   time.perf_counter on CPU
    GB/s, % peak   achieved bandwidth = bytes moved / time, against the GPU's peak memory bandwidth
                   (--peak-gbps, or looked up from the device name: H100 SXM 3350, H200 4800, ...)
    speed-up       torch time / Triton time
    max |Δ|        largest difference between the two backends' outputs (a sanity check, not a test)
On CPU only the torch backend runs, single-threaded, on 16x fewer tokens (--scale), so that the script
can be smoke-tested anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

DTYPE_NAMES = ("fp32", "bf16", "fp16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPE_NAMES))
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth of the GPU, GB/s")
    parser.add_argument("--reps", type=int, default=100, help="do_bench time budget in ms (CUDA) / 10x repeats (CPU)")
    parser.add_argument("--scale", type=int, default=None,
                        help="divide the token counts by this (default: 1 on CUDA, 16 on CPU)")
    parser.add_argument("--out", default=None, help="also write the table, with the command, to this Markdown file "
                                                    "(default: print only)")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch loads

# the heavy imports come after that argument check on purpose, hence the E402 exemptions
import torch  # noqa: E402

import dcache.kernels as K  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Peak DRAM bandwidth in GB/s by (lower-case) device-name fragment, most specific first.
PEAK_GBPS = [
    ("h200", 4800.0),
    ("h100 pcie", 2000.0),
    ("h100 nvl", 3900.0),
    ("h100", 3350.0),
    ("h800", 3350.0),
    ("a100-sxm4-80gb", 2039.0),
    ("a100 80gb pcie", 1935.0),
    ("a100", 1555.0),
    ("l40s", 864.0),
    ("l4", 300.0),
    ("b200", 8000.0),
]


@dataclass
class Shapes:
    """One model's stream: `text` prefix tokens, `image` tokens, hidden size `dim`, batch `batch`."""

    name: str
    batch: int
    text: int
    image: int
    dim: int

    def scaled(self, factor: int) -> "Shapes":
        return Shapes(f"{self.name} /{factor}", self.batch, self.text // factor, self.image // factor, self.dim)


MODELS = [
    Shapes("FLUX.1 1024²", batch=1, text=512, image=4096, dim=3072),
    Shapes("Wan2.1-1.3B 480p", batch=1, text=0, image=32760, dim=1536),
]


@dataclass
class Case:
    """One benchmark row: `setup()` makes fresh inputs and returns the call to time."""

    op: str
    shape: str
    bytes_moved: int
    setup: Callable[[], Callable[[], object]]


def cases(m: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    e = torch.tensor([], dtype=dtype).element_size()
    B, T, L, D = m.batch, m.text, m.image, m.dim
    full, img = B * (T + L) * D, B * L * D  # elements of the joint stream and of the image stream
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    def residual_apply_in_place():
        hidden, residual = rand(B, T + L, D), rand(B, L, D)
        return lambda: K.residual_apply(hidden, residual, out=hidden)

    def residual_apply_new():
        hidden, residual = rand(B, T + L, D), rand(B, L, D)
        return lambda: K.residual_apply(hidden, residual)

    def residual_capture():
        out, inp, cache = rand(B, L, D), rand(B, L, D), rand(B, L, D)
        return lambda: K.residual_capture(out, inp, prev=cache, buffer=cache)

    def rel_l1_stats():
        a, b = rand(B, L, D), rand(B, L, D)
        return lambda: K.rel_l1_stats(a, b)

    def taylor_update(order):
        table, new = rand(order + 1, B, L, D, dt=torch.float32), rand(B, L, D)
        return lambda: K.taylor_update(table, new, 1, order + 1)  # a full table: every derivative refreshed

    def taylor_forecast(order):
        table, out = rand(order + 1, B, L, D, dt=torch.float32), rand(B, L, D)
        return lambda: K.taylor_forecast(table, 2.0, order + 1, out=out)

    def axpy(alpha_on_device):
        y, x = rand(B, L, D), rand(B, L, D)
        alpha = torch.tensor(0.37, device=device) if alpha_on_device else 0.37
        return lambda: K.axpy(y, x, alpha, out=y)

    tail = f"[{B}, {T}+{L}, {D}]" if T else f"[{B}, {L}, {D}]"
    image = f"[{B}, {L}, {D}]"
    return [
        Case("residual_apply (in place)", tail, 3 * img * e, residual_apply_in_place),
        Case("residual_apply (new out)", tail, (2 * full + img) * e, residual_apply_new),
        Case("residual_capture (prev, buffer=prev)", image, 4 * img * e, residual_capture),
        Case("rel_l1_stats", image, 2 * img * e, rel_l1_stats),
        # fp32 table: read new + K old entries, write K + 1 entries
        Case("taylor_update K=1 (fp32 table)", image, img * (e + 4 * 1 + 4 * 2), lambda: taylor_update(1)),
        Case("taylor_update K=2 (fp32 table)", image, img * (e + 4 * 2 + 4 * 3), lambda: taylor_update(2)),
        Case("taylor_forecast K=2 (fp32 table)", image, img * (3 * 4 + e), lambda: taylor_forecast(2)),
        Case("axpy (python alpha, in place)", image, 3 * img * e, lambda: axpy(False)),
        Case("axpy (tensor alpha, in place)", image, 3 * img * e, lambda: axpy(True)),
    ]


def time_us(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median microseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median")
    for _ in range(3):
        fn()
    times = []
    for _ in range(max(5, reps // 10)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def first_tensor(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def max_diff(case: Case) -> float | None:
    """Largest |triton - torch| over the op's output, each on fresh identical inputs."""
    with K.use_backend("triton"):
        got = case.setup()()
    with K.use_backend("torch"):
        want = case.setup()()
    if isinstance(got, int):  # taylor_update returns `filled`; the output is the table it updated
        return None
    return (first_tensor(got).float() - first_tensor(want).float()).abs().max().item()


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((gbps for fragment, gbps in PEAK_GBPS if fragment in name), None)


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def run(device: torch.device, dtype_name: str, peak: float | None, reps: int, scale: int) -> list[str]:
    dtype = DTYPES[dtype_name]
    with_triton = device.type == "cuda" and K.triton_available(torch.empty(0, device=device))
    models = [m.scaled(scale) if scale > 1 else m for m in MODELS]
    rows = [
        "| kernel | shape | dtype | MB moved | Triton µs | Triton GB/s | % peak | torch µs | torch GB/s "
        "| % peak | speed-up | max abs Δ |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(rows), flush=True)
    for model in models:
        for case in cases(model, dtype, device):
            with K.use_backend("torch"):
                torch_us = time_us(case.setup(), device, reps)
            triton_us = diff = None
            if with_triton:
                with K.use_backend("triton"):
                    triton_us = time_us(case.setup(), device, reps)
                diff = max_diff(case)
            gbps = {k: case.bytes_moved / (us * 1e3) if us else None for k, us in
                    (("triton", triton_us), ("torch", torch_us))}
            pct = {k: 100 * v / peak if v and peak else None for k, v in gbps.items()}
            rows.append(
                f"| {case.op} | {model.name} {case.shape} | {dtype_name} | {case.bytes_moved / 1e6:.1f} "
                f"| {fmt(triton_us, '.1f')} | {fmt(gbps['triton'], '.3g')} | {fmt(pct['triton'], '.0f')} "
                f"| {torch_us:.1f} | {gbps['torch']:.3g} | {fmt(pct['torch'], '.0f')} "
                f"| {fmt(torch_us / triton_us if triton_us else None, '.2f')} | {fmt(diff, '.2g')} |"
            )
            print(rows[-1], flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a smoke run: one thread keeps it steady on a shared machine
    peak = peak_gbps(device, args.peak_gbps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (torch backend only)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    header = [
        f"## Kernel benchmark: {name}",
        "",
        f"`python benchmarks/kernels.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
        f"{datetime.date.today()}, torch {torch.__version__}, triton {triton_version}, "
        f"peak bandwidth {fmt(peak, '.0f')} GB/s",
        "",
    ]
    print("\n".join(header), flush=True)
    scale = args.scale or (1 if device.type == "cuda" else 16)
    rows = run(device, args.dtype, peak, args.reps, scale)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(header + rows) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
