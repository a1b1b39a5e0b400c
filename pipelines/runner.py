"""Load any supported pipeline (the bundled tiny model, a hub id or a local folder) and run it reproducibly.

`GenerationJob` hides the difference between the tiny class-conditional model (labels) and text-to-image/video
pipelines (prompts); every run returns images as a float tensor [N, C, H, W] in [0, 1] (videos: [N*F, C, H, W]).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

TINY = "tiny"


@dataclass
class GenerationJob:
    pipe: Any
    is_tiny: bool
    prompts: list[str] = field(default_factory=list)
    steps: int | None = None
    guidance: float | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    extra: dict = field(default_factory=dict)
    frames_per_sample: int = 0  # > 0 after a video generation

    def __call__(self) -> torch.Tensor:
        """One generation with fixed seeds; returns images [N, C, H, W] float in [0, 1] on the CPU."""
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        kwargs: dict[str, Any] = {k: call_argument(v) for k, v in self.extra.items()}
        if self.steps is not None:
            kwargs["num_inference_steps"] = self.steps
        if self.guidance is not None:
            kwargs["guidance_scale"] = self.guidance
        if self.is_tiny:
            from .tiny_pipeline import parse_digit_prompt

            labels = [parse_digit_prompt(p) for p in self.prompts]  # "3" or "three" -> 3
            out = self.pipe(labels=labels, generator=generator, output_type="pt", **kwargs)
            return out.images.detach().float().cpu()
        if self.height:
            kwargs["height"] = self.height
        if self.width:
            kwargs["width"] = self.width
        out = self.pipe(prompt=self.prompts, generator=generator, output_type="np", **kwargs)
        frames = getattr(out, "frames", None)
        if frames is not None:  # video: [N, F, H, W, C]
            arr = np.asarray(frames, dtype=np.float32)
            self.frames_per_sample = arr.shape[1]
            return torch.from_numpy(arr.reshape(-1, *arr.shape[-3:])).permute(0, 3, 1, 2).contiguous()
        arr = np.asarray(out.images, dtype=np.float32)  # [N, H, W, C]
        return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


def load_pipeline(model: str | None, *, device: str = "auto", dtype: str = "auto") -> tuple[Any, bool]:
    """(pipeline, is_tiny). `model` None / "tiny" = the bundled model; else a hub id or a local folder.
    device / dtype "auto": CUDA in bfloat16, else MPS, else the CPU in float32 (`devices.resolve_device`)."""
    from .devices import resolve_device

    device, dtype = resolve_device(device, dtype)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    from .bundled import load_tiny_pipeline
    from .tiny_pipeline import DigitFlowPipeline

    kind = check_model(model)
    if kind == TINY:
        return load_tiny_pipeline(device=device, dtype=torch_dtype), True
    if kind == "folder":
        index = Path(model) / "model_index.json"
        if json.loads(index.read_text()).get("_class_name") == DigitFlowPipeline.__name__:
            return DigitFlowPipeline.from_pretrained(str(model), dtype=torch_dtype).to(device), True
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(model, dtype=torch_dtype)
    except Exception as exc:  # network, auth, missing files: say what to do
        raise RuntimeError(f"could not load {model!r} with diffusers ({type(exc).__name__}: {exc}). Check the id, "
                           f"your network / HF token, or pass a local folder.") from exc
    return pipe.to(device), False


def check_model(model: str | None) -> str:
    """What `--model` names, checked without loading anything: "tiny" (None, "" or "tiny": the bundled model),
    "folder" (a diffusers pipeline folder with model_index.json) or "hub" (a hub id 'org/name').

    A hub id is what the hub accepts (huggingface_hub's validate_repo_id: letters, digits, '-', '_', '.', at most
    96 characters, no '--' or '..', starting and ending with a letter or digit) with exactly one '/': so
    'black-forest-labs/FLUX.1-dev' is one, and 'flux.1-dev' (a shipped estimate config, not a pipeline) is not."""
    if model in (None, "", TINY):
        return TINY
    path = Path(model)
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ValueError(f"--model {model!r} is a folder without model_index.json; pass a diffusers pipeline "
                             f"folder (saved with save_pretrained) or a hub id like 'org/name'.")
        return "folder"
    if is_hub_id(model):
        return "hub"
    raise ValueError(f"--model {model!r} is neither an existing folder nor a hub id like 'org/name' (letters, digits, "
                     f"'-', '_' and '.', e.g. black-forest-labs/FLUX.1-dev); check the path or the id.")


def is_hub_id(name: str) -> bool:
    """True for a valid hub repository id with an owner: 'org/name' (see check_model)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


@contextmanager
def removed_if_left_empty(out: str | os.PathLike) -> Iterator[None]:
    """Run a command that writes to the folder `out`; if the command created it and it is still empty when the
    command ends (an error, Ctrl-C), remove it, so a failed run leaves nothing behind. A folder that existed before,
    or that holds anything (resumable work included), is kept."""
    path = Path(out)
    existed = path.exists()
    try:
        yield
    finally:
        if not existed and path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def check_threads(threads: int | None) -> None:
    """--threads: None (the default below) or a positive count; checked before anything loads."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads} must be >= 1 (torch CPU threads), e.g. --threads 1.")


def use_threads(threads: int | None, *, is_tiny: bool, device: str) -> int:
    """Set torch's intra-op CPU threads for a command and return the count: `threads` when given, else 1 for the
    bundled model on the CPU, else torch's default. The bundled model's tensors are tiny, so more threads only add
    contention: on a busy 2-core machine 2 threads let one variant's runs wait on the other jobs far more than
    another's (measured eval speed-ups of 25-42x for ideal 1.2-2.8x; 1.5-2.5x with one thread)."""
    check_threads(threads)
    if threads is None and is_tiny and str(device) == "cpu":
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@dataclass
class ABTiming:
    """Uncached (A) and cached (B) runs of one job, timed in alternation (`interleaved_runs`)."""

    reference: torch.Tensor  # the last uncached images
    cached: torch.Tensor  # the last cached images
    seconds_uncached: list[float]  # wall-clock seconds per timed run (one pipeline call of the whole batch)
    seconds_cached: list[float]
    stats: Any  # dcache Stats of the last cached run
    plans: dict[str, Any]  # its dcache Plans by expert: {"transformer": plan} (and "transformer_2" for Wan 2.2)
    cpu_uncached: list[float] = field(default_factory=list)  # process CPU seconds (all threads) of the same runs
    cpu_cached: list[float] = field(default_factory=list)


def expert_plans(handle: Any) -> dict[str, Any]:
    """The last generation's plan of every denoising transformer the handle caches, by component name."""
    return {name: handle.plan(expert=name) for name in ("transformer", *handle.experts)} if handle.experts \
        else {"transformer": handle.plan()}


def interleaved_runs(job: GenerationJob, enable: Callable[[], Any], repeats: int,
                     on_run: Callable[[str], None] | None = None) -> ABTiming:
    """Time the job uncached and cached in alternation: one warm-up each, then `repeats` rounds of A then B.
    repeats=0 times nothing: one uncached and one cached run, no warm-up, and empty timing lists (the images, stats
    and plans alone, for a user who wants to look at the cache's effect and not its speed).

    enable() hooks the cache and returns a dcache Handle; it is applied for every cached run and removed after it.
    on_run(name) is called after each of the 2 + 2 * repeats runs ("warm-up uncached", ..., "cached 3/3").
    Alternating matters: the first runs of a process are slower (allocator, caches, clock) and a machine's load
    drifts, so timing every uncached run before every cached one biased the bundled model's speed-up at batch 10 by
    ~30% (measured/ideal 1.3). Process CPU time is taken beside wall-clock time: on a CPU shared with other jobs it
    stays close to the work done, where wall-clock time also counts waiting for a core."""
    def timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        _sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        images = fn()
        _sync()
        return images, time.perf_counter() - start, time.process_time() - start_cpu

    def cached_run() -> tuple[torch.Tensor, float, float, Any, Any]:
        handle = enable()
        try:
            images, seconds, cpu = timed(job)
            return images, seconds, cpu, handle.stats(), expert_plans(handle)
        finally:
            handle.remove()

    done = on_run or (lambda name: None)
    if repeats == 0:
        reference = job()
        done("uncached")
        cached, _, _, stats, plan = cached_run()
        done("cached")
        return ABTiming(reference, cached, [], [], stats, plan, [], [])
    job()
    done("warm-up uncached")
    cached_run()
    done("warm-up cached")
    t_ref, t_cached, c_ref, c_cached = [], [], [], []
    rounds = max(repeats, 1)
    for k in range(rounds):
        reference, seconds, cpu = timed(job)
        t_ref.append(seconds)
        c_ref.append(cpu)
        done(f"uncached {k + 1}/{rounds}")
        cached, seconds, cpu, stats, plan = cached_run()
        t_cached.append(seconds)
        c_cached.append(cpu)
        done(f"cached {k + 1}/{rounds}")
    return ABTiming(reference, cached, t_ref, t_cached, stats, plan, c_ref, c_cached)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def call_argument(value: Any) -> Any:
    """A pipeline call argument from the command line: "@path" names an image file (a Kontext / edit input, a
    ControlNet's control image), opened as an RGB PIL image; lists of them too; anything else as it is. The "@path"
    text is what manifests and accelerate launches carry (JSON), the image is opened where the pipeline is called."""
    if isinstance(value, list):
        return [call_argument(v) for v in value]
    if not (isinstance(value, str) and value.startswith("@")):
        return value
    from PIL import Image

    with Image.open(value[1:]) as image:
        return image.convert("RGB")


def check_call_images(arguments: dict, flag: str = "--call") -> dict:
    """Refuse a "@path" argument whose file is missing or is not an image, naming the argument and the fix."""
    from PIL import Image, UnidentifiedImageError

    for key, value in arguments.items():
        for item in value if isinstance(value, list) else [value]:
            if not (isinstance(item, str) and item.startswith("@")):
                continue
            path = Path(item[1:])
            if not path.is_file():
                raise ValueError(f"{flag} {key}={item}: no file {str(path)!r}; '@' names an image file to pass as "
                                 f"{key} (e.g. {flag} {key}=@input.png).")
            try:
                with Image.open(path) as image:
                    image.verify()
            except (UnidentifiedImageError, OSError) as exc:
                raise ValueError(f"{flag} {key}={item}: {str(path)!r} is not an image PIL can read ({exc}); pass a "
                                 f"PNG or JPEG file.") from None
    return arguments


def parse_overrides(pairs: list[str], flag: str = "--set", example: str = "threshold=0.1") -> dict:
    """CLI `--set key=value` pairs -> config overrides (values parsed as JSON when they can be: 0.1, [1, 2], true)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"{flag} {pair!r} must look like key=value, e.g. {flag} {example}")
        key, value = pair.split("=", 1)
        out[key] = parse_setting(key, value, flag, example)
    return out


def parse_setting(key: str, value: str, flag: str = "--set", example: str = "threshold=0.1") -> Any:
    """One setting's value: JSON where it parses (0.1, [1, 2], true), the text otherwise; NaN and infinity (in any
    spelling: nan, NaN, inf, -Infinity) are refused here, naming the setting, since no knob accepts them."""
    if value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise ValueError(f"{flag} {key}={value}: NaN and infinity are not allowed; pass a finite number, e.g. "
                         f"{flag} {example}.")
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
