"""Published MagCache tables are found for the real model configs (meta-device builds, no weights)."""

from __future__ import annotations

import pytest
import torch

from dcache.schedules import magcache_tables as mt
from dcache.schedules.tables import lookup_table


@pytest.mark.parametrize("cls_name, config, steps, branches", [
    ("FluxTransformer2DModel", dict(num_layers=19, num_single_layers=38, num_attention_heads=24,
                                    attention_head_dim=128, in_channels=64, joint_attention_dim=4096), 28, ["cond"]),
    ("WanTransformer3DModel", dict(num_layers=30, num_attention_heads=12, attention_head_dim=128, in_channels=16,
                                   out_channels=16, ffn_dim=8960, text_dim=4096, freq_dim=256), 50,
     ["cond", "uncond"]),
])
def test_published_table_is_registered_for_the_real_config(cls_name, config, steps, branches):
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**config)
    table = lookup_table("magcache", model)
    assert table is not None and sorted(table) == sorted(branches)
    for curve in table.values():
        assert len(curve) == steps and curve[0] == 1.0 and all(0.5 < g < 2.0 for g in curve)


def test_interleaved_arrays_split_into_branches():
    assert mt._split([1.0, 1.0, 0.9, 0.8]) == {"cond": [1.0, 0.9], "uncond": [1.0, 0.8]}
    assert len(mt.FLUX_DEV_28) == 28 and len(mt.QWEN_IMAGE_50_INTERLEAVED) == 100
