"""State files: what dcache writes to resume work (eval records, search checkpoints), without pickle.

    save_state(path, {"theta": tensor, "iteration": 3, "done": {0.8: tensor}}, kind="router checkpoint")
    state = load_state(path, kind="router checkpoint", fix="delete it, or pass --restart")

One file = one safetensors file: the tensors (and numpy arrays) as named tensors, the rest of the structure as JSON in
the header's metadata, with a placeholder where each tensor goes. Loading parses the JSON header and the raw tensor
bytes; nothing in the file can run code (a pickle, which `torch.load(weights_only=False)` and `pickle.load` would
execute, is refused with the file's name and the fix). Written atomically (dcache.files.atomic).

Encoded: None, bool, int, float (NaN / inf included), str, list, tuple, dict (any keys of these types), torch
tensors, numpy arrays and numpy scalars. Anything else is a TypeError at save time, never a surprise at load time.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .atomic import atomic_write_bytes, read_limited

FORMAT = "dcache.state"
VERSION = 1
MAX_HEADER_BYTES = 1 << 28  # a safetensors header larger than 256 MiB is not one dcache wrote
# The largest state file read back: an eval record holds one item's images in float32 (a 81-frame 720p video is
# 81 x 3 x 720 x 1280 x 4 B = 0.9 GB) and a DisCa checkpoint its weights and two Adam moments (~1.7 GB for every
# cached tensor of a 12B model); a larger file is refused from its size, before it is read.
MAX_STATE_BYTES = 4 << 30
_TENSOR, _ARRAY, _TUPLE, _ITEMS = "$tensor", "$ndarray", "$tuple", "$items"


class StateFileError(ValueError):
    """A state file that cannot be read back; the message names the file and what to do."""


def save_state(path: str | os.PathLike, obj: Any, kind: str) -> Path:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    data = _encode(obj, tensors)
    meta = {"format": FORMAT, "version": str(VERSION), "kind": kind, "data": json.dumps(data)}
    return atomic_write_bytes(path, save(tensors, metadata=meta))


def load_state(path: str | os.PathLike, kind: str, fix: str) -> Any:
    """The object saved by save_state(path, obj, kind); StateFileError naming `path` and `fix` otherwise."""
    from safetensors.torch import load

    path = Path(path)
    raw = read_limited(path, MAX_STATE_BYTES, kind, fix, StateFileError)
    if is_pickle(raw):
        raise StateFileError(pickle_message(path, kind, fix))
    meta = _metadata(raw)
    if meta is None or meta.get("format") != FORMAT:
        raise StateFileError(f"{str(path)!r} is not a dcache {kind} (no dcache state header: corrupted, truncated "
                             f"or another program's file); {fix}.")
    if meta.get("kind") != kind or meta.get("version") != str(VERSION):
        raise StateFileError(f"{str(path)!r} is a dcache {meta.get('kind')!r} file of version "
                             f"{meta.get('version')!r}, not a {kind} of version {VERSION}; {fix}.")
    try:
        tensors = load(raw)
        return _decode(json.loads(meta["data"]), tensors)
    except Exception as exc:  # safetensors' and json's own errors, a missing tensor: the file is unusable
        raise StateFileError(f"the {kind} {str(path)!r} is damaged ({str(exc)[:160]}); {fix}.") from None


# How a pickle starts: protocol 2-5 with PROTO (0x80) and the protocol number; protocols 0-1 with an opcode that
# opens their first object: MARK '(', EMPTY_LIST ']', EMPTY_DICT '}', EMPTY_TUPLE ')'.
_PICKLE_STARTS = tuple(b"\x80" + bytes([p]) for p in range(2, 6)) + (b"(", b"]", b"}", b")")
_ZIP_START = b"PK\x03\x04"  # torch.save's zip archive (a pickle inside)


def is_pickle(raw: bytes) -> bool:
    """A pickle stream or torch.save's zip archive of one. A safetensors file is told apart by its structure first:
    a little-endian u64 header length n that fits the file, then a JSON object ('{'). Its first byte is n's lowest
    byte, so it can be 0x80 (or '(' ...) for some header sizes: a test of the first byte alone refuses real files."""
    if looks_like_safetensors(raw):
        return False
    return raw.startswith(_PICKLE_STARTS) or raw.startswith(_ZIP_START)


def looks_like_safetensors(raw: bytes) -> bool:
    """The safetensors layout without parsing it: u64 header length n with 2 <= n <= len - 8, and '{' at byte 8."""
    if len(raw) < 10:
        return False
    (n,) = struct.unpack("<Q", raw[:8])
    return 2 <= n <= len(raw) - 8 and raw[8:9] == b"{"


def pickle_message(path: Path, kind: str, fix: str) -> str:
    return (f"{str(path)!r} is a pickle (an older dcache's {kind}, or a file put there by someone else): dcache does "
            f"not load pickles from output folders, since loading one can run any code; {fix}.")


def refuse_legacy(path: Path, kind: str, fix: str) -> None:
    """Raise when `path` (the file name an older dcache pickled this state to) exists; it is never opened."""
    if path.exists():
        raise StateFileError(f"{str(path)!r} is an older dcache's {kind} (a pickle): dcache does not load pickles "
                             f"from output folders, since loading one can run any code; {fix}.")


def safetensors_header(raw: bytes) -> dict | None:
    """The JSON header of safetensors bytes ({name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}),
    parsed without touching the tensor bytes; None when `raw` does not start with one."""
    if len(raw) < 8:
        return None
    (n,) = struct.unpack("<Q", raw[:8])
    if n > min(len(raw) - 8, MAX_HEADER_BYTES):
        return None
    try:
        header = json.loads(raw[8:8 + n])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return header if isinstance(header, dict) else None


def _metadata(raw: bytes) -> dict | None:
    header = safetensors_header(raw)
    meta = header.get("__metadata__") if header is not None else None
    return meta if isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()) else None


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().to("cpu", copy=True).contiguous()  # own storage: safetensors refuses shared
        return {_TENSOR: name}
    if isinstance(obj, np.ndarray):
        name = f"t{len(tensors)}"
        tensors[name] = torch.from_numpy(np.array(obj, copy=True, order="C"))
        return {_ARRAY: name}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"save_state cannot store a {type(obj).__name__}; store its data (tensors, numbers, strings, "
                    f"lists, dicts) instead.")


def _decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(data, list):
        return [_decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (key, value), = data.items()
        if key == _TENSOR:
            return tensors[value]
        if key == _ARRAY:
            return tensors[value].numpy()
        if key == _TUPLE:
            return tuple(_decode(v, tensors) for v in value)
        if key == _ITEMS:
            return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value}
    return {k: _decode(v, tensors) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor, np.ndarray)):
        raise ValueError(f"a dict key of type {type(key).__name__}")
    return key


__all__ = ["StateFileError", "save_state", "load_state", "refuse_legacy", "is_pickle", "looks_like_safetensors",
           "safetensors_header", "MAX_STATE_BYTES"]
