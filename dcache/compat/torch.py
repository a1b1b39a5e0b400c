"""The private torch API dcache uses, each entry with what it relies on and since which torch version (dcache needs
torch 2.4 or later; tests/compat/test_torch_contract.py checks every entry against the installed torch).
"""

from __future__ import annotations

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

# `eval_frame_callback() is not None` inside a torch.compile region, also in a frame dynamo skips
# (`torch.compiler.disable`), where the public `torch.compiler.is_compiling()` is False; None in plain eager code.
# The C function itself, not a wrapper: a skipped frame calls it directly, and a Python helper called from such a
# frame would be traced by dynamo (only the frame itself is skipped). Relies on: torch._C._dynamo.eval_frame
# exporting it (torch 2.1 and later).
eval_frame_callback = get_eval_frame_callback

# ---- pytrees -------------------------------------------------------------------------------------------------------
# The leaves of nested tuples / lists / dicts / dataclass-like model outputs, and the spec that rebuilds them
# (a transformer's return value, a block's arguments). Relies on: torch.utils._pytree's `tree_flatten(tree) ->
# (leaves, spec)`, `tree_unflatten(leaves, spec)` and `tree_map(fn, tree)`, with diffusers' `BaseOutput` registered
# as a node (torch 2.0 and later; diffusers registers it since 0.20). If they moved or changed, call scope, module
# units, per-sample lanes and FLOP counting would fail at their first call with an ImportError or a TypeError; the
# public successor, `torch.utils.pytree`, is not in every supported torch yet.
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map


# ---- fake tensors --------------------------------------------------------------------------------------------------
def fake_tensor_mode() -> FakeTensorMode:
    """A mode in which ops run on fake tensors (shapes, dtypes and devices, no data): FLOPs of a new input shape are
    counted by running the model once on fakes, at no compute.

    Relies on: `torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)` (torch 2.0 and later), a
    context manager that converts real inputs (parameters, buffers) to fakes as ops meet them, with `from_tensor(t)`
    to make fakes of the call's inputs. If it changed, counting the FLOPs of a new input shape would raise.
    """
    return FakeTensorMode(allow_non_fake_inputs=True)


# ---- tensor internals ----------------------------------------------------------------------------------------------
def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of `t` (and of every view of its storage): it grows at each in-place write.

    Relies on: `Tensor._version`, autograd's version counter, shared by views of one base (torch 1.0 and later).
    Step-invariant memoisation (dcache.runtime.step_invariant) and SeaCache's position-grid cache key on it, so that
    an input rewritten in place is not mistaken for the one cached; if it stopped growing on in-place writes, those
    caches could serve a stale result. Under `torch.inference_mode()` inference tensors have no counter and reading
    it raises: callers check `t.is_inference()` first.
    """
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of, or None when `t` owns its storage.

    Relies on: `Tensor._base` (torch 1.0 and later). Step-invariant memoisation keys a view on its base, so that a
    write through another view of the same base invalidates it; if `_base` went away, the memo would key on the
    view and could miss such a write.
    """
    return t._base


def foreach_lerp_(targets: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
    """targets[i] += weight * (ends[i] - targets[i]) in place, for all i, in one fused launch.

    Relies on: `torch._foreach_lerp_(tensors, tensors, scalar)` (torch 2.0 and later), the op torch's own optimizers
    use; if it went away, training the bundled model's EMA would raise (no effect on caching).
    """
    torch._foreach_lerp_(targets, ends, weight)


# ---- dispatch modes ------------------------------------------------------------------------------------------------
# A context manager whose `__torch_dispatch__(func, types, args, kwargs)` sees every aten op that runs inside it
# (dcache.memory.meta_ops answers ops on meta tensors from their remembered output shapes). Relies on:
# torch.utils._python_dispatch.TorchDispatchMode (torch 2.0 and later; FlopCounterMode and FakeTensorMode are built on
# it); modes entered later handle an op first, and a mode is switched off while its own `__torch_dispatch__` runs. If
# it moved, `dcache estimate` would fail at import; if the nesting changed, FLOPs counted inside it could drop.
DispatchMode = TorchDispatchMode


def op_is_functional(func) -> bool:
    """Whether the aten op `func` neither writes to an argument nor returns a view of one (`add`, `mm`: yes;
    `add_`, `view`, an `out=` overload: no).

    Relies on: an OpOverload's `_schema` (`torch._C.FunctionSchema`, torch 1.x and later) with `is_mutable` and each
    return's `alias_info` (None unless it aliases an input). If they changed, the meta-op memo would treat a view as a
    new tensor (shapes stay right, aliasing is lost) or stop remembering anything (estimates get slower, not wrong).
    """
    schema = func._schema
    return not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns)


__all__ = ["DispatchMode", "eval_frame_callback", "fake_tensor_mode", "foreach_lerp_", "op_is_functional",
           "tensor_version", "tree_flatten", "tree_map", "tree_unflatten", "view_base"]
