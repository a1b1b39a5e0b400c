"""Type and range tests for values read back from files (plans, calibration files, resume state, batch markers).

JSON and state files hand back whatever was written: `true` where a count belongs (bool is an int subclass), a
string where a number belongs, an integer too large for a float, NaN. The readers test each field with these before
using it, and raise their own error naming the file and the field.
"""

from __future__ import annotations

import math
from typing import Any


def is_number(v: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """A finite int or float (not a bool) in [low, high]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        f = float(v)
    except OverflowError:  # an int beyond the float range
        return False
    return math.isfinite(f) and low <= f <= high


def is_count(v: Any, low: int = 0, high: float = math.inf) -> bool:
    """An int (not a bool) in [low, high]."""
    return type(v) is int and low <= v <= high  # noqa: E721 - bool is an int subclass, never a count


def is_numbers(v: Any, low: float = -math.inf, high: float = math.inf, max_len: float = math.inf) -> bool:
    """A list of at most max_len numbers, each is_number(x, low, high)."""
    return isinstance(v, list) and len(v) <= max_len and all(is_number(x, low, high) for x in v)


def same(a: Any, b: Any) -> bool:
    """a == b as one bool for any two values read back: arrays and tensors compare elementwise, which `if a != b`
    cannot use (ambiguous truth value); such a comparison, or one that raises, counts as different."""
    try:
        return bool(a == b)
    except (ValueError, RuntimeError, TypeError):
        return False


__all__ = ["is_number", "is_count", "is_numbers", "same"]
