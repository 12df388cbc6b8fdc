"""`SyncMode`: how a step waits for its copies (TFLMS's sync modes 0 to 3)."""

from __future__ import annotations

import enum

__all__ = ["SyncMode"]


class SyncMode(enum.IntEnum):
    """How a step waits for its copies; the values are TFLMS's sync modes, so a plan or a config
    may give the integer."""

    ASYNC = 0
    """Copies out and in overlap compute; tensors come back ahead of their use."""
    WAIT_OUT = 1
    """Each copy out is waited for as soon as it starts."""
    ON_DEMAND = 2
    """No prefetch: each tensor is copied in when backward needs it."""
    WAIT_BOTH = 3
    """Both: copies out waited for, copies in on demand."""

    @property
    def waits_out(self) -> bool:
        """Whether each copy out is waited for (modes 1 and 3)."""
        return self in (SyncMode.WAIT_OUT, SyncMode.WAIT_BOTH)

    @property
    def on_demand(self) -> bool:
        """Whether copies in happen on demand only (modes 2 and 3)."""
        return self in (SyncMode.ON_DEMAND, SyncMode.WAIT_BOTH)
