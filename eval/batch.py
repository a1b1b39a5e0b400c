"""Batch generation behind `dcache generate --prompts FILE`: every prompt x seed with one caching method, split over
processes under `accelerate launch`, resumable; one image per prompt and seed plus `manifest.json`.

    generate_batch(model="tiny", prompts="prompts.txt", seeds=2, cache="fora", out="gen-out")
    accelerate launch --multi_gpu --num_processes 2 -m dcache.pipelines.cli generate --prompts prompts.txt ...

Work is split into items = (seed, a batch of prompts), exactly as in `dcache eval`; an item runs with
`torch.Generator().manual_seed(seed)`, so an image does not depend on the number of processes or their order.
Each process writes the images of its own items (atomically: temporary file + rename) and a per-item marker in
`<out>/.work/` (eval/batch_markers.py: a rerun trusts one only when it names its item's own images); the main
process gathers the entries and writes `manifest.json` last, atomically. A rerun of the same command skips finished
items (resume); a run with different settings in the same folder is refused (its
images would be mixed with the old ones). Videos are written as GIFs, one per prompt and seed.

Timing in a manifest entry: `batch_seconds` is the wall-clock time of the whole pipeline call that made the image
(all `batch_size` images of its item together), `seconds_per_image` = batch_seconds / batch_size, its share.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcache.methods import DEFAULT_METHOD
from dcache.files.atomic import atomic_write_text, atomic_write_with, prepare_out_dir

from .batch_markers import image_names, read_marker, write_marker

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "dcache.generate"
MANIFEST_VERSION = 1
WORK_DIR = ".work"


@dataclass
class BatchResult:
    out_dir: Path
    images: list[dict]  # manifest entries, sorted by (seed, prompt index)
    summary: dict[str, Any]


def generate_batch(*, model: str | None = None, prompts: str = "builtin", num_prompts: int | None = None,
                   seeds: int = 1, seed_offset: int = 0, cache: str | None = DEFAULT_METHOD,
                   overrides: dict | None = None, steps: int | None = None, guidance: float | None = None,
                   batch_size: int | None = None, height: int | None = None, width: int | None = None,
                   pipeline_kwargs: dict | None = None, device: str = "cpu", dtype: str = "float32",
                   threads: int | None = None, out: str = "dcache-out", command: str | None = None,
                   progress: bool = True) -> BatchResult:
    """Generate every (prompt, seed) with `cache` (None or "none" = uncached) into `out` (see the module doc)."""
    import torch
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    import dcache
    from dcache.pipelines.runner import GenerationJob, load_pipeline

    from .prompts import load_prompts, precheck_prompts
    from .runner import _process_device, _quiet_load, claim_work_dir, inside, make_items, process_state

    if seeds < 1:
        raise ValueError(f"--seeds {seeds} must be >= 1 (the number of seeds per prompt).")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch-size {batch_size} must be >= 1.")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads} must be >= 1.")
    precheck_prompts(prompts)  # a missing / empty / malformed file fails before the model loads
    prepare_out_dir(out)  # so does an --out that is a file or a read-only folder
    state = process_state(device)
    dev = _process_device(device, state)
    pipe, is_tiny = _quiet_load(load_pipeline, model, dev, dtype)
    if threads is None and is_tiny and dev == "cpu":
        threads = 1  # the bundled model's tensors are tiny: extra intra-op threads only add contention
    if threads is not None:
        torch.set_num_threads(threads)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)  # our bar counts images; diffusers' would count steps
    prompt_list = load_prompts(prompts, is_tiny=is_tiny, limit=num_prompts)
    seed_list = list(range(seed_offset, seed_offset + seeds))
    batch = batch_size or (10 if is_tiny else 1)
    items = make_items(prompt_list, seed_list, batch)
    use_cache = cache not in (None, "", "none")
    settings = {"model": model or "tiny (bundled)", "cache": cache if use_cache else None,
                "overrides": overrides or {}, "prompts": prompt_list, "seeds": seed_list, "batch_size": batch,
                "steps": steps, "guidance": guidance, "height": height, "width": width,
                "pipeline_kwargs": pipeline_kwargs or {}, "dtype": dtype}
    out_dir = Path(out)
    work = out_dir / WORK_DIR
    fingerprint = _fingerprint(settings, cache if use_cache else None)
    if state.is_main_process:
        claim_work_dir(work, fingerprint, what="a batch generation")
    state.wait_for_everyone()
    if not state.is_main_process:
        claim_work_dir(work, fingerprint, what="a batch generation")  # only checks: the main process created it
    inside(out_dir, "images").mkdir(parents=True, exist_ok=True)  # a link out of --out is refused

    handle = dcache.apply(pipe, cache, **(overrides or {})) if use_cache else None
    entries: list[dict] = []
    try:
        with state.split_between_processes(items) as mine:
            mine = list(mine)
        bar = tqdm(total=sum(len(i.prompts) for i in mine), desc="generate", unit="img", dynamic_ncols=True,
                   disable=not progress or not state.is_local_main_process)
        for item in mine:
            marker = work / f"{item.id}.json"
            done = read_marker(marker, fingerprint, out_dir, item)
            if done is None:
                done = _generate_item(GenerationJob(pipe, is_tiny, prompts=list(item.prompts), steps=steps,
                                                    guidance=guidance, seed=item.seed, height=height, width=width,
                                                    extra=dict(pipeline_kwargs or {})),
                                      item, handle, out_dir, state.process_index)
                write_marker(marker, fingerprint, done)
            entries += done
            bar.update(len(item.prompts))
        bar.close()
    finally:
        if handle is not None:
            handle.remove()

    gathered = gather_object([entries])
    state.wait_for_everyone()
    images = sorted((e for part in gathered for e in part), key=lambda e: (e["seed"], e["prompt_index"]))
    if len(images) != len(prompt_list) * len(seed_list):
        raise RuntimeError(f"gathered {len(images)} of {len(prompt_list) * len(seed_list)} images; a process failed. "
                           f"Rerun the same command to resume.")
    computed = sum(e["block_flops"][0] for e in images)
    total = sum(e["block_flops"][1] for e in images)
    ratio = computed / total if total else 1.0
    summary = {**settings, "images": len(images), "num_prompts": len(prompt_list), "num_seeds": seeds,
               "processes": state.num_processes, "compute_ratio": ratio,
               "ideal_speedup": 1 / ratio if ratio > 0 else "inf"}
    if state.is_main_process:
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "command": command,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary, "images": images}
        atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1))
    state.wait_for_everyone()
    return BatchResult(out_dir, images, summary)


def _generate_item(job: Any, item: Any, handle: Any, out_dir: Path, process: int) -> list[dict]:
    """Run one pipeline call and write its images; returns their manifest entries."""
    from dcache.pipelines.images import save_video, to_uint8

    start = time.perf_counter()
    images = job()  # [N, C, H, W] (videos: [N*F, C, H, W]) in [0, 1]
    seconds = time.perf_counter() - start
    names = image_names(item)
    files = []
    if job.frames_per_sample:
        f = job.frames_per_sample
        for k, name in enumerate(names):
            files.append(_atomic(out_dir / "images" / f"{name}.gif",
                                 lambda tmp, k=k: save_video(images[k * f:(k + 1) * f], tmp)))
    else:
        import PIL.Image

        for arr, name in zip(to_uint8(images), names):
            files.append(_atomic(out_dir / "images" / f"{name}.png", lambda tmp, arr=arr: PIL.Image.fromarray(arr)
                                 .save(tmp, format="PNG")))
    stats = handle.stats() if handle is not None else None
    flops = [stats.block_flops_computed, stats.block_flops_total] if stats is not None else [1.0, 1.0]
    n = len(names)
    return [{"file": f"images/{file}", "prompt": item.prompts[k], "prompt_index": i, "seed": item.seed,
             "item": item.id, "compute_ratio": flops[0] / flops[1] if flops[1] else 1.0,
             "block_flops": [flops[0] / n, flops[1] / n], "batch_seconds": seconds, "batch_size": n,
             "seconds_per_image": seconds / n, "process": process}
            for k, (i, file) in enumerate(zip(item.prompt_indices, files))]


def _atomic(path: Path, write: Any) -> str:
    return atomic_write_with(path, write).name


def _fingerprint(settings: dict, cache: str | None) -> str:
    """Hash of everything that changes the images (a plan/config file by its content)."""
    content = b""
    if cache and (cache.endswith(".json") or os.sep in cache) and Path(cache).is_file():
        content = Path(cache).read_bytes()
    data = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(data + content).hexdigest()[:16]


__all__ = ["generate_batch", "BatchResult", "MANIFEST"]
