"""Which diffusers transformer classes dcache supports, and how.

    python -m dcache.support_matrix > SUPPORT.md

Every `ModelMixin` class exported by the installed `diffusers.models.transformers` gets one row:

- **supported**: a registered family adapter (dcache/families/). tests/test_zoo.py checks every one of them against a
  real forward of a tiny model and fails if a family has no zoo entry.
- **generic**: no family adapter, but `adapters.discover_adapter` would find correct data. Decided statically, without
  building the model: the `ModuleList`s assigned in the class source, their block classes, the block `forward`
  parameters (what discovery looks at) and the block `return` statements (what discovery has to assume).
- **not yet**: neither; the reason says what an adapter would have to describe.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

from .adapters import ENCODER, HIDDEN, Adapter, registered_adapters

SUPPORTED, GENERIC, NOT_YET = "supported", "generic", "not yet"

# Classes whose static facts would mislead (or that are not denoising DiTs at all): the reason is written by hand.
_KNOWN_NOT_YET: dict[str, str] = {
    "LatteTransformer3DModel": "spatial and temporal blocks alternate (zip of two lists) over differently reshaped "
                               "token layouts; an adapter lists blocks list by list",
    "PriorTransformer": "not a denoising DiT of an image/video pipeline (unCLIP prior over embeddings)",
    "T5FilmDecoder": "not a DiT: spectrogram diffusion decoder with FiLM-conditioned T5 layers",
    "TransformerTemporalModel": "a temporal sub-module inside UNet3D/I2VGen-XL, not a standalone DiT",
    "MiniMaxMusic3RVQDepthDecoder": "not a diffusion transformer (autoregressive RVQ depth decoder)",
    "RFD4ProteinaTransformer": "protein-structure model: (values, pairs) streams, no token hidden_states",
    "Transformer2DModel": "legacy multi-purpose class; its blocks are built in helper methods per input type "
                          "(continuous / vectorized / patched): register an adapter for the variant in use",
    "Cosmos3OmniTransformer": "mixture-of-transformers layers over (und_seq, gen_seq) streams",
    "ErnieImageTransformer2DModel": "blocks take the stream as `x` in sequence-first layout [L, B, D]; the adapter "
                                    "format assumes batch-first [B, L, D] (CFG batch halves, per-sample state)",
    "Kandinsky6Transformer3DModel": "two evolving streams (vis, aud): expressible as BlockList(hidden='vis', "
                                    "encoder='aud', outputs=(HIDDEN, ENCODER)), not yet checked on a tiny model",
    "WanAnimateTransformer3DModel": "Wan blocks (encoder=None) plus face-adapter cross-attention applied between "
                                    "some blocks; not yet checked on a tiny model (motion/face encoders)",
}


@dataclass(frozen=True)
class Row:
    model_class: str
    status: str  # SUPPORTED / GENERIC / NOT_YET
    block_lists: str  # e.g. "transformer_blocks (enc, hid) -> single_transformer_blocks (hid)"
    detail: str  # supported: modules and modulated input; generic / not yet: the reason


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
        elif name in _KNOWN_NOT_YET:
            rows.append(Row(name, NOT_YET, _describe_lists(_static_lists(cls)), _KNOWN_NOT_YET[name]))
        else:
            rows.append(_static_row(name, cls))
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
        "- **supported**: a family adapter in `dcache/families/`, checked against a real forward of a tiny model "
        "(`tests/zoo.py`, `tests/test_zoo.py`).",
        "- **generic**: no family adapter; generic discovery finds the blocks, and the block source shows it returns "
        "what discovery assumes (decided statically, not tested).",
        "- **not yet**: an adapter is needed; see `dcache.adapters.register_adapter`.",
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
    lines += ["", "Regenerate: `python -m dcache.support_matrix > SUPPORT.md`", ""]
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
             "schedule decides, for schedules that decide from the step alone) or its own schedule "
             "(`controlnet={'method': 'fixed_interval', 'interval': 3}`); a reused call serves the cached per-block "
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
            "Every expert is cached with its own state (`dcache.experts`): stats per expert and in total, a plan per "
            "expert, per-expert settings with `dcache.apply(pipe, method, experts={...})`.", "",
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


# ---- static analysis for classes without a family adapter -----------------------------------------------------------

@dataclass(frozen=True)
class _StaticList:
    path: str
    blocks: tuple[type, ...]  # block classes the list is built from (several if chosen by config)


def discovery_refusal(cls: type) -> str | None:
    """Why generic discovery must not run on this class (its "not yet" reason), or None. Read by
    `adapters.discover_adapter`, so that `dcache.apply` refuses such a model instead of crashing in its first call."""
    if cls.__name__ in _KNOWN_NOT_YET:
        return _KNOWN_NOT_YET[cls.__name__]
    try:
        lists = _static_lists(cls)
        row = _static_row(cls.__name__, cls) if lists else None
    except (OSError, TypeError, SyntaxError):  # no source to read (built at run time): the engine checks at run time
        return None
    # no list found in the source is inconclusive (blocks built elsewhere): the engine checks the first call
    return row.detail if row is not None and row.status == NOT_YET else None


def _static_row(name: str, cls: type) -> Row:
    lists = _static_lists(cls)
    described = _describe_lists(lists)
    if not lists:
        return Row(name, NOT_YET, "—", "no ModuleList of blocks is assigned in the class source")
    discovered, problems = [], []
    for spec in lists:
        verdicts = {_discovery_verdict(block) for block in spec.blocks}
        if any(v.startswith("skip") for v in verdicts):
            first = next(iter(spec.blocks))
            stream = _stream_arg(first)
            problems.append(f"`{spec.path}` blocks ({first.__name__}) take the stream as `{stream}`, not "
                            f"`{HIDDEN}`: needs BlockList(hidden={stream!r})")
            continue
        discovered.append(spec.path)
        bad = sorted(v for v in verdicts if v != "ok")
        if bad:
            problems.append(f"`{spec.path}`: {bad[0]}")
    refiners = [p for p in discovered if "refiner" in p]
    if refiners:
        problems.append(f"discovery would also hook {', '.join(f'`{p}`' for p in refiners)}, which run on a "
                        f"different token set than the main blocks")
    if not discovered:
        return Row(name, NOT_YET, described, "; ".join(problems) or "no block list takes hidden_states")
    if problems:
        return Row(name, NOT_YET, described, "; ".join(problems))
    return Row(name, GENERIC, described, "generic discovery of " + ", ".join(f"`{p}`" for p in discovered) +
               "; return order checked in the block source")


def _static_lists(cls: type) -> list[_StaticList]:
    """`self.<name> = nn.ModuleList([...Block(...)...])` (or `.append(Block(...))`) in the class source, in order."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return []
    namespace = vars(sys.modules[cls.__module__])
    lists: dict[str, set[type]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func).endswith("ModuleList"):
            target = ast.unparse(node.targets[0])
            if target.startswith("self."):
                lists.setdefault(target[5:], set()).update(_block_classes(node.value, namespace))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append":
            owner = ast.unparse(node.func.value)
            if owner.startswith("self.") and owner[5:] in lists:
                lists[owner[5:]].update(_block_classes(node, namespace))
    return [_StaticList(path, tuple(sorted(blocks, key=lambda c: c.__name__)))
            for path, blocks in lists.items() if blocks]


def _block_classes(call: ast.AST, namespace: dict[str, Any]) -> set[type]:
    from torch import nn

    found = set()
    for node in ast.walk(call):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            obj = namespace.get(node.func.id)
            if inspect.isclass(obj) and issubclass(obj, nn.Module) and not issubclass(obj, (nn.ModuleList,)) \
                    and obj.__module__.startswith("diffusers") and "forward" in vars(obj):
                found.add(obj)
    return found


def _stream_arg(block: type) -> str:
    params = list(inspect.signature(block.forward).parameters)
    return params[1] if len(params) > 1 else "?"


def _discovery_verdict(block: type) -> str:
    """'ok' when discover_adapter's assumption about this block class matches its return statements."""
    params = inspect.signature(block.forward).parameters
    if HIDDEN not in params:
        return "skip"
    expects = (HIDDEN, ENCODER) if ENCODER in params else (HIDDEN,)
    returns = _returns(block)
    if not returns:
        return f"cannot tell what {block.__name__}.forward returns"
    for value in returns:
        if isinstance(value, ast.Tuple):
            names = tuple(ast.unparse(e) for e in value.elts)
            if len(expects) == 1:
                return f"{block.__name__} returns a tuple {names}; discovery expects hidden_states alone"
            if names != expects:
                return (f"{block.__name__} returns {names}; discovery assumes {expects}: needs an adapter with "
                        f"outputs=({', '.join(_slot_name(n) for n in names)})")
        elif isinstance(value, ast.Call) and len(expects) > 1:
            return f"{block.__name__} returns {ast.unparse(value)[:40]}…: cannot tell its slots statically"
        elif len(expects) > 1:
            return (f"{block.__name__} reads `{ENCODER}` as cross-attention context and returns one tensor; "
                    f"discovery would expect (hidden, encoder): needs an adapter with encoder=None")
    return "ok"


def _slot_name(expr: str) -> str:
    return {HIDDEN: "HIDDEN", ENCODER: "ENCODER"}.get(expr, "None")


def _returns(block: type) -> list[ast.expr]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(block.forward)))
    except (OSError, TypeError, SyntaxError):
        return []
    function = tree.body[0]
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            found.append(node.value)
    return found


def _describe_lists(lists: list[_StaticList]) -> str:
    if not lists:
        return "—"
    return " · ".join(f"`{s.path}` ({'/'.join(b.__name__ for b in s.blocks)})" for s in lists)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> None:
    print(render_markdown(), end="")


if __name__ == "__main__":
    main()
