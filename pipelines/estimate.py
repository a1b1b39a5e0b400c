"""`dcache estimate`: a method's cache memory, FLOPs per call and compute-ratio range for a model, before any run.

The model is a transformer config (no weights): a shipped name (`dcache estimate --list`), a folder holding
`transformer/config.json` (and `transformer_2/config.json` for two-expert pipelines such as Wan2.2-A14B) or a
`config.json`, a config.json file, or a hub id (only its config files are downloaded). The transformer is rebuilt
on the meta device and the method runs on meta tensors of the real shapes (dcache.memory.estimate).

Call shapes per family (latent geometry as the diffusers pipelines build it; B = batch, x2 with batched CFG):
    Flux / Qwen-Image:  tokens = (H / vae / 2) x (W / vae / 2)  packed 2x2 latents [B, L, C]
    SD3:                latents [B, C, H / vae, W / vae]         (the transformer patchifies 2x2)
    Wan / HunyuanVideo: latents [B, C, (F - 1) / vae_t + 1, H / vae, W / vae]
    LTX-Video:          packed latents [B, F' x H' x W', C] with F' = (F - 1) / vae_t + 1, H' = H / vae, W' = W / vae
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dcache.memory.estimate import CacheEstimate, estimate, meta_model
from dcache.memory.report import format_bytes
from dcache.schedules.calibrated_plans import CalibrationMissing

ASSETS = Path(__file__).resolve().parent / "assets"
CONFIGS = ASSETS / "configs"
BUNDLED = ASSETS / "tiny-digits"
EXPERTS = ("transformer", "transformer_2")


@dataclass(frozen=True)
class Setting:
    """One generation's shape: what the pipeline would be called with."""

    height: int
    width: int
    frames: int = 1
    steps: int = 28
    guidance: float = 1.0
    cfg: str = "none"  # "split" (cond + uncond calls), "batched" (one call of 2B), "none" (guidance-distilled)
    text_tokens: int = 512
    vae_scale: tuple[int, int] = (1, 8)  # (time, space) downscale of the VAE
    pack: int = 1  # latent pixels packed per token side by the pipeline (Flux, Qwen-Image: 2)

    def branches(self, batch: int) -> tuple[tuple[str | None, ...], int]:
        """(branch names of one step, batch of each call)."""
        if self.guidance <= 1.0 or self.cfg == "none":
            return ("cond",), batch
        if self.cfg == "batched":  # diffusers names the doubled call's context "cond_uncond"
            return ("cond_uncond",), 2 * batch
        return ("cond", "uncond"), batch


@dataclass(frozen=True)
class ModelSpec:
    name: str
    experts: tuple[tuple[str, dict], ...]  # (expert name, transformer config.json)
    setting: Setting


# Family defaults for a config that is not shipped: VAE scales, packing, text length, and whether it is video.
_FAMILY = {
    "FluxTransformer2DModel": dict(vae_scale=(1, 8), pack=2, text_tokens=512),
    "QwenImageTransformer2DModel": dict(vae_scale=(1, 8), pack=2, text_tokens=128, cfg="split"),
    "SD3Transformer2DModel": dict(vae_scale=(1, 8), pack=1, text_tokens=333, cfg="batched"),
    "WanTransformer3DModel": dict(vae_scale=(4, 8), pack=1, text_tokens=512, cfg="split", frames=81),
    "HunyuanVideoTransformer3DModel": dict(vae_scale=(4, 8), pack=1, text_tokens=256, frames=129),
    "LTXVideoTransformer3DModel": dict(vae_scale=(8, 32), pack=1, text_tokens=128, cfg="batched", frames=161),
}


def shipped_models() -> dict[str, dict]:
    data = json.loads((CONFIGS / "models.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def resolve_model(model: str | None) -> ModelSpec:
    """A ModelSpec from None / 'tiny' (the bundled model), a shipped name, a folder, a config.json or a hub id."""
    if model in (None, "tiny"):
        return _bundled()
    shipped = shipped_models()
    by_hub_id = {info["hub_id"]: name for name, info in shipped.items()}
    if model in by_hub_id:  # a shipped model by its hub id: its config ships with dcache, nothing is downloaded
        model = by_hub_id[model]
    if model in shipped:
        info = shipped[model]
        return ModelSpec(model, _folder_experts(CONFIGS / model), _setting_from(info))
    path = Path(model)
    if path.is_file():
        config = _read_config(path)
        return ModelSpec(path.stem, (("transformer", config),), _default_setting(config))
    if path.is_dir():
        experts = _folder_experts(path)
        return ModelSpec(path.name, experts, _folder_setting(path, experts))
    if model.count("/") == 1 and not path.exists():
        experts = _hub_experts(model)
        return ModelSpec(model, experts, _shipped_setting(experts) or _default_setting(experts[0][1]))
    raise ValueError(f"--model {model!r} is neither a shipped config ({', '.join(sorted(shipped))}), a folder with "
                     f"transformer/config.json or config.json, a config.json file, nor a hub id like "
                     f"'black-forest-labs/FLUX.1-dev'.")


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON ({exc}); pass a transformer config.json.") from None
    if not isinstance(config, dict) or "_class_name" not in config:
        raise ValueError(f"{str(path)!r} has no \"_class_name\": a transformer config.json written by diffusers "
                         f"names its class there (e.g. \"FluxTransformer2DModel\").")
    return config


def _folder_experts(folder: Path) -> tuple[tuple[str, dict], ...]:
    experts = tuple((name, _read_config(folder / name / "config.json")) for name in EXPERTS
                    if (folder / name / "config.json").is_file())
    if experts:
        return experts
    if (folder / "config.json").is_file():
        return (("transformer", _read_config(folder / "config.json")),)
    raise ValueError(f"{str(folder)!r} holds neither transformer/config.json nor config.json.")


def _hub_experts(repo: str) -> tuple[tuple[str, dict], ...]:
    import huggingface_hub
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

    experts = []
    for name in EXPERTS:
        try:
            experts.append((name, _read_config(Path(huggingface_hub.hf_hub_download(repo, f"{name}/config.json")))))
        except LocalEntryNotFoundError as exc:  # a subclass of EntryNotFoundError: no network and nothing cached
            raise RuntimeError(
                f"could not download {repo}/{name}/config.json: offline (the hub is unreachable and the file is not "
                f"in the local cache: {str(exc).splitlines()[0][:160]}). Use a shipped config (dcache estimate "
                f"--list: {', '.join(sorted(shipped_models()))}), a local folder or config.json, or run once "
                f"online.") from None
        except EntryNotFoundError:
            continue
    if not experts:
        raise ValueError(f"hub repo {repo!r} has no transformer/config.json.")
    return tuple(experts)


def _setting_from(info: dict) -> Setting:
    fields = {k: info[k] for k in ("height", "width", "frames", "steps", "guidance", "cfg", "text_tokens", "pack")}
    return Setting(vae_scale=tuple(info["vae_scale"]), **fields)


def _default_setting(config: dict) -> Setting:
    family = dict(_FAMILY.get(config["_class_name"], {}))
    video = family.get("frames", 1) > 1
    return Setting(height=480 if video else 1024, width=832 if video else 1024, steps=50 if video else 28,
                   guidance=5.0 if family.get("cfg") else 3.5, **family)


def _bundled() -> ModelSpec:
    return ModelSpec("tiny", (("transformer", _read_config(BUNDLED / "transformer" / "config.json")),),
                     _digit_setting(BUNDLED))


def _digit_setting(folder: Path) -> Setting:
    """The digit pipeline's own call (16x16, 28 steps, split CFG at its default guidance, its label tokens)."""
    from .tiny_pipeline import DEFAULT_GUIDANCE, IMAGE_SIZE

    tokens = json.loads((folder / "label_encoder" / "config.json").read_text())["num_tokens"]
    return Setting(height=IMAGE_SIZE, width=IMAGE_SIZE, steps=28, guidance=DEFAULT_GUIDANCE, cfg="split",
                   text_tokens=tokens, vae_scale=(1, 1), pack=2)


def _shipped_setting(experts: tuple[tuple[str, dict], ...]) -> Setting | None:
    """The usual setting of the shipped model whose transformer has this config's identity (class and size), e.g.
    a saved FLUX.1-dev folder; None when no shipped model matches."""
    from dcache.schedules.tables import identity_from_config

    def identity(config: dict) -> str:
        return identity_from_config(config["_class_name"], config)

    wanted = [identity(config) for _, config in experts]
    for name, info in shipped_models().items():
        if [identity(config) for _, config in _folder_experts(CONFIGS / name)] == wanted:
            return _setting_from(info)
    return None


def _folder_setting(folder: Path, experts: tuple[tuple[str, dict], ...]) -> Setting:
    """A pipeline folder's own defaults: the digit pipeline's call for a DigitFlowPipeline folder (the bundled
    model's), a shipped model's usual setting for a folder of that model, else the family's defaults."""
    index = folder / "model_index.json"
    if index.is_file():
        from .tiny_pipeline import DigitFlowPipeline

        if json.loads(index.read_text()).get("_class_name") == DigitFlowPipeline.__name__:
            return _digit_setting(folder)
    return _shipped_setting(experts) or _default_setting(experts[0][1])


# ------------------------------------------------------------------------------------------------ call shapes
def model_inputs(config: dict, setting: Setting, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    """Forward kwargs of one transformer call (meta tensors; position ids real, they are small and read)."""
    cls = config["_class_name"]
    builder = _INPUTS.get(cls)
    if builder is None:
        raise ValueError(f"dcache estimate has no call shapes for {cls}; supported: {', '.join(sorted(_INPUTS))}. "
                         f"In Python, call dcache.memory.estimate.estimate(model, method, inputs) with the forward "
                         f"kwargs of one call.")
    t_scale, s_scale = setting.vae_scale
    if setting.height % (s_scale * setting.pack) or setting.width % (s_scale * setting.pack):
        raise ValueError(f"--height {setting.height} / --width {setting.width} must be multiples of "
                         f"{s_scale * setting.pack} for {cls} (VAE scale {s_scale} x packing {setting.pack}).")
    geometry = dict(f=(setting.frames - 1) // t_scale + 1, h=setting.height // s_scale, w=setting.width // s_scale)
    return builder(config, geometry, setting, batch, dtype)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def _flux(config, g, s, b, dtype):
    h, w, T = g["h"] // s.pack, g["w"] // s.pack, s.text_tokens
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(),
                                     indexing="ij"), -1)
    kw = dict(hidden_states=_meta(b, h * w, config.get("in_channels", 64), dtype=dtype),
              encoder_hidden_states=_meta(b, T, config.get("joint_attention_dim", 4096), dtype=dtype),
              pooled_projections=_meta(b, config.get("pooled_projection_dim", 768), dtype=dtype),
              timestep=_meta(b, dtype=dtype), img_ids=ids.reshape(-1, 3).to(dtype),
              txt_ids=torch.zeros(T, 3).to(dtype), return_dict=False)
    if config.get("guidance_embeds"):
        kw["guidance"] = _meta(b, dtype=dtype)
    return kw


def _qwen(config, g, s, b, dtype):
    h, w, T = g["h"] // s.pack, g["w"] // s.pack, s.text_tokens
    return dict(hidden_states=_meta(b, h * w, config.get("in_channels", 64), dtype=dtype),
                encoder_hidden_states=_meta(b, T, config.get("joint_attention_dim", 3584), dtype=dtype),
                encoder_hidden_states_mask=_meta(b, T, dtype=torch.long), timestep=_meta(b, dtype=dtype),
                img_shapes=[[(1, h, w)]] * b, return_dict=False)


def _sd3(config, g, s, b, dtype):
    return dict(hidden_states=_meta(b, config.get("in_channels", 16), g["h"], g["w"], dtype=dtype),
                encoder_hidden_states=_meta(b, s.text_tokens, config.get("joint_attention_dim", 4096), dtype=dtype),
                pooled_projections=_meta(b, config.get("pooled_projection_dim", 2048), dtype=dtype),
                timestep=_meta(b, dtype=dtype), return_dict=False)


def _wan(config, g, s, b, dtype):
    return dict(hidden_states=_meta(b, config.get("in_channels", 16), g["f"], g["h"], g["w"], dtype=dtype),
                encoder_hidden_states=_meta(b, s.text_tokens, config.get("text_dim", 4096), dtype=dtype),
                timestep=_meta(b, dtype=dtype), return_dict=False)


def _hunyuan(config, g, s, b, dtype):
    kw = dict(hidden_states=_meta(b, config.get("in_channels", 16), g["f"], g["h"], g["w"], dtype=dtype),
              timestep=_meta(b, dtype=dtype),
              encoder_hidden_states=_meta(b, s.text_tokens, config.get("text_embed_dim", 4096), dtype=dtype),
              encoder_attention_mask=_meta(b, s.text_tokens, dtype=dtype),
              pooled_projections=_meta(b, config.get("pooled_projection_dim", 768), dtype=dtype), return_dict=False)
    if config.get("guidance_embeds", True):
        kw["guidance"] = _meta(b, dtype=dtype)
    return kw


def _ltx(config, g, s, b, dtype):
    return dict(hidden_states=_meta(b, g["f"] * g["h"] * g["w"], config.get("in_channels", 128), dtype=dtype),
                encoder_hidden_states=_meta(b, s.text_tokens, config.get("caption_channels", 4096), dtype=dtype),
                timestep=_meta(b, dtype=dtype), encoder_attention_mask=_meta(b, s.text_tokens, dtype=dtype),
                num_frames=g["f"], height=g["h"], width=g["w"], return_dict=False)


_INPUTS = {"FluxTransformer2DModel": _flux, "QwenImageTransformer2DModel": _qwen, "SD3Transformer2DModel": _sd3,
           "WanTransformer3DModel": _wan, "HunyuanVideoTransformer3DModel": _hunyuan,
           "LTXVideoTransformer3DModel": _ltx}


# ------------------------------------------------------------------------------------------------ estimates
@dataclass
class Row:
    method: str
    expert: str
    estimate: CacheEstimate | None
    placeholder: bool = False  # the method's calibration placeholders were used (MethodConfig.estimate_placeholder)
    skipped: str | None = None  # --cache all: why this method has no estimate (a calibrated plan it cannot have)


def estimate_spec(spec: ModelSpec, methods: list[str], *, overrides: dict | None = None, batch: int = 1,
                  dtype: str = "bfloat16", setting: Setting | None = None, scope: str | None = None,
                  memory_only: bool = False, on_row: Callable[[str], None] | None = None) -> list[Row]:
    """One Row per (method, expert). memory_only: cache memory alone (no FLOPs, no compute-ratio range; faster).
    on_row(method) is called after each (method, expert): what a progress bar counts."""
    import diffusers

    from dcache.methods import knob_sweep
    from dcache.methods import methods as registered

    setting = setting or spec.setting
    torch_dtype = _dtype(dtype)
    branches, call_batch = setting.branches(batch)
    rows = []
    by_config: dict[str, list[Row]] = {}  # an expert with the same config as an earlier one has its estimates
    for expert, config in spec.experts:
        key = json.dumps(config, sort_keys=True)
        if key in by_config:  # Wan2.2-A14B's two experts share one architecture: estimating it twice doubles the time
            for row in by_config[key]:
                rows.append(replace(row, expert=expert))
                if on_row is not None:
                    on_row(f"{spec.name} {row.method}")
            continue
        first = len(rows)
        cls = getattr(diffusers, config["_class_name"], None)
        if cls is None:
            raise ValueError(f"diffusers {diffusers.__version__} has no class {config['_class_name']}.")
        model = meta_model(cls, config, torch_dtype)
        inputs = model_inputs(config, setting, call_batch, torch_dtype)
        for method in methods:
            over = dict(overrides or {})
            knob = knob_sweep(method)  # (field, grid)
            sweep = knob if knob and knob[0] not in over and not memory_only else None
            try:
                est = estimate(model, method, inputs, branches=branches, num_steps=setting.steps, scope=scope,
                               sweep=sweep, memory_only=memory_only, **over)
                rows.append(Row(method, expert, est))
            except CalibrationMissing as exc:
                if len(methods) == 1:
                    raise
                # a profiled method replays a plan calibrated on this model: its layout is unknown until then
                rows.append(Row(method, expert, None, skipped=f"needs a plan calibrated on this model: {exc.command}"))
                continue
            except ValueError as exc:
                # a method whose schedule needs calibration data that a bare config cannot have declares placeholder
                # knobs: memory and FLOPs are still estimated (neither depends on the values), the compute ratio not
                config_cls = registered().get(method)  # a method name (a preset names its own tables)
                placeholder = config_cls.estimate_placeholder if config_cls is not None else None
                # the error is about what the placeholder stands in for: it names a placeholder knob or calibration
                if not placeholder or not any(word in str(exc) for word in (*placeholder, "calibrat")):
                    raise
                over = {**placeholder, **over}
                est = estimate(model, method, inputs, branches=branches, num_steps=setting.steps, scope=scope,
                               memory_only=memory_only, **over)
                est.notes.append("calibration placeholder: memory and FLOPs hold, the compute ratio does not")
                rows.append(Row(method, expert, est, placeholder=True))
            finally:
                if on_row is not None:
                    on_row(f"{spec.name} {method}")
        by_config[key] = rows[first:]
    return rows


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype {name!r} must be one of {sorted(table)}.")
    return table[name]


def format_rows(spec: ModelSpec, setting: Setting, rows: list[Row], batch: int, dtype: str) -> str:
    """Plain-text report: one block per method."""
    branches, call_batch = setting.branches(batch)
    head = (f"{spec.name}: {setting.height}x{setting.width}" + (f", {setting.frames} frames" if setting.frames > 1
                                                                else "")
            + f", {setting.steps} steps, batch {batch}, {dtype}, "
            + (f"CFG {setting.guidance} ({setting.cfg}, {len(branches)} branch(es) of batch {call_batch})"
               if setting.cfg != "none" and setting.guidance > 1 else "no CFG branch"))
    lines = [head]
    for row in rows:
        est = row.estimate
        if est is None:
            lines.append(f"  {row.method}: not estimated, {row.skipped}")
            continue
        m = est.memory
        rng = est.ratio_range
        ratio = f"{rng[0]:.3f} - {rng[1]:.3f}" if rng and not row.placeholder else "n/a (needs calibration)"
        expert = f" [{row.expert}]" if len(spec.experts) > 1 else ""
        flops = max(est.flops_per_call.values(), default=0.0)
        lines.append(f"  {row.method}{expert}: peak cache {format_bytes(m.peak_bytes)} "
                     f"({', '.join(f'{k} {format_bytes(v)}' for k, v in m.by_kind.items()) or 'nothing cached'}); "
                     f"per branch {', '.join(f'{b} {format_bytes(sum(k.values()))}' for b, k in m.by_branch.items())}"
                     f"; {est.granularity} x{est.units} units, order {est.forecast_order}; "
                     f"{format_flops(flops)} per call; compute ratio {ratio}")
    if len(spec.experts) > 1:
        for method in dict.fromkeys(r.method for r in rows):
            total = sum(r.estimate.memory.peak_bytes for r in rows if r.method == method and r.estimate)
            lines.append(f"  {method}: both experts {format_bytes(total)} (each expert keeps its own cache)")
    return "\n".join(lines)


def format_flops(flops: float) -> str:
    for unit, scale in (("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f} FLOPs"


# ------------------------------------------------------------------------------------------ docs/memory.md table
TABLE_METHODS = ("magcache", "fbcache", "teacache", "easycache", "seacache", "taylorseer", "fora", "pab")


def table_size(methods: tuple[str, ...] = TABLE_METHODS, models: Sequence[str] | None = None) -> int:
    """The (model, expert, method) estimates markdown_table makes: its progress total."""
    return sum(len(resolve_model(name).experts) for name in models or shipped_models()) * len(methods)


def markdown_table(methods: tuple[str, ...] = TABLE_METHODS, dtype: str = "bfloat16",
                   models: Sequence[str] | None = None, on_row: Callable[[str], None] | None = None) -> str:
    """Peak cache memory per method for every shipped config (or `models`) at its usual settings
    (`dcache estimate --table`; docs/memory.md's table is its output). on_row: see estimate_spec."""
    header = "| model | setting | " + " | ".join(methods) + " |"
    lines = [header, "|" + "---|" * (len(methods) + 2)]
    for name in models or shipped_models():
        spec = resolve_model(name)
        s = spec.setting
        rows = estimate_spec(spec, list(methods), dtype=dtype, memory_only=True, on_row=on_row)
        cells = []
        for method in methods:
            total = sum(r.estimate.memory.peak_bytes for r in rows if r.method == method and r.estimate)
            cells.append(format_bytes(total))
        frames = f" x {s.frames}f" if s.frames > 1 else ""
        cfg = s.cfg if s.cfg != "none" else "no CFG"
        experts = f", {len(spec.experts)} experts" if len(spec.experts) > 1 else ""
        lines.append(f"| {name} | {s.width}x{s.height}{frames}, {s.steps} steps, {cfg}{experts} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def with_overrides(setting: Setting, **values: Any) -> Setting:
    return replace(setting, **{k: v for k, v in values.items() if v is not None})


__all__ = ["Setting", "ModelSpec", "Row", "resolve_model", "shipped_models", "model_inputs", "estimate_spec",
           "format_rows", "markdown_table", "with_overrides"]
