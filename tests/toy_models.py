"""Analytic toy DiTs whose cached results are known in closed form (used by the engine tests).

ToyTransformer: two block lists, like an MM-DiT.
  * `joint_blocks[i]`  (Flux-like, returns (encoder, hidden)):  h <- h + attn(h) + ff(h), enc <- enc + a_i
        attn(h) = a_i * t * h,  ff(h) = b_i * t   (t = timestep, a scalar per sample)
  * `single_blocks[j]` (returns hidden only):                    h <- h + attn(h) + ff(h) with the same forms
Every block counts its calls, so tests can assert which blocks actually ran.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from dcache.model.adapters import ENCODER, HIDDEN, Adapter, BlockList, register_adapter


def _real(t: torch.Tensor) -> int:
    """1 for a real call, 0 inside dcache's FLOP-counting pass (which runs forwards on fake tensors)."""
    return 0 if isinstance(t, FakeTensor) else 1


class ScaleByTime(nn.Module):
    def __init__(self, a: float):
        super().__init__()
        self.a = a
        self.calls = 0

    def forward(self, hidden_states, temb):
        self.calls += _real(hidden_states)
        return self.a * temb[:, None, None] * hidden_states  # [B, L, D]


class ShiftByTime(nn.Module):
    def __init__(self, b: float):
        super().__init__()
        self.b = b
        self.calls = 0

    def forward(self, hidden_states, temb):
        self.calls += _real(hidden_states)
        return self.b * temb[:, None, None] * torch.ones_like(hidden_states)


class ToyJointBlock(nn.Module):
    def __init__(self, a: float, b: float):
        super().__init__()
        self.attn, self.ff = ScaleByTime(a), ShiftByTime(b)
        self.a = a
        self.calls = 0

    def forward(self, hidden_states, encoder_hidden_states, temb):
        self.calls += _real(hidden_states)
        out = hidden_states + self.attn(hidden_states, temb) + self.ff(hidden_states, temb)
        return encoder_hidden_states + self.a, out


class ToySingleBlock(nn.Module):
    def __init__(self, a: float, b: float):
        super().__init__()
        self.attn, self.ff = ScaleByTime(a), ShiftByTime(b)
        self.calls = 0

    def forward(self, hidden_states, temb):
        self.calls += _real(hidden_states)
        return hidden_states + self.attn(hidden_states, temb) + self.ff(hidden_states, temb)


class ToyTransformer(nn.Module):
    def __init__(self, joint=(0.1, 0.2, 0.3), single=(0.05, -0.1, 0.15)):
        super().__init__()
        self.joint_blocks = nn.ModuleList(ToyJointBlock(a, 0.5 * a) for a in joint)
        self.single_blocks = nn.ModuleList(ToySingleBlock(a, -0.5 * a) for a in single)
        self.calls = 0

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        self.calls += 1
        temb = timestep.to(hidden_states.dtype).expand(hidden_states.shape[0])
        for block in self.joint_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states=hidden_states,
                                                         encoder_hidden_states=encoder_hidden_states, temb=temb)
        for block in self.single_blocks:
            hidden_states = block(hidden_states, temb)  # positional: the adapter must find the hidden slot
        return hidden_states

    def blocks(self):
        return list(self.joint_blocks) + list(self.single_blocks)


register_adapter(Adapter(
    model_class="ToyTransformer",
    block_lists=(BlockList("joint_blocks", outputs=(ENCODER, HIDDEN)),
                 BlockList("single_blocks", encoder=None, outputs=(HIDDEN,))),
    modules=("attn", "ff"),
), overwrite=True)


def toy_inputs(step: int, num_steps: int, batch: int = 1, seed: int = 0, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = scale * torch.randn(batch, 5, 3, generator=g) + 0.01 * step
    encoder = torch.randn(batch, 2, 3, generator=g)
    t = torch.tensor([1.0 - step / num_steps])
    return {"hidden_states": hidden, "encoder_hidden_states": encoder, "timestep": t}


def toy_block_step(h: torch.Tensor, a: float, t: float) -> torch.Tensor:
    """Closed form of one toy block on hidden h at time t."""
    return h + a * t * h + 0.5 * a * t


def toy_single_step(h: torch.Tensor, a: float, t: float) -> torch.Tensor:
    return h + a * t * h - 0.5 * a * t
