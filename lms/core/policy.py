"""What the runtime offloads and prefetches when it has no plan from the tuner: pure functions.

The runtime keeps the most recently saved tensors on the device (backward needs them first) and
moves older ones out when the budget or the swapout threshold demands it. It records the order
and sizes of the first step (`StepRecord`) and from the second step on decides at save time.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["StepRecord", "threshold_lag", "budget_offloads", "threshold_offloads", "reserve_bytes"]

RESERVE_FACTOR = 4
BACKWARD_RESERVE_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """The saved-tensor events of one step, per stored storage in the order they were created."""

    save_level: tuple[int, ...]
    """Level (position in the event sequence) at which each storage was first saved."""
    nbytes: tuple[int, ...]
    """Bytes of each storage."""
    first_use_level: tuple[int | None, ...]
    """Level of each storage's first read in backward; None when backward never read it."""
    held: frozenset[int] = frozenset()
    """Ordinals of storages that a save kept in place (inside `lms.no_offload`) also held."""

    @property
    def use_order(self) -> list[int]:
        """Storage ordinals in the order backward first read them (never-read ones last)."""
        used = [i for i, level in enumerate(self.first_use_level) if level is not None]
        used.sort(key=lambda i: self.first_use_level[i])  # type: ignore[arg-type, return-value]
        return used

    def distance(self, ordinal: int) -> float:
        """Levels from the save of ``ordinal`` to its first use; infinite when never used."""
        use = self.first_use_level[ordinal]
        return math.inf if use is None else use - self.save_level[ordinal]


def threshold_lag(swapout_threshold: int) -> int:
    """Saves that must follow a tensor before its distance surely reaches the threshold.

    Reading back in reverse save order, the tensor saved ``k`` saves before the last one has
    distance ``2k + 1``; so once ``lag`` newer tensors were saved it is offloaded.
    """
    return max(0, math.ceil((swapout_threshold - 1) / 2))


def reserve_bytes(largest_bytes: int, *, backward: bool = False) -> int:
    """Device memory kept free for the running op and the gradients of backward.

    In forward (and at the turn to backward, where the loss's gradient meets the last saved
    tensors) four times the largest saved tensor; once backward runs, three: the gradient in, the
    gradient out and one temporary of the backward formula, the saved inputs being counted apart.
    """
    return (BACKWARD_RESERVE_FACTOR if backward else RESERVE_FACTOR) * largest_bytes


def budget_offloads(
    nbytes: list[int] | tuple[int, ...],
    allowance_bytes: int,
    held: frozenset[int] | set[int] = frozenset(),
) -> set[int]:
    """Ordinals to offload so that resident saved bytes never exceed ``allowance_bytes``.

    Replays the forward pass, keeping the newest tensors and evicting the oldest first, exactly as
    the runtime does when it has no record. Storages in ``held`` stay and count as kept saves do
    (not at all): moving one frees nothing.
    """
    offload: set[int] = set()
    resident: list[int] = []
    resident_bytes = 0
    for ordinal, size in enumerate(nbytes):
        if ordinal in held:
            continue
        resident.append(ordinal)
        resident_bytes += size
        while resident and resident_bytes > allowance_bytes:
            oldest = resident.pop(0)
            resident_bytes -= nbytes[oldest]
            offload.add(oldest)
    return offload


def threshold_offloads(record: StepRecord, swapout_threshold: int) -> set[int]:
    """Ordinals whose recorded distance reaches ``swapout_threshold`` (held ones stay)."""
    return {
        i
        for i in range(len(record.nbytes))
        if record.distance(i) >= swapout_threshold and i not in record.held
    }
