"""What a transformer class's source says about generic discovery: whether `discover_adapter` may run on it.

Decided statically, without building the model: the `ModuleList`s assigned in the class source, their block
classes, the block `forward` parameters (what discovery looks at) and the block `return` statements (what discovery
has to assume). `discovery_refusal(cls)` is the reason a class must not be discovered (None: it may be);
dcache.model.support_matrix turns the same analysis into SUPPORT.md's "generic" and "not yet" rows.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

from ..adapters import ENCODER, HIDDEN

SUPPORTED, GENERIC, NOT_YET = "supported", "generic", "not yet"

# Classes whose static facts would mislead (or that are not denoising DiTs at all): the reason is written by hand.
KNOWN_NOT_YET: dict[str, str] = {
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


# ---- static analysis for classes without a family adapter -----------------------------------------------------------

@dataclass(frozen=True)
class _StaticList:
    path: str
    blocks: tuple[type, ...]  # block classes the list is built from (several if chosen by config)


def discovery_refusal(cls: type) -> str | None:
    """Why generic discovery must not run on this class (its "not yet" reason), or None. Read by
    `dcache.model.families.discover_adapter`, so that `dcache.apply` refuses such a model instead of crashing in its
    first call."""
    if cls.__name__ in KNOWN_NOT_YET:
        return KNOWN_NOT_YET[cls.__name__]
    try:
        lists = static_lists(cls)
        row = static_row(cls.__name__, cls) if lists else None
    except (OSError, TypeError, SyntaxError):  # no source to read (built at run time): the engine checks at run time
        return None
    # no list found in the source is inconclusive (blocks built elsewhere): the engine checks the first call
    return row.detail if row is not None and row.status == NOT_YET else None


def static_row(name: str, cls: type) -> Row:
    lists = static_lists(cls)
    described = describe_lists(lists)
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


def static_lists(cls: type) -> list[_StaticList]:
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


def describe_lists(lists: list[_StaticList]) -> str:
    if not lists:
        return "—"
    return " · ".join(f"`{s.path}` ({'/'.join(b.__name__ for b in s.blocks)})" for s in lists)


