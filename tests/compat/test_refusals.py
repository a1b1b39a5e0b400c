"""Models dcache cannot cache are refused at `dcache.apply` with the reason, never crash mid-generation; a
discovered adapter is checked against what the blocks really return on the first call, before anything is cached."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dcache
from dcache.model.adapters import UnsupportedModelError
from dcache.model.families.source_analysis import NOT_YET, discovery_refusal
from dcache.model.support_matrix import support_table


def test_latte_is_refused_at_apply_with_the_reason():
    from diffusers import LatteTransformer3DModel

    model = LatteTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                    num_layers=1, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
                                    norm_type="ada_norm_single", caption_channels=32, cross_attention_dim=16)
    for method in ("fbcache", "fixed_interval", "taylorseer"):
        with pytest.raises(UnsupportedModelError, match="spatial and temporal blocks alternate"):
            dcache.apply(model, method, num_steps=4)
    assert not hasattr(model, "_dcache_engine")


def test_continuous_transformer2d_is_refused_at_apply():
    from diffusers import Transformer2DModel

    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=8, num_layers=1,
                               norm_num_groups=4)
    with pytest.raises(UnsupportedModelError, match="legacy multi-purpose class"):
        dcache.apply(model, "fbcache", num_steps=4)


def test_prior_transformer_gets_its_real_reason_not_unet():
    from diffusers import PriorTransformer

    model = PriorTransformer(num_attention_heads=2, attention_head_dim=4, num_layers=1, embedding_dim=8,
                             num_embeddings=4, additional_embeddings=4)
    with pytest.raises(UnsupportedModelError, match="unCLIP prior") as err:
        dcache.apply(model, "fbcache", num_steps=4)
    assert "UNet" not in str(err.value)


@pytest.mark.parametrize("name", ["AceStepTransformer1DModel", "AnyFlowFARTransformer3DModel",
                                  "DreamLiteTransformer2DModel", "HeliosTransformer3DModel",
                                  "SanaWMLTX2RefinerTransformer3DModel", "WanAnimateTransformer3DModel"])
def test_classes_whose_blocks_discovery_would_misread_are_refused(name):
    import diffusers.models.transformers as transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in this diffusers")
    assert discovery_refusal(cls)


def test_every_not_yet_class_of_support_md_is_refused_by_discovery():
    import diffusers.models.transformers as transformers

    for row in support_table():
        if row.status == NOT_YET and row.block_lists != "—":
            assert discovery_refusal(getattr(transformers, row.model_class)), row.model_class


class _OneTensorBlock(nn.Module):
    """Reads encoder_hidden_states as cross-attention context and returns one tensor (discovery assumes a pair)."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def forward(self, hidden_states, encoder_hidden_states=None):
        return hidden_states + self.mix(hidden_states) + encoder_hidden_states.mean(1, keepdim=True)


class _CustomDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_OneTensorBlock() for _ in range(4)])

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states)
        return hidden_states


def test_a_discovered_block_that_returns_something_else_is_refused_on_the_first_call():
    torch.manual_seed(0)
    model = _CustomDiT()
    x, context = torch.randn(1, 5, 8), torch.randn(1, 3, 8)
    handle = dcache.apply(model, "fixed_interval", num_steps=4, interval=2)
    with pytest.raises(UnsupportedModelError, match=r"`blocks`: _OneTensorBlock returned Tensor"):
        model(x, context, torch.tensor([1000.0]))
    assert not any(state.units for state in handle.engine.branches.values())  # nothing was cached
    handle.remove()
    dcache.model.adapters.register_adapter(dcache.model.adapters.Adapter(
        "_CustomDiT", block_lists=(dcache.model.adapters.BlockList("blocks", encoder=None),)))
    reference = [model(x, context, torch.tensor([1000.0 - t])) for t in range(4)]
    with dcache.apply(model, "fixed_interval", num_steps=4, interval=1):  # the fix the message names works
        assert all(torch.equal(model(x, context, torch.tensor([1000.0 - t])), r) for t, r in enumerate(reference))


def test_fbcache_on_a_model_too_small_for_its_probe_suggests_an_accepted_fix():
    from diffusers import FluxTransformer2DModel

    one = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=0,
                                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                 pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    with pytest.raises(ValueError, match="fixed_interval"):
        dcache.apply(one, "fbcache", num_steps=4)
    two = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                 pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    with pytest.raises(ValueError, match="probe_blocks=1, tail_blocks=0") as err:
        dcache.apply(two, "fixed_interval", num_steps=4, probe_blocks=2, tail_blocks=0)
    assert "<= 1" in str(err.value)
    dcache.apply(two, "fixed_interval", num_steps=4, probe_blocks=1, tail_blocks=0).remove()  # the suggestion works
    dcache.apply(two, "fbcache", num_steps=4).remove()  # fbcache fits its probe to a 2-block model by itself
