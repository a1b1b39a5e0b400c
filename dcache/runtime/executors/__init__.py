"""One executor per unit kind (dcache.runtime.executors.base.UnitExecutor): stack, block, module, call."""

from __future__ import annotations

from ...actions import Granularity
from .base import UnitExecutor
from .block import BlockExecutor
from .call import CallExecutor
from .module import ModuleExecutor
from .stack import StackExecutor

EXECUTORS: dict[str, type[UnitExecutor]] = {"stack": StackExecutor, "block": BlockExecutor,
                                            "module": ModuleExecutor, "call": CallExecutor}


def executor_kind(granularity: Granularity, call_scope: bool) -> str:
    """The unit kind of a schedule's granularity and scope (call scope: the whole call, whatever the rows say)."""
    return "call" if call_scope else granularity.value


__all__ = ["EXECUTORS", "UnitExecutor", "StackExecutor", "BlockExecutor", "ModuleExecutor", "CallExecutor",
           "executor_kind"]
