"""What dcache relies on in its dependencies beyond their public API, in one place per dependency.

`diffusers.py`: the hook registry's internals, `cache_context` delivery, diffusers' own caches, context parallel,
how pipelines call their transformer. `torch.py`: whether a torch.compile region is running. No other core module
uses a private name of either; `tests/compat/test_diffusers_contract.py` checks each assumption against the
installed versions, so an upgrade that breaks one fails there, naming it.
"""
