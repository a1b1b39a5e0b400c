"""What per-sample decisions cost (dcache.lanes): the same batch with decisions="sample" and decisions="batch".

With per-sample decisions a batched call of a schedule that reads signals runs each row as its own batch-1 call
(its rows gathered from every batched argument, the outputs scattered back into one batch). At a setting where every
row computes every step (threshold 0: both modes take identical decisions and compute everything), the difference

    cost per call = T(sample) - T(batch)      (per batched transformer call)

is the whole price of per-sample decisions: the row split and concatenation plus the batching the rows lose. The
split and concatenation alone (`split_row` for every row + `concat_rows`, no model) is timed separately. Timings are
thread CPU time on CPU (wall time on CUDA, synchronised), rounds interleave the two modes, each figure a median.

    python benchmarks/per_sample.py                        # bundled tiny model, CPU, 1 thread
    python benchmarks/per_sample.py --device cuda --batches 1,4,16
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

METHOD, KNOBS = "teacache", {"threshold": 0.0}  # reads a signal every call (per-sample lanes), reuses nothing


def _clock(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.thread_time()


def _generation(pipe, batch: int, steps: int, device: str) -> float:
    import torch

    labels = [i % 10 for i in range(batch)]
    latents = torch.randn((batch, *pipe.sample_shape()), generator=torch.Generator().manual_seed(0)).to(device)
    start = _clock(device)
    pipe(labels=labels, num_inference_steps=steps, latents=latents, output_type="pt")
    return _clock(device) - start


def _split_concat(pipe, batch: int, device: str, repeats: int = 200) -> float:
    """Seconds per batched call for the split of its arguments into rows and the concatenation of the outputs."""
    import torch

    from dcache.lanes import concat_rows, split_row

    x = torch.randn(batch, 64, 4, device=device)
    kwargs = dict(hidden_states=x, encoder_hidden_states=torch.randn(batch, 4, 32, device=device),
                  pooled_projections=None, timestep=torch.rand(batch, device=device),
                  img_ids=torch.zeros(64, 3, device=device), txt_ids=torch.zeros(4, 3, device=device),
                  return_dict=False)
    start = _clock(device)
    for _ in range(repeats):
        outs = [(split_row((), kwargs, batch, row)[1]["hidden_states"],) for row in range(batch)]
        concat_rows(outs)
    return (_clock(device) - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = ap.parse_args()
    import torch  # after --help: the scripts answer it before torch loads

    import dcache
    from dcache.health import DCacheHealthWarning
    from dcache.pipelines.bundled import load_tiny_pipeline

    if args.device == "cpu":
        torch.set_num_threads(1)
    pipe = load_tiny_pipeline(device=args.device)
    warnings.simplefilter("ignore", DCacheHealthWarning)  # threshold 0 reuses nothing on purpose
    calls_per_generation = 2 * args.steps  # split CFG: cond + uncond per step
    lines = [f"Bundled tiny model, {args.steps} steps, split CFG, {METHOD} {KNOBS} (every row computes every step), "
             f"device {args.device}" + (", 1 thread, thread CPU time" if args.device == "cpu" else ", wall time")
             + f"; median of {args.rounds} interleaved rounds; torch {torch.__version__}.", "",
             "| batch | decisions='batch' ms/call | decisions='sample' ms/call | per-sample cost ms/call | "
             "split + concat alone ms/call |", "|---|---|---|---|---|"]
    for batch in [int(b) for b in args.batches.split(",")]:
        times = {"batch": [], "sample": []}
        for _ in range(args.rounds):
            for mode in times:
                with dcache.apply(pipe, METHOD, decisions=mode, **KNOBS):
                    _generation(pipe, batch, 2, args.device)  # warm-up (first shapes, FLOP counting)
                    times[mode].append(_generation(pipe, batch, args.steps, args.device) / calls_per_generation)
        per = {mode: 1e3 * statistics.median(t) for mode, t in times.items()}
        split = 1e3 * _split_concat(pipe, batch, args.device)
        lines.append(f"| {batch} | {per['batch']:.2f} | {per['sample']:.2f} | {per['sample'] - per['batch']:+.2f} "
                     f"| {split:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
