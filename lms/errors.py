"""Typed errors. Each message says what failed, gives the numbers, and ends with what to do."""

from __future__ import annotations

__all__ = [
    "LMSError",
    "SpillError",
    "HostMemoryError",
    "PlanInfeasibleError",
    "StepAbortedError",
]


class LMSError(RuntimeError):
    """Base class of every error the library raises on purpose."""


class SpillError(LMSError):
    """The spill directory cannot be used: not writable, or the disk is full."""


class HostMemoryError(LMSError):
    """Offloaded data does not fit in the host memory allowed for it."""


class StepAbortedError(LMSError):
    """Backward asked for a tensor whose offloaded copy was discarded when its step failed."""


class PlanInfeasibleError(LMSError):
    """No plan fits the budget: names the operation that cannot fit and the smallest budget."""

    def __init__(self, message: str, *, op_name: str, op_bytes: int, min_budget_bytes: int):
        super().__init__(message)
        self.op_name = op_name
        self.op_bytes = op_bytes
        self.min_budget_bytes = min_budget_bytes
