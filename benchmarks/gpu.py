"""dcache at real scale on a GPU: one command per part, each under 10 minutes on an H100 / H200.

    python benchmarks/gpu.py --part speed --model flux.1-dev       # FLUX.1-dev 1024x1024, 28 steps
    python benchmarks/gpu.py --part speed --model wan2.1-t2v-1.3b   # Wan2.1 1.3B 480p x 81 frames, split CFG 5
    python benchmarks/gpu.py --part speed --model qwen-image        # Qwen-Image 1328x1328, split CFG 4
    python benchmarks/gpu.py --part memory --model flux.1-dev       # peak memory vs handle.memory() vs estimate
    python benchmarks/gpu.py --part kernels                         # cache-path kernels, Triton vs torch, GB/s
    python benchmarks/gpu.py --part compile --model flux.1-dev      # regional torch.compile with dcache
    python benchmarks/gpu.py --part offload --model flux.1-dev      # cache_device="cpu": overlap and exactness
    python benchmarks/gpu.py --part cudagraphs --model flux.1-dev   # whole-model compile, fullgraph, CUDA graphs
    python benchmarks/gpu.py --dry-run                              # every part on tiny configs, on the CPU
    python benchmarks/assemble.py                                   # the JSONs -> a BENCHMARKS.md section

The transformers are built from the configs dcache ships (pipelines/assets/configs; Wan2.1 1.3B is the 14B config
at the 1.3B model's published sizes) with random weights (normal, std 0.02) in bfloat16: no download. Each
generation is a transformer-only loop with the pipeline's call shapes (dcache.pipelines.estimate.model_inputs) and
its CFG branches (each call under `transformer.cache_context(branch)`), a flow-matching Euler update between steps;
the text encoder and the VAE are left out (they cost the same with and without a cache).

Timing: CUDA events around each whole generation; one warm-up generation per variant, then --runs generations per
variant taken in alternation (uncached, cached, uncached, ...) so that clock drift does not bias one side;
medians. measured/ideal = (uncached / cached time) / (1 / compute ratio). Random weights make the dynamic methods'
decisions arbitrary, so the methods here are the cadence-decided ones at compute ratios ~0.5 and ~0.25: their
FLOPs, memory traffic and overheads are those of a trained model.

Each part writes benchmarks/results/gpu/<part>-<model>.json (--out to change) with the device name, torch /
diffusers / triton versions and the exact command; the speed part rewrites it after every method ("complete": false
until the last), so a run stopped at a time limit keeps the rows it finished.

On a machine with a CUDA torch but no dcache environment, install the wheel (`pip wheel --no-deps -w whl .` here,
`pip install --target SITE whl/*.whl` there) and run with `PYTHONPATH=SITE python -P ...`: -P keeps the checkout's
source folders off sys.path, where they would shadow the installed package's layout (benchmarks/gpu_all.sh runs
every check that way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

PARTS = ("speed", "memory", "kernels", "compile", "offload", "cudagraphs")
MODELS = ("flux.1-dev", "wan2.1-t2v-1.3b", "qwen-image")
RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all",
                        help="what to measure (all: every part in turn; a GPU run takes one part per command)")
    parser.add_argument("--model", choices=MODELS, default="flux.1-dev")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's usual)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed generations per variant after one warm-up (default: 3 for FLUX, 2 for the others)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny configs of the same families on the CPU, 8 steps, 1 run: checks the code path")
    parser.add_argument("--out", default=None, help="the JSON to write (default: benchmarks/results/gpu/<part>-"
                                                    "<model>.json; with --dry-run nothing unless given)")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad arguments answer here, before torch loads

# the heavy imports come after that argument check on purpose, hence the E402 exemptions
import torch  # noqa: E402

import dcache  # noqa: E402
from dcache.memory.estimate import estimate  # noqa: E402
from dcache.pipelines.estimate import model_inputs, resolve_model, with_overrides  # noqa: E402

# (label, method, settings, scope): cadence-decided methods at compute ratios ~0.5 and ~0.25 (stack reuse, TaylorSeer's
# forecast, and whole-call reuse).
METHODS = (
    ("fixed_interval N=2", "fixed_interval", {"interval": 2}, "blocks"),
    ("fixed_interval N=4", "fixed_interval", {"interval": 4}, "blocks"),
    ("taylorseer N=4 o1", "taylorseer", {"interval": 4, "order": 1}, "blocks"),
    ("fixed_interval N=4 call", "fixed_interval", {"interval": 4}, "call"),
)
# Wan2.1-T2V-1.3B's published sizes over the shipped 14B config.
WAN_1_3B = {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30}  # width 1536
# Steps and timed runs per variant that keep one part within 10 minutes on an H100 / H200 (the model cards' 50 steps
# for Wan and Qwen-Image would take 2.5x longer; the compute ratios of the cadences barely depend on the count).
STEPS = {"flux.1-dev": 28, "wan2.1-t2v-1.3b": 20, "qwen-image": 20}
RUNS = {"flux.1-dev": 3, "wan2.1-t2v-1.3b": 2, "qwen-image": 2}


# ------------------------------------------------------------------------------------------------ models
def model_spec(name: str, dry_run: bool):
    """(transformer config, Setting) of a benchmark model; --dry-run: the same family at toy size."""
    spec = resolve_model("wan2.1-t2v-14b" if name == "wan2.1-t2v-1.3b" else name)
    config = dict(spec.experts[0][1])
    setting = spec.setting
    if name == "wan2.1-t2v-1.3b":
        config.update(WAN_1_3B)
        setting = with_overrides(setting, height=480, width=832)
    setting = with_overrides(setting, steps=STEPS[name])
    if dry_run:
        config, setting = tiny(config, setting)
    return config, setting


def tiny(config: dict, setting):
    """A toy config of the same class (2 blocks per list, narrow) and a toy resolution."""
    small = dict(config)
    for key in ("num_layers", "num_single_layers"):
        if key in small:
            small[key] = 1 if key == "num_single_layers" else 2
    heads = {"num_attention_heads": 2, "attention_head_dim": 16}
    small.update({k: v for k, v in heads.items() if k in small})
    for key, value in (("ffn_dim", 64), ("text_dim", 32), ("freq_dim", 32)):  # Wan
        if key in small:
            small[key] = value
    for key in ("joint_attention_dim", "pooled_projection_dim"):
        if key in small:
            small[key] = 32
    if "axes_dims_rope" in small:
        small["axes_dims_rope"] = [4, 6, 6]
    t_scale, s_scale = setting.vae_scale
    size = s_scale * setting.pack * 2
    setting = with_overrides(setting, height=size, width=size, steps=8, text_tokens=4,
                             frames=t_scale + 1 if setting.frames > 1 else 1)
    return small, setting


def build_transformer(config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Built on `device` in `dtype` (no CPU copy; buffers such as RoPE tables computed as the class computes them),
    matrices re-drawn from a normal with std 0.02 so activations stay in range through every block."""
    import diffusers

    cls = getattr(diffusers, config["_class_name"])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    finally:
        torch.set_default_dtype(default)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def real_inputs(config: dict, setting, device: torch.device, dtype: torch.dtype) -> tuple[dict, tuple]:
    """One call's kwargs (random real tensors of the pipeline's shapes) and the step's branch names."""
    branches, batch = setting.branches(1)
    meta = model_inputs(config, setting, batch, dtype)
    generator = torch.Generator(device=device).manual_seed(1)

    def real(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.dtype in (torch.long, torch.int32, torch.bool):
            return torch.ones(x.shape, dtype=x.dtype, device=device)
        if x.device.type != "meta":
            return x.to(device)
        return torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32).to(x.dtype)

    return {k: real(v) for k, v in meta.items()}, branches


# ------------------------------------------------------------------------------------------------ generation
class Clock:
    """Wall-clock of a block of GPU work: CUDA events (one sync at the end), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0
        return False


def generate(transformer, inputs: dict, branches: tuple, steps: int) -> torch.Tensor:
    """A flow-matching Euler loop: x <- x + (sigma_{i+1} - sigma_i) v, v from the CFG-combined branches."""
    x = inputs["hidden_states"].clone()
    sigmas = torch.linspace(1.0, 0.0, steps + 1, device=x.device)
    batch = x.shape[0]
    with torch.no_grad():
        for i in range(steps):
            t = (sigmas[i] * 1000).expand(batch).to(x.dtype)
            outs = []
            for branch in branches:
                with transformer.cache_context(branch):
                    out = transformer(**{**inputs, "hidden_states": x, "timestep": t})
                outs.append(out[0] if isinstance(out, tuple) else out.sample)
            v = outs[0] if len(outs) == 1 else outs[1] + 5.0 * (outs[0] - outs[1])
            x = x + (sigmas[i + 1] - sigmas[i]) * v.to(x.dtype)
    return x


def time_variants(variants: dict, run, device: torch.device, runs: int) -> dict[str, list[float]]:
    """{name: seconds per run} of `run()` inside each variant's context (`variants[name]()` -> a context manager,
    entered outside the timed region): a warm-up of each, then `runs` rounds taking every variant once, in turn."""
    for make in variants.values():
        with make():
            run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, make in variants.items():
            with make():
                with Clock(device) as clock:
                    run()
            times[name].append(clock.seconds)
    return times


class Applied:
    """dcache applied for the duration of a `with` (a fresh handle each time); the last handle's stats kept."""

    def __init__(self, transformer, method: str, steps: int, scope: str, **settings):
        self.args = (transformer, method)
        self.kwargs = dict(num_steps=steps, scope=scope, **settings)
        self.handle = None
        self.stats = self.memory = None

    def __call__(self) -> "Applied":
        return self

    def __enter__(self):
        self.handle = dcache.apply(*self.args, **self.kwargs)
        return self.handle

    def __exit__(self, *exc):
        self.stats, self.memory = self.handle.stats(), self.handle.memory()
        self.handle.remove()
        return False


# ------------------------------------------------------------------------------------------------ parts
def part_speed(ctx: dict) -> dict:
    """Uncached vs cached wall-clock per method; measured / ideal speed-up."""
    transformer, steps = ctx["transformer"], ctx["steps"]
    rows = []
    for label, method, settings, scope in METHODS:
        cached = Applied(transformer, method, steps, scope, **settings)
        times = time_variants({"uncached": contextlib.nullcontext, "cached": cached}, ctx["run"], ctx["device"],
                              ctx["runs"])
        stats = cached.stats
        base, fast = statistics.median(times["uncached"]), statistics.median(times["cached"])
        measured = base / fast
        rows.append({"method": label, "scope": scope, "compute_ratio": stats.compute_ratio,
                     "ideal_speedup": stats.ideal_speedup, "uncached_s": base, "cached_s": fast,
                     "measured_speedup": measured, "measured_over_ideal": measured / stats.ideal_speedup,
                     "runs": times})
        print(f"  {label:26s} ratio {stats.compute_ratio:.3f}  {base:.3f}s -> {fast:.3f}s  "
              f"{measured:.2f}x of ideal {stats.ideal_speedup:.2f}x", flush=True)
        ctx["save"]({"rows": rows, "complete": False})  # a run stopped at its time limit keeps its finished rows
    return {"rows": rows}


def part_memory(ctx: dict) -> dict:
    """Peak device memory of a cached generation over the uncached one vs handle.memory() vs dcache.memory.estimate."""
    transformer, inputs, branches, steps, device = (ctx[k] for k in ("transformer", "inputs", "branches", "steps",
                                                                     "device"))
    cuda = device.type == "cuda"

    def peak() -> int | None:
        if not cuda:
            ctx["run"]()
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        ctx["run"]()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - before

    uncached = peak()
    rows = []
    for label, method, settings, scope in METHODS:
        est = estimate(transformer, method, inputs, branches=branches, num_steps=steps, scope=scope,
                       memory_only=True, **settings)
        applied = Applied(transformer, method, steps, scope, **settings)
        with applied:
            cached = peak()
        measured = None if uncached is None else cached - uncached
        reported = applied.memory.peak_bytes
        rows.append({"method": label, "scope": scope, "measured_extra_bytes": measured,
                     "handle_memory_bytes": reported, "estimate_bytes": est.memory.peak_bytes})
        print(f"  {label:26s} measured +{_mib(measured)}  handle.memory() {_mib(reported)}  "
              f"estimate {_mib(est.memory.peak_bytes)}", flush=True)
    return {"uncached_peak_bytes": uncached, "rows": rows}


def part_kernels(ctx: dict) -> dict:
    """benchmarks/kernels.py's table on this device (Triton vs torch, GB/s vs the HBM bandwidth)."""
    kernels = _load_script("kernels")
    device = ctx["device"]
    scale = 64 if ctx["dry_run"] else (1 if device.type == "cuda" else 16)
    rows = kernels.run(device, "bf16" if device.type == "cuda" else "fp32", kernels.peak_gbps(device, None),
                       5 if ctx["dry_run"] else 100, scale)
    return {"table": rows, "scale": scale}


def part_compile(ctx: dict) -> dict:
    """Regional compile (diffusers' compile_repeated_blocks) with and without dcache: speed-up on top of compile,
    graphs, graph breaks and recompiles."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    transformer, device = ctx["transformer"], ctx["device"]
    backend = "eager" if ctx["dry_run"] else "inductor"
    label, method, settings, scope = METHODS[1]
    torch._dynamo.reset()
    counters.clear()
    eager = time_variants({"eager": contextlib.nullcontext}, ctx["run"], device, ctx["runs"])["eager"]
    transformer.compile_repeated_blocks(backend=backend)  # dcache's hook frames stay eager: see graph_breaks
    cached = Applied(transformer, method, ctx["steps"], scope, **settings)
    times = time_variants({"uncached": contextlib.nullcontext, "cached": cached}, ctx["run"], device, ctx["runs"])
    out = {"backend": backend, "method": label, "eager_uncached_s": statistics.median(eager),
           "compiled_uncached_s": statistics.median(times["uncached"]),
           "compiled_cached_s": statistics.median(times["cached"]), "compute_ratio": cached.stats.compute_ratio,
           "unique_graphs": int(counters["stats"]["unique_graphs"]),
           "graph_breaks": int(sum(counters["graph_break"].values())),
           "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0}
    out["speedup_on_top_of_compile"] = out["compiled_uncached_s"] / out["compiled_cached_s"]
    print(f"  eager {out['eager_uncached_s']:.3f}s, compiled {out['compiled_uncached_s']:.3f}s, compiled + {label} "
          f"{out['compiled_cached_s']:.3f}s ({out['speedup_on_top_of_compile']:.2f}x on top of compile); "
          f"{out['unique_graphs']} graphs, {out['graph_breaks']} graph breaks", flush=True)
    torch._dynamo.reset()
    return out


def part_offload(ctx: dict) -> dict:
    """cache_device="cpu" (host cache, the next unit prefetched on a side stream) vs the on-device cache."""
    transformer, device = ctx["transformer"], ctx["device"]
    rows = []
    for label, method, settings, scope in (METHODS[1], METHODS[2]):
        variants = {where: Applied(transformer, method, ctx["steps"], scope, cache_device=where, **settings)
                    for where in ("device", "cpu")}
        variants["device"].kwargs.pop("cache_device")
        times = time_variants(variants, ctx["run"], device, ctx["runs"])
        outputs = {}
        for where, applied in variants.items():
            with applied:
                outputs[where] = ctx["run"]().float()
        same = torch.equal(torch.nan_to_num(outputs["device"]), torch.nan_to_num(outputs["cpu"]))
        on, off = statistics.median(times["device"]), statistics.median(times["cpu"])
        rows.append({"method": label, "on_device_s": on, "offloaded_s": off, "slowdown": off / on,
                     "bit_identical": same, "cache_bytes": variants["cpu"].memory.peak_bytes})
        print(f"  {label:26s} on device {on:.3f}s, offloaded {off:.3f}s ({off / on:.2f}x), "
              f"bit-identical {same}", flush=True)
    return {"rows": rows}


def part_cudagraphs(ctx: dict) -> dict:
    """The whole transformer compiled with fullgraph=True under a step-decided schedule in block scope (the decisions
    trace: no graph break), mode="reduce-overhead" on CUDA (CUDA graphs; the eager backend with --dry-run): speed-up
    on top of the same compile, graphs, recompiles after the warm-up, and agreement with eager dcache.

    Timed in two blocks (compiled uncached, then compiled with one dcache handle kept for every run) rather than in
    alternation: a fresh handle installs new hook objects, which dynamo's guards see as a new function (a recompile
    per apply), so one handle serves the warm-up and the timed generations, as it would in a server."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    transformer, device, run, runs = ctx["transformer"], ctx["device"], ctx["run"], ctx["runs"]
    cuda = device.type == "cuda" and not ctx["dry_run"]
    backend, mode = ("inductor", "reduce-overhead") if cuda else ("eager", None)
    label, method, settings, scope = METHODS[1]
    with Applied(transformer, method, ctx["steps"], scope, **settings):
        reference = run().float()
    torch._dynamo.reset()
    counters.clear()
    transformer.compile(backend=backend, mode=mode, fullgraph=True)  # a graph break raises: none is allowed

    def timed(count: int) -> list[float]:
        seconds = []
        for _ in range(count):
            with Clock(device) as clock:
                run()
            seconds.append(clock.seconds)
        return seconds

    timed(1)  # warm-up: compiles the uncached graph
    uncached = timed(runs)
    handle = dcache.apply(transformer, method, num_steps=ctx["steps"], scope=scope, **settings)
    try:
        timed(1)  # warm-up: compiles one graph per distinct action row
        warm_graphs = int(counters["stats"]["unique_graphs"])
        cached = timed(runs)
        output = run().float()
        ratio = handle.stats().compute_ratio
    finally:
        handle.remove()
    scale = float(reference.abs().max())
    out = {"backend": backend, "mode": mode, "method": label, "scope": scope, "compute_ratio": ratio,
           "compiled_uncached_s": statistics.median(uncached), "compiled_cached_s": statistics.median(cached),
           "runs": {"uncached": uncached, "cached": cached}, "unique_graphs": warm_graphs,
           "graphs_after_warmup": int(counters["stats"]["unique_graphs"]) - warm_graphs,
           "graph_breaks": int(sum(counters["graph_break"].values())),
           "max_abs_diff_vs_eager_dcache": float((output - reference).abs().max()), "output_scale": scale}
    out["speedup_on_top_of_compile"] = out["compiled_uncached_s"] / out["compiled_cached_s"]
    print(f"  {backend}/{mode}: compiled {out['compiled_uncached_s']:.3f}s, compiled + {label} "
          f"{out['compiled_cached_s']:.3f}s ({out['speedup_on_top_of_compile']:.2f}x on top of compile); "
          f"{warm_graphs} graphs (+{out['graphs_after_warmup']} after the warm-up), {out['graph_breaks']} graph "
          f"breaks; max |out - eager dcache| {out['max_abs_diff_vs_eager_dcache']:.3g} of {scale:.3g}", flush=True)
    torch._dynamo.reset()
    return out


PART_FUNCTIONS = {"speed": part_speed, "memory": part_memory, "kernels": part_kernels, "compile": part_compile,
                  "offload": part_offload, "cudagraphs": part_cudagraphs}


# ------------------------------------------------------------------------------------------------ helpers
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _load_script(name: str):
    import importlib.util

    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def environment(device: torch.device) -> dict:
    import diffusers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {"device": name, "torch": torch.__version__, "diffusers": diffusers.__version__, "triton": triton_version,
            "dcache": dcache.__version__}


def save(path: Path, data) -> None:
    """Write one JSON atomically (a reader never sees half a file)."""
    from dcache.files.atomic import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def output_path(args: argparse.Namespace) -> Path | None:
    """--out, else benchmarks/results/gpu/<part>-<model>.json; a dry run writes only where --out says."""
    return Path(args.out) if args.out else None if args.dry_run else RESULTS / f"{args.part}-{args.model}.json"


def run_part(part: str, args: argparse.Namespace, device: torch.device, out: Path | None = None) -> dict:
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    config, setting = model_spec(args.model, args.dry_run)
    steps = args.steps or setting.steps
    runs = 1 if args.dry_run else args.runs or RUNS[args.model]
    ctx = {"device": device, "dry_run": args.dry_run, "runs": runs, "steps": steps}
    result = {"part": part, "model": args.model, "dry_run": args.dry_run, **environment(device),
              "command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:]), "runs": runs,
              "setting": {"height": setting.height, "width": setting.width, "frames": setting.frames, "steps": steps,
                          "cfg": setting.cfg, "guidance": setting.guidance, "dtype": str(dtype)}}
    print(f"[{part}] {args.model} on {result['device']}: {setting.height}x{setting.width}x{setting.frames}, "
          f"{steps} steps, cfg {setting.cfg}", flush=True)
    if part != "kernels":
        transformer = ctx["transformer"] = build_transformer(config, device, dtype)
        inputs, branches = ctx["inputs"], ctx["branches"] = real_inputs(config, setting, device, dtype)
        ctx["run"] = lambda: generate(transformer, inputs, branches, steps)
        result["parameters"] = sum(p.numel() for p in transformer.parameters())
    ctx["save"] = lambda partial: save(out, {**result, **partial}) if out is not None else None
    result.update(PART_FUNCTIONS[part](ctx))
    result["complete"] = True
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)
        if not args.dry_run:
            print("no CUDA device: running the real-size models on the CPU would take hours; use --dry-run for a "
                  "check of the code path, or run this on a GPU machine.", file=sys.stderr)
            raise SystemExit(2)
    parts = PARTS if args.part == "all" else (args.part,)
    out = output_path(args)
    results = [run_part(part, args, device, out if len(parts) == 1 else None) for part in parts]
    if out is not None:
        save(out, results if len(results) > 1 else results[0])
        print(f"wrote {out}", flush=True)
    return results


if __name__ == "__main__":
    main()
