"""A user's adapter registered before the first lookup takes its class, built-in family or not.

The built-in families load at the first lookup (dcache.model.families), so that a user's `register_adapter` made
earlier wins; for a class with a built-in adapter (FluxTransformer2DModel) loading them raised "already registered".
Run in a fresh interpreter: the built-in families load once per process.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from diffusers import FluxTransformer2DModel
from dcache.model.adapters import HIDDEN, Adapter, BlockList, register_adapter
from dcache.model.families import adapter_for, registered_adapters
mine = register_adapter(Adapter(model_class="FluxTransformer2DModel",
                                block_lists=(BlockList("single_transformer_blocks", encoder=None, outputs=(HIDDEN,)),),
                                notes="the user's"))
model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                               num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                               axes_dims_rope=(2, 2, 4))
assert adapter_for(model) is mine, adapter_for(model)
assert registered_adapters()["FluxTransformer2DModel"] is mine
assert "QwenImageTransformer2DModel" in registered_adapters()  # the other built-ins loaded
try:
    register_adapter(Adapter(model_class="FluxTransformer2DModel", block_lists=()))
except ValueError as error:
    assert "overwrite=True" in str(error)
else:
    raise AssertionError("a second registration after loading must ask for overwrite=True")
print("ok")
"""


def test_a_users_adapter_for_a_built_in_class_wins_when_registered_first():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
