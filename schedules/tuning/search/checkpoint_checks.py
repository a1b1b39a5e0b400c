"""What a search checkpoint must hold, checked before a resume builds anything from it.

A checkpoint that parses (dcache.files.state_file) can still hold other data than the search wrote: edited by hand,
written by another version, copied from another search. Every field is tested here for its type, its range and its
shape against the running search, so a damaged file is a StateFileError naming it and the fix, before any allocation
that its numbers size (a population of 10**7, 20,000 initial genomes) and never a raw KeyError / TypeError later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dcache.files.checks import is_count, is_number, same
from dcache.files.state_file import StateFileError

FIX = "delete it to start over (or run without --resume), or pass a new --out"


def damaged(ckpt: Path, kind: str, detail: str) -> StateFileError:
    return StateFileError(f"the {kind} {str(ckpt)!r} is damaged or is not this search's ({detail}); {FIX}.")


def field(data: Any, key: str, ckpt: Path, kind: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise damaged(ckpt, kind, f"it has no {key!r}")
    return data[key]


def check_tensor(value: Any, shape: Sequence[int], name: str, ckpt: Path, kind: str, *,
                 low: float = -np.inf) -> torch.Tensor:
    """A finite floating tensor of exactly `shape` (every value >= low)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise damaged(ckpt, kind, f"{name} is a {type(value).__name__}, not a float tensor")
    if tuple(value.shape) != tuple(shape):
        raise damaged(ckpt, kind, f"{name} has shape {tuple(value.shape)}, this search needs {tuple(shape)}")
    if not torch.isfinite(value).all() or (value.numel() and float(value.min()) < low):
        raise damaged(ckpt, kind, f"{name} holds values that are not finite or below {low}")
    return value


def check_adam(state: Any, params: Sequence[torch.Tensor], fresh: dict, name: str, ckpt: Path, kind: str) -> None:
    """An Adam / AdamW state_dict for `params`: the fresh optimizer's groups (settings equal: the config matched) and
    per-parameter moments of each parameter's shape; torch checks only the group count and fails at the next step."""
    groups = field(state, "param_groups", ckpt, kind)
    moments = field(state, "state", ckpt, kind)
    good = fresh["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(good) or not all(
            isinstance(g, dict) and set(g) <= set(f) and all(same(g[k], f[k]) for k in g)
            for g, f in zip(groups, good)):
        raise damaged(ckpt, kind, f"{name}'s settings are not those of this config")
    if not isinstance(moments, dict) or not set(moments) <= set(range(len(params))):
        raise damaged(ckpt, kind, f"{name} holds moments of parameters this model does not have")
    for i, m in moments.items():
        if not isinstance(m, dict) or set(m) != {"step", "exp_avg", "exp_avg_sq"}:
            raise damaged(ckpt, kind, f"{name}'s state of parameter {i} is not Adam's (step, exp_avg, exp_avg_sq)")
        step = m["step"]
        if isinstance(step, torch.Tensor):
            step = float(step) if step.numel() == 1 and step.is_floating_point() else None
        if not is_number(step, 0):
            raise damaged(ckpt, kind, f"{name}'s step count of parameter {i} is not a number >= 0")
        check_tensor(m["exp_avg"], params[i].shape, f"{name}'s exp_avg of parameter {i}", ckpt, kind)
        check_tensor(m["exp_avg_sq"], params[i].shape, f"{name}'s exp_avg_sq of parameter {i}", ckpt, kind, low=0.0)


def check_weights(state: Any, model: torch.nn.Module, name: str, ckpt: Path, kind: str) -> None:
    """A state_dict with exactly the model's tensor names and shapes, finite."""
    wanted = model.state_dict()
    if not isinstance(state, dict) or set(state) != set(wanted):
        raise damaged(ckpt, kind, f"{name} holds other tensors than this model's")
    for key, value in state.items():
        check_tensor(value, wanted[key].shape, f"{name}[{key!r}]", ckpt, kind)


# ------------------------------------------------------------------------------------------------ ECAD
def check_ecad(data: Any, ckpt: Path, kind: str, *, n_var: int, max_pop: int, max_generations: int,
               genome_key) -> None:
    """The ECAD state (ecad._State.to_data) for a genome of n_var bits: bounds before NSGA-II is rebuilt from it,
    and every archive entry filed under the key of its own genome (a copied entry would score another plan). The
    caller has compared x0's width and the genome settings with the running search (their own messages)."""
    settings = field(data, "settings", ckpt, kind)
    pop = field(settings, "pop_size", ckpt, kind)
    if not is_count(pop, 4, max_pop):
        raise damaged(ckpt, kind, f"pop_size {pop!r} is not an int in 4..{max_pop}")
    bounds = {"seed": (0, 2**32 - 1), "crossover_points": (1, max(n_var, 1))}
    for key, (lo, hi) in bounds.items():
        if not is_count(field(settings, key, ckpt, kind), lo, hi):
            raise damaged(ckpt, kind, f"{key} {settings[key]!r} is not an int in {lo}..{hi}")
    for key in ("crossover_prob", "mutation_prob", "mutation_bits"):
        if not is_number(field(settings, key, ckpt, kind), 0.0, 1.0):
            raise damaged(ckpt, kind, f"{key} {settings[key]!r} is not a probability")
    x0 = field(data, "x0", ckpt, kind)
    if not isinstance(x0, np.ndarray) or x0.dtype != np.bool_ or x0.ndim != 2:
        raise damaged(ckpt, kind, "x0 (the initial population) is not a 2-d array of bits")
    if x0.shape[1] == n_var and x0.shape[0] != pop:  # another width: the caller names the other model / steps
        raise damaged(ckpt, kind, f"x0 has {x0.shape[0]} genomes, pop_size is {pop}")
    if not is_count(field(data, "generation", ckpt, kind), 0, max_generations):
        raise damaged(ckpt, kind, f"generation {data['generation']!r} is not an int in 0..{max_generations}")
    seeds = field(data, "seeds", ckpt, kind)
    if not isinstance(seeds, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in seeds.items()):
        raise damaged(ckpt, kind, "seeds is not a table of names to genome keys")
    archive = field(data, "archive", ckpt, kind)
    if not isinstance(archive, dict):
        raise damaged(ckpt, kind, "archive is not a table of scored genomes")
    size = (n_var + 7) // 8
    for key, e in archive.items():
        if not isinstance(e, dict) or not is_number(e.get("quality")) or not is_number(e.get("compute_ratio"), 0, 1) \
                or not isinstance(e.get("metrics"), dict):
            raise damaged(ckpt, kind, f"archive entry {str(key)[:12]!r} lacks a numeric quality, a compute ratio in "
                                      f"[0, 1] or its metrics")
        g = e.get("genome")
        if not isinstance(g, np.ndarray) or g.dtype != np.uint8 or g.shape != (size,):
            raise damaged(ckpt, kind, f"archive entry {str(key)[:12]!r} holds no genome of {n_var} bits")
        if key != genome_key(np.unpackbits(g)[:n_var].astype(bool)):
            raise damaged(ckpt, kind, f"archive entry {str(key)[:12]!r} holds the score of another genome")
