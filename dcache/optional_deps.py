"""Optional dependencies: which extra of the `dcache` distribution brings each one, and the error that says so.

`import dcache; dcache.apply(...)` needs torch + diffusers (+ safetensors) only. Evaluation, plan search and the
Triton kernels need more; they import it through `require`, and the command line turns a missing module into the
install command (`explain_missing`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# top-level import name -> (extra, what needs it)
EXTRA_OF: dict[str, tuple[str, str]] = {
    "matplotlib": ("eval", "plots (eval reports, search fronts, analyze heat maps)"),
    "torchmetrics": ("eval", "image metrics (LPIPS, FID)"),
    "accelerate": ("eval", "multi-process evaluation and plan search (accelerate launch)"),
    "pymoo": ("search", "ECAD plan search (NSGA-II)"),
    "triton": ("gpu", "the fused CUDA kernels (CUDA builds of torch already bring triton)"),
}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def install_hint(module: str) -> str | None:
    """`pip install "dcache[extra]"` for an optional module's top-level name, or None if it is no extra's."""
    entry = EXTRA_OF.get(module.partition(".")[0])
    if entry is None:
        return None
    extra, purpose = entry
    return f'{module.partition(".")[0]} is needed for {purpose}: pip install "dcache[{extra}]"'


def require(module: str) -> ModuleType:
    """Import an optional dependency, or raise MissingExtraError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        hint = install_hint(error.name or module) if (error.name or module).partition(".")[0] in EXTRA_OF else None
        if hint is None:
            raise
        raise MissingExtraError(f"{hint}.", name=error.name) from error


def explain_missing(error: BaseException) -> str | None:
    """The install command for an error raised by a missing optional module (anywhere in its chain), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ModuleNotFoundError) and error.name:
            hint = install_hint(error.name)
            if hint is not None:
                return hint
        error = error.__cause__ or error.__context__
    return None
