"""Per-family adapter data for diffusers transformers (registered on import by dcache.adapters).

One `register_adapter(Adapter(...))` per transformer class, checked against diffusers 0.42 source. For each family:

- `block_lists`: only the `ModuleList`s that run inside the main denoising pass over the latent token stream, in
  execution order. Refiner lists that run first over a *different* token set (text-only context refiners, image-only
  noise refiners, VACE control blocks) are left out and named in `notes`: reuse of the main stack stays correct
  because they run before it on every call.
- `hidden` / `encoder`: the block-forward argument names. `encoder` is set only where the block RETURNS an updated
  text stream; a cross-attention context the block only reads is not a stream (encoder=None), so reuse leaves it be.
- `outputs`: the order of the block's returned tensors (Flux-style blocks return (encoder, hidden); HunyuanVideo /
  CogVideoX-style return (hidden, encoder); single-stream and cross-attention blocks return hidden alone).
- `modules`: inner units whose output can be cached and returned as-is. A module that a block calls more than once
  (one FFN shared by the text and image streams: CogView4, EasyAnimate) is also listed in `shared`, and gets one
  cache per call within the block.
- `modulated_input`: TeaCache's signal, the timestep-modulated input of the first block, computed from that block's
  bound forward arguments without side effects (TeaCache, arXiv 2411.19108). None where the family has no AdaLN-style
  modulation of the hidden stream.

Tiny configs of every family here live in tests/zoo.py; tests/test_zoo.py checks this data against real forwards.

The registry, in this order: `named.py` (the families the project names first), then `further.py` (the rest,
alphabetically); `inputs.py` holds what they share (modulated inputs, latent layouts).
"""

from . import named  # noqa: F401  (registers on import: these families first)
from . import further  # noqa: F401  (registers on import: the rest)
