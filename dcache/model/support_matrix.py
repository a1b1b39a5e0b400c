"""Which diffusers transformer classes dcache supports, and how.

    python -m dcache.model.support_matrix > SUPPORT.md

Every `ModelMixin` class exported by the installed `diffusers.models.transformers` gets one row:

- **supported**: a registered family adapter (dcache/model/families/). tests/test_zoo.py checks every one of them
  against a real forward of a tiny model and fails if a family has no zoo entry.
- **generic**: no family adapter, but `families.discover_adapter` would find correct data. Decided statically, without
  building the model: the `ModuleList`s assigned in the class source, their block classes, the block `forward`
  parameters (what discovery looks at) and the block `return` statements (what discovery has to assume).
- **not yet**: neither; the reason says what an adapter would have to describe.
"""

from __future__ import annotations

import inspect

from .adapters import ENCODER, HIDDEN, Adapter
from .families import registered_adapters
from .families.source_analysis import (GENERIC, KNOWN_NOT_YET, NOT_YET, SUPPORTED, Row, describe_lists, static_lists,
                                       static_row)


def transformer_classes() -> dict[str, type]:
    """Every ModelMixin subclass exported by diffusers.models.transformers, by name."""
    import diffusers.models.transformers as transformers
    from diffusers.models.modeling_utils import ModelMixin

    found = {}
    for name in dir(transformers):
        obj = getattr(transformers, name)
        if inspect.isclass(obj) and issubclass(obj, ModelMixin) and obj is not ModelMixin:
            found[name] = obj
    return dict(sorted(found.items()))


def support_table() -> list[Row]:
    families = registered_adapters()
    rows = []
    for name, cls in transformer_classes().items():
        if name in families:
            rows.append(_supported_row(families[name]))
        elif name in KNOWN_NOT_YET:
            rows.append(Row(name, NOT_YET, describe_lists(static_lists(cls)), KNOWN_NOT_YET[name]))
        else:
            rows.append(static_row(name, cls))
    return rows


def render_markdown() -> str:
    rows = support_table()
    counts = {status: sum(r.status == status for r in rows) for status in (SUPPORTED, GENERIC, NOT_YET)}
    import diffusers

    lines = [
        "# dcache support table",
        "",
        f"Transformer classes of diffusers {diffusers.__version__}: {counts[SUPPORTED]} supported, "
        f"{counts[GENERIC]} generic, {counts[NOT_YET]} not yet (of {len(rows)}).",
        "",
        "- **supported**: a family adapter in `dcache/model/families/`, checked against a real forward of a tiny "
        "model (`tests/zoo.py`, `tests/test_zoo.py`).",
        "- **generic**: no family adapter; generic discovery finds the blocks, and the block source shows it returns "
        "what discovery assumes (decided statically, not tested).",
        "- **not yet**: an adapter is needed; see `dcache.model.adapters.register_adapter`.",
        "",
        "Block lists: `name (returned slots)`, in execution order; `hid` = hidden_states, `enc` = "
        "encoder_hidden_states, `x` etc. = the block argument that carries the stream when it is not hidden_states.",
        "",
        "| class | status | block lists | modules / modulated input / reason |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| `{row.model_class}` | {row.status} | {row.block_lists} | {_cell(row.detail)} |")
    lines += _controlnet_section() + _experts_section()
    lines += ["", "Regenerate: `python -m dcache.model.support_matrix > SUPPORT.md`", ""]
    return "\n".join(lines)


# Transformers that add ControlNet / VACE samples to the stream between their blocks (tests/core/
# test_between_block_additions.py runs every unit kind on the ones marked tested).
_BETWEEN_BLOCKS = {
    "FluxTransformer2DModel": "tested", "ChromaTransformer2DModel": "tested (in-place single-block samples)",
    "BriaTransformer2DModel": "tested (double blocks; diffusers' single-block samples are mis-sliced)",
    "SD3Transformer2DModel": "tested", "QwenImageTransformer2DModel": "tested",
    "SanaTransformer2DModel": "tested (the tiny model adds after its last block only)",
    "ZImageTransformer2DModel": "same mechanism, not tested",
    "WanVACETransformer3DModel": "same mechanism, not tested",
    "HunyuanDiT2DModel": "none: samples join the skip connections passed to the blocks (inside every unit)",
    "CosmosTransformer3DModel": "none: the residual is added inside the blocks (inside every unit)",
}


def _controlnet_section() -> list[str]:
    import diffusers

    controlnets = sorted(n for n in dir(diffusers) if n.endswith("ControlNetModel") and "UNet" not in n
                         and n != "ControlNetModel")
    lines = ["", "## ControlNets", "",
             "A ControlNet model runs every step and hands its samples to the transformer, which adds them to the "
             "stream between its blocks. dcache keeps those additions out of a cached stack residual (each reused "
             "call adds its own samples, exactly as an uncached call does); block and module units never contain "
             "them. The ControlNet model itself runs every step unless `dcache.apply(pipe, method, controlnet=...)` "
             "caches it too, as one unit per call with its own state: `controlnet='follow'` (the transformer's "
             "schedule decides, for schedules that decide from the step and from what earlier computed calls "
             "measured) or its own schedule (`controlnet={'method': 'fixed_interval', 'interval': 3}`); a reused "
             "call serves the cached per-block "
             "samples, rescaled to its conditioning scale; each net of a multi-ControlNet has its own cache "
             "(docs/pipelines.md, tests/compat/test_controlnet_cache.py on Flux and Qwen-Image).", "",
             "| transformer | between-block additions |", "|---|---|"]
    lines += [f"| `{name}` | {status} |" for name, status in _BETWEEN_BLOCKS.items()]
    lines += ["", "ControlNet models of this diffusers: " + ", ".join(f"`{n}`" for n in controlnets) + "."]
    return lines


def _experts_section() -> list[str]:
    import diffusers

    found = []
    for name in sorted(n for n in dir(diffusers) if n.endswith("Pipeline")):
        try:
            params = inspect.signature(getattr(diffusers, name).__init__).parameters
        except (TypeError, ValueError, ImportError, AttributeError):
            continue
        extra = [p for p in params if p.startswith("transformer_")]
        if extra:
            found.append(f"| `{name}` | `transformer`, " + ", ".join(f"`{p}`" for p in extra) + " |")
    return ["", "## Pipelines with several denoising transformers", "",
            "Every expert is cached with its own state (`dcache.api.experts`): stats per expert and in total, a plan "
            "per expert, per-expert settings with `dcache.apply(pipe, method, experts={...})`.", "",
            "| pipeline | experts |", "|---|---|", *found]


# ---- supported rows -----------------------------------------------------------------------------------------------

_SLOT = {HIDDEN: "hid", ENCODER: "enc", None: "-"}


def _supported_row(adapter: Adapter) -> Row:
    lists = " → ".join(
        f"`{spec.path}` ({', '.join(_SLOT[s] for s in spec.outputs)})"
        + (f" [stream arg `{spec.hidden}`]" if spec.hidden != HIDDEN else "")
        for spec in adapter.block_lists)
    modules = ", ".join(f"`{m}`" for m in adapter.modules) or "(conventional names)"
    modulated = "modulated input: yes" if adapter.modulated_input else "modulated input: no"
    detail = f"{modules}; {modulated}" + (f". {adapter.notes}" if adapter.notes else "")
    return Row(adapter.model_class, SUPPORTED, lists, detail)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> None:
    print(render_markdown(), end="")


if __name__ == "__main__":
    main()
