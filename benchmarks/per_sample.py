"""What per-sample decisions cost (dcache.runtime.lanes): the same batch with decisions="sample" and decisions="batch".

With per-sample decisions a batched call of a schedule that reads signals first runs each row up to its decision at
batch 1 (the embedders; a probe block for FBCache-style methods), then runs the rows that decided alike as one call
on their stacked caches. At a setting where every row computes every step (threshold 0: both modes take identical
decisions and compute everything, so every call runs whole), the difference

    cost per call = T(sample) - T(batch)      (per batched transformer call)

is the price of the decision step. Where rows decide differently they run as two sub-batches; what that adds besides
the model (gathering each group's rows from every batched argument, stacking the lanes' caches and cutting them back,
scattering the outputs into one batch: `take_rows`, `merge_branches`, `split_branch`, `output_row`, `concat_rows`)
is timed separately on the model's cache shapes. Timings are thread CPU time on CPU (wall time on CUDA,
synchronised), rounds interleave the two modes, each figure a median.

    python benchmarks/per_sample.py                        # bundled tiny model, CPU, 1 thread
    python benchmarks/per_sample.py --device cuda --batches 1,4,16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

# threshold 0: each reads a signal every call (per-sample lanes) and reuses nothing. TeaCache reads the modulated
# input (the embedders only); FBCache runs a probe block first (its output is the signal), which per-sample
# decisions run once per row at batch 1 and, when every row computes, once more in the whole-batch call.
METHODS = {"teacache": {"threshold": 0.0}, "fbcache": {"threshold": 0.0}}


def _clock(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.thread_time()


def _load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages (as `uptime` prints them): timings on a shared CPU."""
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def _generation(pipe, batch: int, steps: int, device: str) -> float:
    import torch

    labels = [i % 10 for i in range(batch)]
    latents = torch.randn((batch, *pipe.sample_shape()), generator=torch.Generator().manual_seed(0)).to(device)
    start = _clock(device)
    pipe(labels=labels, num_inference_steps=steps, latents=latents, output_type="pt")
    return _clock(device) - start


def _gather_scatter(pipe, batch: int, device: str, repeats: int = 200) -> float:
    """Seconds per batched call for what two sub-batches add besides the model: rows [0, batch/2) compute and the
    others are served (a stack cache per row: the hidden and text residuals [1, 64, D], [1, 4, D]); each group's
    arguments gathered, its lanes' caches stacked and cut back after a store, its outputs scattered into one batch."""
    import torch

    from dcache.runtime.lane_merge import merge_branches, split_branch
    from dcache.runtime.lanes import concat_rows, output_row, take_rows
    from dcache.runtime.cache_state import BranchState

    width = pipe.transformer.x_embedder.out_features
    x = torch.randn(batch, 64, 4, device=device)
    kwargs = dict(hidden_states=x, encoder_hidden_states=torch.randn(batch, 4, 32, device=device),
                  pooled_projections=torch.randn(batch, 64, device=device), timestep=torch.rand(batch, device=device),
                  img_ids=torch.zeros(64, 3, device=device), txt_ids=torch.zeros(4, 3, device=device),
                  return_dict=False)
    lanes = []
    for _ in range(batch):
        state = BranchState()
        state.history(("seg", 0), 0).update([torch.randn(1, 64, width, device=device),
                                             torch.randn(1, 4, width, device=device)], 0)
        lanes.append(state)
    groups = [list(range(batch // 2)), list(range(batch // 2, batch))] if batch > 1 else [[0]]
    start = _clock(device)
    for _ in range(repeats):
        outs: list = [None] * batch
        for group, computes in zip(groups, (True, False)):
            sub = take_rows((), kwargs, batch, group)[1]
            merged, before = merge_branches([lanes[r] for r in group], computes)
            if computes:  # the call stores a new residual for the group
                merged.history(("seg", 0), 0).update([torch.zeros(len(group), 64, width, device=device),
                                                      torch.zeros(len(group), 4, width, device=device)], 1)
            split_branch(merged, before, [lanes[r] for r in group])
            for j, row in enumerate(group):
                outs[row] = output_row((sub["hidden_states"],), j, len(group))
        concat_rows(outs)
    return (_clock(device) - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {sorted(METHODS)}")
    ap.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = ap.parse_args()
    import torch  # after --help: the scripts answer it before torch loads

    import dcache
    from dcache.generations.health import DCacheHealthWarning
    from dcache.pipelines.bundled import load_tiny_pipeline

    if args.device == "cpu":
        torch.set_num_threads(1)
    pipe = load_tiny_pipeline(device=args.device)
    warnings.simplefilter("ignore", DCacheHealthWarning)  # threshold 0 reuses nothing on purpose
    calls_per_generation = 2 * args.steps  # split CFG: cond + uncond per step
    load_start = _load_average()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: {unknown} not among {sorted(METHODS)}")
    settings = ", ".join(f"{m} {METHODS[m]}" for m in methods)
    lines = [f"Bundled tiny model (8 blocks), {args.steps} steps, split CFG, {settings} (every row computes every "
             f"step), device {args.device}" + (", 1 thread, thread CPU time" if args.device == "cpu" else
                                               ", wall time")
             + f"; median of {args.rounds} interleaved rounds; torch {torch.__version__}; load average LOAD.", "",
             "| method | batch | decisions='batch' ms/call | decisions='sample' ms/call | per-sample cost ms/call | "
             "two sub-batches: gather + cache stacking + scatter alone ms/call |", "|---|---|---|---|---|---|"]
    batches = [int(b) for b in args.batches.split(",")]
    split = {batch: 1e3 * _gather_scatter(pipe, batch, args.device) for batch in batches}  # the model's shapes only
    for method in methods:
        for batch in batches:
            times = {"batch": [], "sample": []}
            for _ in range(args.rounds):
                for mode in times:
                    with dcache.apply(pipe, method, decisions=mode, **METHODS[method]):
                        _generation(pipe, batch, 2, args.device)  # warm-up (first shapes, FLOP counting)
                        times[mode].append(_generation(pipe, batch, args.steps, args.device) / calls_per_generation)
            per = {mode: 1e3 * statistics.median(t) for mode, t in times.items()}
            cost = per["sample"] - per["batch"]
            lines.append(f"| {method} | {batch} | {per['batch']:.2f} | {per['sample']:.2f} | {cost:+.2f} "
                         f"({100 * cost / per['batch']:+.0f}%) | {split[batch]:.3f} |")
    load = f"{load_start} at the start, {_load_average()} at the end"
    text = "\n".join(lines).replace("load average LOAD", f"load average {load}") + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
