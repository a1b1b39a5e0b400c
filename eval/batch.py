"""Batch generation for `dcache generate --prompts FILE`: many prompts x seeds with one caching method, split over
processes under `accelerate launch`, resumable, one PNG per image plus index.json and stats.json.

    generate_batch(model="tiny", prompts="builtin", seeds=2, cache="fora", out="gen-out")

Items are (seed, batch of prompts) exactly as in `dcache eval`, so an image does not depend on the number of
processes. Every image file is written atomically; a rerun skips items whose images exist (resume). Videos are
written as GIFs (one per prompt and seed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcache.plan import atomic_write_text


@dataclass
class BatchResult:
    out_dir: Path
    index: list[dict]
    summary: dict[str, Any]


def generate_batch(*, model: str | None = None, prompts: str = "builtin", num_prompts: int | None = None,
                   seeds: int = 1, seed_offset: int = 0, cache: str | None = "magcache",
                   overrides: dict | None = None, steps: int | None = None, guidance: float | None = None,
                   batch_size: int | None = None, height: int | None = None, width: int | None = None,
                   device: str = "cpu", dtype: str = "float32", out: str = "dcache-out",
                   progress: bool = True) -> BatchResult:
    """Generate every (prompt, seed) with `cache` (None or "none" = uncached) and write the images to `out`."""
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    import dcache
    from dcache.pipelines.images import save_video, to_uint8
    from dcache.pipelines.runner import GenerationJob, load_pipeline

    from .prompts import load_prompts
    from .runner import _process_device, _quiet_load, make_items, process_state

    if seeds < 1:
        raise ValueError(f"--seeds {seeds} must be >= 1.")
    state = process_state(device)
    dev = _process_device(device, state)
    pipe, is_tiny = _quiet_load(load_pipeline, model, dev, dtype)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    prompt_list = load_prompts(prompts, is_tiny=is_tiny, limit=num_prompts)
    items = make_items(prompt_list, list(range(seed_offset, seed_offset + seeds)), batch_size or (10 if is_tiny else 1))
    out_dir = Path(out)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    use_cache = cache not in (None, "", "none")
    handle = dcache.apply(pipe, cache, **(overrides or {})) if use_cache else None
    entries, ratios = [], []
    try:
        with state.split_between_processes(items) as mine:
            mine = list(mine)
        for item in tqdm(mine, desc="generate", disable=not progress or not state.is_local_main_process, unit="call"):
            names = [f"s{item.seed}-p{i:05d}" for i in item.prompt_indices]
            meta_path = out_dir / "images" / f".{item.id}.json"
            if meta_path.is_file():  # resume: this item finished (its images were written before the marker)
                done = json.loads(meta_path.read_text())
                entries += done["entries"]
                ratios.append(done["compute"])
                continue
            job = GenerationJob(pipe, is_tiny, prompts=list(item.prompts), steps=steps, guidance=guidance,
                                seed=item.seed, height=height, width=width)
            images = job()
            new = []
            if job.frames_per_sample:
                f = job.frames_per_sample
                for k, name in enumerate(names):
                    save_video(images[k * f:(k + 1) * f], out_dir / "images" / f"{name}.gif")
                    new.append(f"{name}.gif")
            else:
                import PIL.Image

                for arr, name in zip(to_uint8(images), names):
                    path = out_dir / "images" / f"{name}.png"
                    tmp = path.with_name(f".{name}.tmp.png")
                    PIL.Image.fromarray(arr).save(tmp)
                    tmp.replace(path)
                    new.append(f"{name}.png")
            stats = handle.stats() if handle is not None else None
            compute = [stats.block_flops_computed, stats.block_flops_total] if stats is not None else [1.0, 1.0]
            done_entries = [{"file": f"images/{file}", "prompt": item.prompts[k], "prompt_index": i,
                             "seed": item.seed} for k, (i, file) in enumerate(zip(item.prompt_indices, new))]
            atomic_write_text(meta_path, json.dumps({"entries": done_entries, "compute": compute}))
            entries += done_entries
            ratios.append(compute)
    finally:
        if handle is not None:
            handle.remove()
    gathered = gather_object([(entries, ratios)])
    state.wait_for_everyone()
    index = sorted((e for part, _ in gathered for e in part), key=lambda e: (e["seed"], e["prompt_index"]))
    computed = sum(c for _, rs in gathered for c, _ in rs)
    total = sum(t for _, rs in gathered for _, t in rs)
    ratio = computed / total if total else 1.0
    summary = {"model": model or "tiny (bundled)", "cache": cache if use_cache else None, "overrides": overrides or {},
               "images": len(index), "prompts": len(prompt_list), "seeds": seeds, "processes": state.num_processes,
               "compute_ratio": ratio, "ideal_speedup": 1 / ratio if ratio > 0 else float("inf")}
    if state.is_main_process:
        atomic_write_text(out_dir / "index.json", json.dumps(index, indent=1))
        atomic_write_text(out_dir / "stats.json", json.dumps(summary, indent=1))
    state.wait_for_everyone()
    return BatchResult(out_dir, index, summary)


__all__ = ["generate_batch", "BatchResult"]
