"""Context parallel: every rank takes the same caching decision.

Under context parallelism (diffusers `transformer.enable_parallelism(config=ContextParallelConfig(...))`) each rank
holds an equal shard of the tokens between the model's input split and its output gather, so every signal the engine
measures on hidden states is rank-local. Decided on rank-local signals, one rank could reuse while another computes:
the ranks' collectives inside attention then pair up wrongly (a hang) or mix stale and fresh shards (garbage).

`sync_signals` makes the signals global with one all-reduce of the small signal vector per call, over the group that
shards the tokens. How each signal combines follows from how it is formed (`SignalMeter.read`,
dcache/runtime/signal_meter.py):
  * 2-element [numerator, denominator] pairs are sums over the tokens (rel_l1_stats, residual_capture's
    [sum|r - prev|, sum|prev|]): summed over the ranks, num / den is exactly the single-process ratio;
  * 1-element values are means over the tokens (mean|x - x_prev|, mean|v|, mean token norm ratio): averaged over the
    ranks, they are the single-process mean, because diffusers shards into equal parts (EquipartitionSharder asserts
    the token count divides by the mesh size).
Every rank then holds bit-identical values (the all-reduce result is the same on all ranks) and decides alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def token_group(transformer: nn.Module) -> dist.ProcessGroup | None:
    """The process group that shards this transformer's tokens (diffusers context parallel), else None."""
    # imported here: method files import this module, and `dcache methods` must start without diffusers
    from ..compat.diffusers import context_parallel_mesh

    mesh = context_parallel_mesh(transformer)  # ring x ulysses, flattened: every rank holding a token shard
    if mesh is None or mesh.size() == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return mesh.get_group()


def sync_signals(flat: torch.Tensor, tensors: list[torch.Tensor], transformer: nn.Module) -> torch.Tensor:
    """flat = cat(tensors) made global over the token shards: pairs summed, single values averaged.

    Returns `flat` untouched (no copy, no collective) when the transformer is not context parallel.
    """
    group = token_group(transformer)
    if group is None:
        return flat
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # flat is a fresh torch.cat: reducing in place is safe
    world = dist.get_world_size(group)
    # [N]: 1 for the entries of [numerator, denominator] pairs (sums), 1 / world for single means
    scale = torch.cat([torch.full((t.numel(),), 1.0 if t.numel() == 2 else 1.0 / world) for t in tensors])
    return flat * scale.to(flat.device)
