"""The `dcache eval` loop: the uncached reference once, then every method / setting, on the same prompts and seeds.

    result = run_eval(EvalConfig(model="tiny", methods=["fora", "fbcache:threshold=0.2", "plan.json"], seeds=4,
                                 out="eval-out"))
    result.results["variants"]["fora"]["psnr"]

Work is split into *items*: (seed, a batch of prompts). An item is generated with `torch.Generator().manual_seed(
seed)`, so its images do not depend on which process runs it or in what order.

Resumable: every finished (variant, item) is a record file in `<out>/.work/<variant>/<item>.safetensors`
(dcache.files.state_file: JSON + tensors, never a pickle), written atomically (temporary file + rename); a new run with
the same settings skips what exists, so an interrupted eval continues where it stopped, and adding a method to the
list computes only that method. A run with different settings (model, prompts, seeds, steps, ...) in the same folder
is refused with the fix; a record or cost file that is not what dcache wrote is refused naming the file. The
report files are written last, atomically: nothing half-written is left.

Distributed: under `accelerate launch` the items are split over processes with
`accelerate.PartialState().split_between_processes` (contiguous chunks, in item order), every process runs every
variant on its chunk, the records are gathered with `accelerate.utils.gather_object`, and the main process computes
the aggregates (means over per-image values, Frechet distances over features in item order) and writes the report.
One process runs the same code path; quality numbers are identical for any number of processes (at a fixed thread
count: CPU matmuls may round differently with a different number of threads). Latencies are measured per process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dcache.files.atomic import (atomic_write_text, check_inside, prepare_out_dir, read_limited,
                                 remove_stale_temporaries)
from dcache.pipelines.runner import check_threads, parse_setting, use_threads

from .judges import Judges, is_auto, resolve_eval_metrics
from dcache.quality import frechet_distance, median

from .metrics import METRICS, classifier_accuracy, finite_mean, reference_metrics, temporal_error
from .networks import DEFAULT_CLIP, DEFAULT_IMAGE_REWARD
from .prompts import load_prompts, precheck_prompts
from .records import RECORD_SUFFIX, load_cost, load_record, save_record
from .timing import Timing, count_flops, measure

UNCACHED = "uncached"
WORK_DIR = ".work"
RESULTS_FORMAT = "dcache.eval"
RESULTS_VERSION = 1
PSNR_CAP_DB = 100.0  # identical images have PSNR inf; means use this cap so one identical image does not read inf


# ------------------------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class EvalConfig:
    model: str | None = None  # None / "tiny" = the bundled model; else a hub id or a local pipeline folder
    methods: list[str] = field(default_factory=lambda: ["fora"])  # "name", "name:key=value:key=value", "plan.json"
    prompts: str = "builtin"  # "builtin", a prompt file, or inline labels for the tiny model
    num_prompts: int | None = None  # keep the first N prompts
    seeds: int = 2  # seeds seed_offset .. seed_offset + seeds - 1
    seed_offset: int = 0
    steps: int | None = None
    guidance: float | None = None
    batch_size: int | None = None  # prompts per pipeline call; default: 10 for the tiny model, 1 otherwise
    height: int | None = None
    width: int | None = None
    pipeline_kwargs: dict = field(default_factory=dict)  # more pipeline call arguments, e.g. {"num_frames": 17}
    repeats: int = 3  # timed repeats per item (after the per-variant warm-up)
    warmup: int = 1  # untimed runs per variant and process before timing
    flops: bool = True  # count FLOPs of one generation per variant (an extra untimed run)
    metrics: str | list[str] = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    grid_items: int = 1  # items shown in the image grids
    classifier: str | None = None  # digit classifier .safetensors for fid/accuracy (default: the bundled one)
    clip_model: str = DEFAULT_CLIP  # clip_score: a hub id or a local folder with a CLIP model
    image_reward_model: str = DEFAULT_IMAGE_REWARD  # image_reward: a model name or an ImageReward.pt path
    out: str = "dcache-eval"
    command: str | None = None  # the command line, recorded in the report
    threads: int | None = None  # torch CPU threads; None: 1 for the bundled model on the CPU (as dcache generate)

    def check(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"--seeds {self.seeds} must be >= 1 (the number of seeds per prompt).")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats {self.repeats} must be >= 1 and --warmup {self.warmup} >= 0.")
        check_threads(self.threads)
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size {self.batch_size} must be >= 1.")
        if not self.methods:
            raise ValueError("--methods is empty; pass e.g. --methods fora,fbcache or a plan file.")
        names = self.metrics.split(",") if isinstance(self.metrics, str) else list(self.metrics)
        unknown = [n.strip() for n in names if n.strip() and n.strip().lower() not in METRICS
                   and n.strip().lower() != "auto"]
        if unknown:
            from .metrics import MetricError

            raise MetricError(f"unknown metric(s) {unknown}; choose from {sorted(METRICS)} or 'auto'.")


@dataclass(frozen=True)
class Variant:
    """One method / setting to evaluate. `key` names its work folder (changes when the spec or plan file does)."""

    label: str
    method: str | None  # None = uncached
    overrides: dict
    spec: str
    key: str


def parse_method(spec: str) -> tuple[str, dict]:
    """'magcache:threshold=0.1:max_skip_steps=2' -> ('magcache', {'threshold': 0.1, 'max_skip_steps': 2}).
    Values are JSON where they parse (numbers, true/false, lists), strings otherwise."""
    parts = spec.strip().split(":")
    # a Windows drive letter ("C:\\plans\\a.json") is part of the path
    if len(parts) > 1 and len(parts[0]) == 1 and parts[1].startswith(("\\", "/")):
        parts = [parts[0] + ":" + parts[1]] + parts[2:]
    name, overrides = parts[0].strip(), {}
    if not name:
        raise ValueError(f"method spec {spec!r} has no method name; e.g. fora or fbcache:threshold=0.2.")
    for pair in parts[1:]:
        if "=" not in pair:
            raise ValueError(f"method spec {spec!r}: setting {pair!r} must look like key=value, e.g. "
                             f"magcache:threshold=0.1.")
        key, value = pair.split("=", 1)
        overrides[key.strip()] = parse_setting(key.strip(), value, "--methods", f"{name}:threshold=0.1")
    return name, overrides


def make_variants(specs: Sequence[str]) -> list[Variant]:
    out, labels = [], set()
    for spec in specs:
        name, overrides = parse_method(spec)
        is_file = name.endswith(".json") or os.sep in name
        if is_file and not Path(name).is_file():
            raise FileNotFoundError(f"--methods: plan/config file {name!r} does not exist.")
        label = Path(name).stem if is_file else name
        if overrides:  # file paths in settings show as their file name
            label += "(" + ",".join(f"{k}={Path(v).name if isinstance(v, str) and os.sep in v else v}"
                                    for k, v in overrides.items()) + ")"
        base, n = label, 2
        while label in labels or label == UNCACHED:
            label, n = f"{base}#{n}", n + 1
        labels.add(label)
        content = Path(name).read_bytes() if is_file else b""
        digest = hashlib.sha256(json.dumps([name, overrides], sort_keys=True, default=str).encode() + content)
        key = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:48] + "-" + digest.hexdigest()[:10]
        out.append(Variant(label, name, overrides, spec, key))
    return out


@dataclass(frozen=True)
class Item:
    """One pipeline call: `prompts` (indices into the prompt list) with one seed."""

    index: int
    seed: int
    prompt_indices: tuple[int, ...]
    prompts: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"s{self.seed}-p{self.prompt_indices[0]}-{self.prompt_indices[-1]}"


def make_items(prompts: Sequence[str], seeds: Sequence[int], batch_size: int) -> list[Item]:
    items = []
    for seed in seeds:
        for start in range(0, len(prompts), batch_size):
            idx = tuple(range(start, min(start + batch_size, len(prompts))))
            items.append(Item(len(items), int(seed), idx, tuple(prompts[i] for i in idx)))
    return items


# ------------------------------------------------------------------------------------------------------------------
# Records (one per variant x item), atomic on disk
# ------------------------------------------------------------------------------------------------------------------

# The record and cost files: eval/records.py (each checked to belong where it is found before a rerun trusts it).


# ------------------------------------------------------------------------------------------------------------------
# The evaluation
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class EvalResult:
    out_dir: Path
    results: dict[str, Any]  # what results.json holds (main process; other processes get the same)
    files: list[str]


def run_eval(cfg: EvalConfig, *, classifier: Any = None, networks: dict[str, Any] | None = None,
             progress: bool = True, on_record: Callable[[str, Item], None] | None = None) -> EvalResult:
    """Run the evaluation described by `cfg` (in every process under accelerate) and write the report folder.

    classifier: a DigitClassifier object to judge the tiny model with (tests); default cfg.classifier or bundled.
    networks: scorers for metrics with pretrained networks, {"lpips" | "clip_score" | "image_reward" | "fid": ...}
        (eval/networks.py; tests inject stand-ins); default: each metric's own network, loaded once per process.
    on_record(variant label, item): called after each new record is written (tests interrupt runs with it).
    """
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    import dcache
    from dcache.pipelines.runner import GenerationJob, load_pipeline

    cfg.check()
    precheck_prompts(cfg.prompts)  # a missing / empty / malformed file fails before the model loads
    prepare_out_dir(cfg.out)  # so does an --out that is a file or a read-only folder
    state = process_state(cfg.device)
    variants = make_variants(cfg.methods)
    check_before_loading(cfg, variants)
    device = _process_device(cfg.device, state)
    pipe, is_tiny = _quiet_load(load_pipeline, cfg.model, device, cfg.dtype)
    use_threads(cfg.threads, is_tiny=is_tiny, device=device)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)  # our bars count items; diffusers' would count steps
    prompts = load_prompts(cfg.prompts, is_tiny=is_tiny, limit=cfg.num_prompts)
    seeds = list(range(cfg.seed_offset, cfg.seed_offset + cfg.seeds))
    batch_size = cfg.batch_size or (10 if is_tiny else 1)
    items = make_items(prompts, seeds, batch_size)
    is_video = _is_video_pipeline(pipe)
    names, notes = resolve_eval_metrics(cfg.metrics, is_tiny=is_tiny, is_video=is_video, classifier=cfg.classifier,
                                        injected=tuple(networks or {}))
    names, notes = _fid_needs_two_images(names, notes, len(prompts) * len(seeds), cfg.metrics, is_video)
    _check_methods(pipe, variants, dcache)  # fail before hours of generation, with the method's own message
    judges = Judges(names, is_tiny=is_tiny, device=device, auto=is_auto(cfg.metrics), classifier_path=cfg.classifier,
                    classifier=classifier, networks=networks, clip_model=cfg.clip_model,
                    image_reward_model=cfg.image_reward_model)  # loads the metric networks before generating
    names, notes = judges.names, notes + judges.notes

    out = Path(cfg.out)
    work = out / WORK_DIR
    fingerprint = _fingerprint(cfg, prompts, seeds, batch_size, names, is_tiny)
    if state.is_main_process:
        claim_work_dir(work, fingerprint)
    state.wait_for_everyone()
    if not state.is_main_process:
        claim_work_dir(work, fingerprint)  # only checks now: the main process created it

    def job_for(item: Item) -> GenerationJob:
        return GenerationJob(pipe, is_tiny, prompts=list(item.prompts), steps=cfg.steps, guidance=cfg.guidance,
                             seed=item.seed, height=cfg.height, width=cfg.width, extra=dict(cfg.pipeline_kwargs))

    all_variants = [Variant(UNCACHED, None, {}, UNCACHED, UNCACHED)] + variants
    with state.split_between_processes(items) as mine:
        mine = list(mine)
    total = len(mine) * len(all_variants)
    bar = tqdm(total=total, desc=f"eval [{state.process_index}]" if state.num_processes > 1 else "eval",
               disable=not progress or not state.is_local_main_process, unit="gen", dynamic_ncols=True)
    local: dict[str, list[dict]] = {}
    costs: dict[str, dict] = {}
    references: dict[int, torch.Tensor] = {}
    for variant in all_variants:
        vdir = work / variant.key
        inside(out, f"{WORK_DIR}/{variant.key}")  # a variant folder linked elsewhere would read and write there
        records, todo = [], []
        for item in mine:
            rec = load_record(vdir, item, variant.label, fingerprint, cached=variant.method is not None)
            if rec is not None:
                records.append(rec)
                bar.update()
            else:
                todo.append(item)
        cost_path = vdir / "cost.json"
        cost = load_cost(cost_path)
        if todo or (cost is None and state.is_main_process):
            bar.set_postfix_str(variant.label, refresh=True)
            handle = dcache.apply(pipe, variant.method, **variant.overrides) if variant.method else None
            try:
                flops = None
                first = job_for(items[0])  # the same warm-up input in every process: FLOPs agree
                if cfg.flops:
                    images0, flops = count_flops(first)
                    flops /= max(images0.shape[0], 1)  # per image (per video frame for videos)
                for _ in range(cfg.warmup):
                    first()
                peak = None
                for item in todo:
                    job = job_for(item)
                    images, timing = measure(job, repeats=cfg.repeats, warmup=0, device=device)
                    peak = max(peak or 0, timing.peak_memory_bytes) if timing.peak_memory_bytes else peak
                    stats = handle.stats().to_dict() if handle is not None else None
                    rec = _make_record(variant, item, images, job.frames_per_sample, timing, stats, names,
                                       judges, references, vdir.parent, fingerprint, cfg.grid_items, is_tiny)
                    save_record(rec, vdir / f"{item.id}{RECORD_SUFFIX}")
                    records.append(rec)
                    bar.update()
                    if on_record is not None:
                        on_record(variant.label, item)
                if state.is_main_process and cost is None:
                    cost = {"flops_per_image": flops, "measured_on": items[0].id}
                    vdir.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(cost_path, json.dumps(cost))
                costs.setdefault(variant.label, {})["peak_memory_bytes"] = peak
            finally:
                if handle is not None:
                    handle.remove()
        if variant.method is None:
            references.update({r["item"]["index"]: r["images"] for r in records})
        local[variant.label] = [_shareable(r, cfg.grid_items) for r in records]
        if cost is not None:
            costs.setdefault(variant.label, {}).update(cost)
    bar.close()

    gathered = gather_object([(local, costs)])
    state.wait_for_everyone()
    merged: dict[str, list[dict]] = {v.label: [] for v in all_variants}
    merged_costs: dict[str, dict] = {v.label: {} for v in all_variants}
    for part_records, part_costs in gathered:
        for label, recs in part_records.items():
            merged[label].extend(recs)
        for label, c in part_costs.items():
            for k, v in c.items():
                if k == "peak_memory_bytes":
                    old = merged_costs[label].get(k)
                    merged_costs[label][k] = max(x for x in (old, v) if x is not None) if (old or v) else None
                elif v is not None:
                    merged_costs[label][k] = v
    for label in merged:
        merged[label].sort(key=lambda r: r["item"]["index"])
        if len(merged[label]) != len(items):
            raise RuntimeError(f"eval gathered {len(merged[label])} of {len(items)} records for {label!r}; a process "
                               f"failed. Rerun the same command to resume.")

    results = aggregate(cfg, all_variants, merged, merged_costs, names, notes, judges, prompts, seeds, items,
                        is_tiny, is_video, state.num_processes, device, batch_size)
    files: list[str] = []
    if state.is_main_process:
        from .report import write_report

        files = write_report(out, results, merged)
    state.wait_for_everyone()
    return EvalResult(out, results, files)


def process_state(device: str) -> Any:
    """accelerate's PartialState; CPU work (or no GPU) uses the gloo backend (torchrun / `accelerate launch
    --multi_gpu` on CPU machines), so processes split work and gather results there too."""
    from accelerate import PartialState

    cpu = (str(device).startswith("cpu") or not torch.cuda.is_available()
           or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"))
    return PartialState(cpu=cpu)


def _quiet_load(load_pipeline: Callable, model: str | None, device: str, dtype: str) -> tuple[Any, bool]:
    """load_pipeline without diffusers' "Loading pipeline components" bar (ours count the work)."""
    from diffusers.utils import logging as diffusers_logging

    was = diffusers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()
    try:
        return load_pipeline(model, device=device, dtype=dtype)
    finally:
        if was:
            diffusers_logging.enable_progress_bar()


def _process_device(device: str, state: Any) -> str:
    """Under accelerate, 'cuda' means this process's GPU (state.device); an explicit 'cuda:1' is kept."""
    if device in ("cuda", "auto") and state.num_processes > 1 and state.device.type == "cuda":
        return str(state.device)
    if device == "auto":
        return str(state.device)
    return device


def _is_video_pipeline(pipe: Any) -> bool:
    name = type(pipe).__name__.lower()
    return any(k in name for k in ("video", "wan", "hunyuanvideo", "ltx", "cogvideo", "mochi", "latte", "allegro",
                                   "skyreels"))


def check_before_loading(cfg: EvalConfig, variants: list[Variant]) -> None:
    """The model name, the step count and every method spec (name, settings, plan / config file), before the model
    loads (dcache.pipelines.arguments); _check_methods then applies each to the loaded model."""
    from dcache.pipelines.arguments import check_method, check_steps
    from dcache.pipelines.runner import check_model

    check_model(cfg.model)
    check_steps(cfg.steps)
    for v in variants:
        try:
            check_method(v.method, v.overrides, "--methods")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--methods {v.spec!r}: {exc}") from exc


def _fid_needs_two_images(names: list[str], notes: list[str], images: int, metrics: Any,
                          is_video: bool) -> tuple[list[str], list[str]]:
    """A Frechet distance compares feature statistics over at least 2 images; with one image (one prompt, one seed)
    fid is refused before any generation (or left out, with a note, when the metrics are "auto"), not after all of
    them. A video gives one feature row per frame, so it is not counted here."""
    if "fid" not in names or images >= 2 or is_video:
        return names, notes
    if is_auto(metrics):
        return [n for n in names if n != "fid"], notes + [f"skipped fid: it needs at least 2 images, this eval "
                                                          f"makes {images}."]
    raise ValueError(f"--metrics fid needs at least 2 images (a Frechet distance compares statistics over a set), "
                     f"this eval makes {images} (prompts x seeds); pass --seeds 2 or more prompts, or leave fid out "
                     f"of --metrics.")


def _check_methods(pipe: Any, variants: list[Variant], dcache: Any) -> None:
    for v in variants:
        try:
            handle = dcache.apply(pipe, v.method, **v.overrides)
        except Exception as exc:
            raise ValueError(f"--methods {v.spec!r}: {exc}") from exc
        handle.remove()


def _fingerprint(cfg: EvalConfig, prompts: list[str], seeds: list[int], batch_size: int, names: list[str],
                 is_tiny: bool) -> str:
    # The bundled model is "tiny" (load_pipeline never reads a ./tiny folder for it); a local folder is the hash of
    # its files' contents (retrained weights of the same shapes are another model); a hub id is its name.
    model = "tiny" if cfg.model in (None, "", "tiny") else cfg.model
    if model != "tiny" and Path(model).is_dir():
        model = "folder:" + folder_digest(Path(model))
    data = dict(model=model, prompts=prompts, seeds=seeds, batch_size=batch_size, steps=cfg.steps,
                guidance=cfg.guidance, height=cfg.height, width=cfg.width, dtype=cfg.dtype, metrics=names,
                classifier=cfg.classifier, tiny=is_tiny)
    # only when set: the fingerprints of earlier evals stay valid (resume)
    for key, default in (("pipeline_kwargs", {}), ("clip_model", DEFAULT_CLIP),
                         ("image_reward_model", DEFAULT_IMAGE_REWARD)):
        if getattr(cfg, key) != default:
            data[key] = getattr(cfg, key)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def folder_digest(folder: Path) -> str:
    """sha256 over the relative path, length and contents of every file under `folder` (hidden files skipped); it
    reads the whole model once per run, as loading it does."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        digest.update(f"{rel.as_posix()}\0{path.stat().st_size}\0".encode())  # name and length: unambiguous
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def claim_work_dir(work: Path, fingerprint: str, what: str = "an eval") -> None:
    """Create `work` for this run, or check that the run it holds had the same settings (resume). A `work` that is
    a symbolic link out of the output folder is refused: records would be read and written elsewhere. A resume
    removes the temporary files that a killed run (kill -9) left in the output folder."""
    inside(work.parent, work.name)
    marker = work / "fingerprint.txt"
    if marker.is_file():
        remove_stale_temporaries(work.parent, recursive=True)
        inside(work.parent, f"{work.name}/{marker.name}")
        # 16 hex digits: a larger file is not one dcache wrote (refused unread), other bytes are other settings
        raw = read_limited(marker, 64, "work folder fingerprint", f"delete {work} or pass a new --out")
        found = raw.decode("utf-8", errors="replace").strip()
        if found != fingerprint:
            raise ValueError(f"{work.parent} holds {what} with different settings (model, method, prompts, seeds, "
                             f"steps, guidance, size, dtype or metrics); resume it with the same settings, or pass a "
                             f"new --out (or delete {work}).")
        return
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, fingerprint)


def inside(out: Path, name: str) -> Path:
    """out / name, refused when it leads out of the output folder `out` (a `..` or a symbolic link)."""
    return check_inside(out, name, "the work path", f"remove the link (or delete {out / name}) or pass a new --out")


def _make_record(variant: Variant, item: Item, images: torch.Tensor, frames: int, timing: Timing,
                 stats: dict | None, names: list[str], judges: Judges, references: dict[int, torch.Tensor],
                 work: Path, fingerprint: str, grid_items: int, is_tiny: bool) -> dict:
    images = images.float().cpu()
    rec: dict[str, Any] = {
        "fingerprint": fingerprint, "variant": variant.label,
        "item": {"index": item.index, "id": item.id, "seed": item.seed, "prompt_indices": list(item.prompt_indices),
                 "prompts": list(item.prompts)},
        "num_images": int(images.shape[0]), "frames_per_sample": int(frames), "seconds": list(timing.samples),
        "cpu_seconds": list(timing.cpu_samples),
        "stats": _slim_stats(stats), "metrics": {}, "features": None, "predictions": None,
        "images": None,
    }
    if variant.method is None:
        rec["images"] = images  # float32: the reference the cached variants are measured against
    elif item.index < grid_items:
        rec["images"] = images
    if variant.method is not None:
        reference = references.get(item.index)
        if reference is None:
            ref_rec = load_record(work / UNCACHED, item, UNCACHED, fingerprint, cached=False)
            if ref_rec is None:
                raise RuntimeError(f"the uncached record of item {item.id} is missing; rerun to regenerate it.")
            reference = ref_rec["images"]
        rec["metrics"] = reference_metrics(images, reference, names, judges.reference_networks)
        if "temporal" in names and frames >= 2:
            rec["metrics"]["temporal"] = temporal_error(images, reference, frames).tolist()
    if judges.features is not None:
        rec["features"] = judges.features(images)
    if judges.digits is not None and "accuracy" in names:
        rec["predictions"] = judges.digits.predict(images).tolist()
    text = [p for p in item.prompts for _ in range(max(frames, 1))]
    for name in ("clip_score", "image_reward"):
        if name in judges.networks:
            rec["metrics"][name] = judges.networks[name](images, text).tolist()
    return rec


def _slim_stats(stats: dict | None) -> dict | None:
    if stats is None:
        return None
    keep = ("method", "granularity", "num_steps", "branches", "calls", "units_per_call", "units_computed",
            "units_reused", "units_forecast", "calls_fully_computed", "blocks_per_call", "block_flops_total",
            "block_flops_computed", "compute_ratio", "ideal_speedup", "cache_bytes", "per_step")
    return {k: stats.get(k) for k in keep}


def _shareable(rec: dict, grid_items: int) -> dict:
    """What is gathered to the main process: everything but the images of items not shown in grids."""
    out = dict(rec)
    if rec["item"]["index"] >= grid_items:
        out["images"] = None
    return out


# ------------------------------------------------------------------------------------------------------------------
# Aggregation (main process, from the gathered records)
# ------------------------------------------------------------------------------------------------------------------

def aggregate(cfg: EvalConfig, variants: list[Variant], records: dict[str, list[dict]], costs: dict[str, dict],
              names: list[str], notes: list[str], judges: Judges, prompts: list[str], seeds: list[int],
              items: list[Item], is_tiny: bool, is_video: bool, num_processes: int, device: str,
              batch_size: int) -> dict[str, Any]:
    ref_recs = records[UNCACHED]
    ref_latency = _per_image_latency(ref_recs)
    ref_cpu = _per_image_latency(ref_recs, "cpu_seconds")
    ref_features = _cat([r["features"] for r in ref_recs])
    data_features, data_note = _data_features(judges, is_tiny, "fid" in names)
    if data_note:
        notes.append(data_note)
    out_variants: dict[str, dict] = {}
    for v in variants:
        recs = records[v.label]
        row: dict[str, Any] = {"label": v.label, "method": v.method, "overrides": v.overrides, "spec": v.spec,
                               "num_images": sum(r["num_images"] for r in recs)}
        latency = _per_image_latency(recs)
        row["latency"] = _spread(latency)
        row["latency_per_call"] = _spread([s for r in recs for s in r["seconds"]])
        ref_med = ref_latency and median(ref_latency)
        # a median time of 0 (a record with zero seconds) measures nothing: no speed-up rather than a division by 0
        row["measured_speedup"] = (ref_med / median(latency)) if latency and ref_med and median(latency) > 0 else None
        cpu = _per_image_latency(recs, "cpu_seconds")
        if cpu and ref_cpu:  # process CPU time: robust to other jobs on a shared CPU (records of older runs lack it)
            row["cpu_latency"] = _spread(cpu)
            row["cpu_speedup"] = median(ref_cpu) / median(cpu) if median(cpu) > 0 else None
        if v.method is None:
            row["compute_ratio"], row["ideal_speedup"] = 1.0, 1.0
            row["cache_bytes"] = 0
        else:
            total = sum(r["stats"]["block_flops_total"] for r in recs)
            computed = sum(r["stats"]["block_flops_computed"] for r in recs)
            row["compute_ratio"] = computed / total if total > 0 else 1.0
            row["ideal_speedup"] = 1.0 / row["compute_ratio"] if row["compute_ratio"] > 0 else math.inf
            row["block_flops_total"], row["block_flops_computed"] = total, computed
            row["cache_bytes"] = max(r["stats"]["cache_bytes"] for r in recs)
            row["units"] = {k: sum(r["stats"][k] for r in recs) for k in ("units_computed", "units_reused",
                                                                          "units_forecast")}
            row["calls_fully_computed"] = sum(r["stats"]["calls_fully_computed"] for r in recs)
            row["calls"] = sum(r["stats"]["calls"] for r in recs)
            row["granularity"] = recs[0]["stats"]["granularity"]
            row["decisions_first_item"] = recs[0]["stats"]["per_step"]
        c = costs.get(v.label, {})
        row["flops_per_image"] = c.get("flops_per_image")
        row["peak_memory_bytes"] = c.get("peak_memory_bytes")
        per_image: dict[str, list[float]] = {}
        for r in recs:
            for name, vals in r["metrics"].items():
                per_image.setdefault(name, []).extend(vals)
        for name, vals in per_image.items():
            capped = [min(x, PSNR_CAP_DB) for x in vals] if name == "psnr" else vals
            row[name] = finite_mean(capped)
            row[f"{name}_min"] = min(vals) if vals else None
            row[f"{name}_max"] = max(vals) if vals else None
            row[f"{name}_median"] = median(vals) if vals else None
        row["per_image"] = per_image
        if "fid" in names:
            feats = _cat([r["features"] for r in recs])
            row["fid_vs_uncached"] = frechet_distance(feats, ref_features) if v.method is not None else 0.0
            if data_features is not None:
                row["fid_vs_data"] = frechet_distance(feats, data_features)
        if "accuracy" in names:
            preds = [p for r in recs for p in r["predictions"]]
            wanted = [int(prompts[i]) for r in recs for i in r["item"]["prompt_indices"]]
            row["accuracy"] = classifier_accuracy(preds, wanted)
        out_variants[v.label] = row
    uncached_flops = out_variants[UNCACHED].get("flops_per_image")
    for row in out_variants.values():
        f = row.get("flops_per_image")
        row["flops_ratio"] = f / uncached_flops if f and uncached_flops else None
    return {
        "format": RESULTS_FORMAT, "version": RESULTS_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": cfg.command,
        "config": {**asdict(cfg), "batch_size": batch_size},
        "model": "tiny (bundled)" if cfg.model in (None, "", "tiny") else cfg.model, "is_tiny": is_tiny,
        "is_video": is_video,
        "prompts": prompts, "seeds": seeds,
        "items": [{"index": i.index, "id": i.id, "seed": i.seed, "prompt_indices": list(i.prompt_indices)}
                  for i in items],
        "metrics": names, "metric_docs": {n: METRICS[n].doc for n in names}, "notes": notes,
        "feature_extractor": judges.features.name if judges.features is not None else None,
        "environment": environment(device, num_processes),
        "variants": out_variants,
        "order": [v.label for v in variants],
    }


def _per_image_latency(recs: list[dict], key: str = "seconds") -> list[float]:
    """Seconds per image (per video) of every timed call; [] when a record lacks `key`."""
    if any(not r.get(key) for r in recs):
        return []
    return [s / max(r["num_images"] // max(r["frames_per_sample"], 1), 1) for r in recs for s in r[key]]


def _spread(values: list[float]) -> dict[str, Any]:
    import statistics

    if not values:
        return {"median_s": None, "iqr_s": None, "min_s": None, "max_s": None, "n": 0}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median_s": median(values), "iqr_s": q[2] - q[0], "q1_s": q[0], "q3_s": q[2], "min_s": min(values),
            "max_s": max(values), "mean_s": statistics.fmean(values), "n": len(values)}


def _cat(parts: list[Any]) -> torch.Tensor | None:
    parts = [p for p in parts if p is not None]
    return torch.cat(parts) if parts else None


def _data_features(judges: Judges, is_tiny: bool, want: bool) -> tuple[torch.Tensor | None, str | None]:
    """Features of real data for FID-vs-data: the held-out digits test split for the tiny model."""
    if not want or not is_tiny or judges.digits is None:
        return None, None
    try:
        from dcache.pipelines.digit_classifier import load_digits_16

        images, _ = load_digits_16("test")
    except ImportError as exc:
        return None, f"fid_vs_data skipped: {exc}"
    return judges.digits(images), None


def environment(device: str, num_processes: int) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in ("dcache", "torch", "diffusers", "accelerate", "torchmetrics", "transformers", "triton", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
    return {"python": sys.version.split()[0], "platform": platform.platform(), "versions": versions,
            "device": device, "device_name": name, "num_processes": num_processes,
            "torch_threads": torch.get_num_threads(), "cuda": torch.version.cuda, "git_commit": _git_commit()}


def _git_commit(root: Path | None = None) -> str | None:
    """The commit of the checkout at `root` (default: the one this package runs from), "+dirty" when tracked files
    differ from it (the numbers then come from code that no commit holds); None outside a git checkout."""
    import subprocess

    root = root or Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5)
        commit = out.stdout.strip() or None
        if commit is not None:
            dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=root, timeout=10).returncode
            commit += "+dirty" if dirty == 1 else ""
        return commit
    except Exception:
        return None


__all__ = ["EvalConfig", "EvalResult", "Variant", "Item", "run_eval", "parse_method", "make_variants",
           "make_items", "aggregate", "environment", "UNCACHED"]
