"""One rank of the context-parallel check (test_context_parallel.py), started by torch.multiprocessing.

Each rank builds the same CompatPipeline (same seed), turns on diffusers' Ulysses context parallelism over gloo
(2 CPU processes), applies a dcache method, generates, and saves what it saw to `<out>/rank<r>.pt`:
  * the output latents (gathered by diffusers' proj_out hook: every rank holds the full output),
  * the decisions (handle.plan().actions) and the per-call signals of the generation record,
  * what went into and came out of dcache.runtime.parallel.sync_signals (rank-local vs global signal vectors).
Rank 0 also runs each method single-process (no context parallel) as the reference.

diffusers 0.42.1 on a CPU-only machine: `enable_parallelism` stops in `_resolve_parallel_config` at
`rank % torch.accelerator.device_count()` (0 devices) with `ZeroDivisionError: integer modulo by zero`. The CPU is this
process's one device, so the worker reports that count as 1 there; nothing else is changed (`patched` in the result
says whether that was needed). Ring attention stays out: the native backend raises "Native attention does not
support return_lse=True", which ring needs (flash / cuDNN backends, GPU only).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# (method, overrides): thresholds put reuse in every run, with margins of >= 1e-2 between the signals and the
# thresholds (measured single-process), far above the ~1e-7 by which sharded sums differ from unsharded ones
RUNS = [
    ("fbcache", dict(threshold=0.4)),  # PROBE_REL_L1: a [sum, sum] pair (summed over ranks)
    ("easycache", dict(threshold=0.2)),  # INPUT_DELTA, OUTPUT_DELTA, OUTPUT_MEAN ...: means (averaged over ranks)
    ("teacache", dict(coefficients=(0.0, 0.0, 0.0, 1.0, 0.0), threshold=0.1)),  # MODULATED_REL_L1: a pair
]
CALL = dict(labels=[1, 2], num_inference_steps=6, guidance_scale=3.0)  # split CFG: two branches per step


def warm_imports() -> None:
    """Import what the ranks use, in the parent, so that forked ranks start with it."""
    import compat_kit  # noqa: F401
    import diffusers.hooks.context_parallel  # noqa: F401
    import diffusers.models.attention_dispatch  # noqa: F401

    import dcache.schedules  # noqa: F401


def run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a hang (ranks disagreeing on whether to run attention's all-to-all) becomes an error after 60 s
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = _generate(rank)
    except Exception:  # noqa: BLE001 - handed to the test, which fails with it
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _generate(rank: int) -> dict:
    from compat_kit import make_pipeline
    from diffusers import ContextParallelConfig

    import dcache
    import dcache.runtime.signal_meter

    patched = torch.accelerator.device_count() == 0
    if patched:
        torch.accelerator.device_count = lambda: 1  # see the module docstring: the CPU is the one device

    exchanged: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_sync = dcache.runtime.signal_meter.sync_signals

    def recording_sync(flat, tensors, transformer):
        local = flat.clone()
        synced = real_sync(flat, tensors, transformer)
        exchanged.append((local, synced.clone()))
        return synced

    dcache.runtime.signal_meter.sync_signals = recording_sync
    result: dict = {"patched": patched, "runs": {}}
    for method, overrides in RUNS:
        for order in ("cp-then-apply", "apply-then-cp") if method == "fbcache" else ("cp-then-apply",):
            if rank == 0 and order == "cp-then-apply":
                result["runs"][(method, "single")] = _one(make_pipeline(), method, overrides, None, exchanged)
            pipe = make_pipeline()
            cp = ContextParallelConfig(ulysses_degree=dist.get_world_size())
            result["runs"][(method, order)] = _one(pipe, method, overrides, cp if order == "cp-then-apply" else None,
                                                   exchanged, cp_after=cp if order == "apply-then-cp" else None)
    return result


def _one(pipe, method, overrides, cp_before, exchanged, cp_after=None) -> dict:
    import dcache
    from compat_kit import seeded

    if cp_before is not None:
        pipe.transformer.enable_parallelism(config=cp_before)
    handle = dcache.apply(pipe, method, **overrides)
    if cp_after is not None:
        pipe.transformer.enable_parallelism(config=cp_after)
    exchanged.clear()
    out = pipe(**CALL, generator=seeded(0))
    calls = [(c.step, c.branch, c.actions, dict(c.signals))
             for c in handle.engine.record.calls]
    run = {"out": out, "actions": handle.plan().actions, "calls": calls, "exchanged": list(exchanged),
           "compute_ratio": handle.stats().compute_ratio}
    handle.remove()
    return run
