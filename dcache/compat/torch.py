"""The private torch API dcache uses, each entry with what it relies on (checked in
tests/compat/test_diffusers_contract.py).
"""

from __future__ import annotations

from torch._C._dynamo.eval_frame import get_eval_frame_callback

# `eval_frame_callback() is not None` inside a torch.compile region, also in a frame dynamo skips
# (`torch.compiler.disable`), where the public `torch.compiler.is_compiling()` is False; None in plain eager code.
# The C function itself, not a wrapper: a skipped frame calls it directly, and a Python helper called from such a
# frame would be traced by dynamo (only the frame itself is skipped). Relies on: torch._C._dynamo.eval_frame
# exporting it (torch 2.1 and later).
eval_frame_callback = get_eval_frame_callback

__all__ = ["eval_frame_callback"]
