"""What dcache relies on in its dependencies beyond their public API, in one place per dependency.

`diffusers.py`: the hook registry's internals, `cache_context` delivery, diffusers' own caches, context parallel,
how pipelines call their transformer, where a model was loaded from, Qwen-Image's modulation. `torch.py`: whether a
torch.compile region is running, pytrees, fake tensors, tensor version counters and view bases, a fused lerp.
`accelerate.py`: the forward accelerate's offload hook wraps. No other module of the package uses a private name
of any of them (`tests/meta/test_private_api.py`); `tests/compat/test_diffusers_contract.py`,
`test_torch_contract.py` and `test_accelerate_contract.py` check each assumption against the installed versions, so
an upgrade that breaks one fails there, naming it.
"""
