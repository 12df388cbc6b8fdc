"""The trade pass: keep offloaded storages, largest first, swapping out a kept one where that
no longer fits."""

from __future__ import annotations

from collections.abc import Callable

from lms.analysis.simulate import SimResult
from lms.planning.candidates import Candidates
from lms.planning.greedy.shared import keeping

__all__ = ["trade"]

_SWAP_TRIES = 4
"""Kept entries tried in place of each offloaded one (the smallest that cover the excess)."""


def trade(
    candidates: Candidates,
    kept: set[int],
    step_s: float,
    ahead: int,
    sync_mode: int,
    remake: set[int],
    spent: Callable[[], bool],
) -> tuple[set[int], float]:
    """Keep offloaded entries, largest first, while that shortens the step; where one no longer
    fits, offload in its place a kept entry resident at the new peak and large enough to cover
    the excess (the smallest few of those are tried). Rounds repeat while one improves."""
    trace = candidates.trace
    entries = trace.entries()
    everything = range(len(entries))
    uses = trace.use_ops()
    horizon = len(trace.ops)
    resident = {  # from its save to its last read in backward, while kept
        i: (save_op, (uses.get(storage) or [horizon])[-1])
        for i, (storage, _, save_op) in enumerate(entries)
    }

    def run(keep: set[int]) -> SimResult:
        return keeping(candidates, keep, ahead, sync_mode, remake)

    improved = True
    while improved and not spent():
        improved = False
        for outside in sorted(set(everything) - kept, key=lambda i: -entries[i][1]):
            if spent():
                break
            trial = kept | {outside}
            result = run(trial)
            if not candidates.fits(result):
                excess, peak = result.peak_bytes - candidates.budget_bytes, result.peak_op
                room = [
                    i
                    for i in kept
                    if entries[i][1] >= excess and resident[i][0] <= peak <= resident[i][1]
                ]
                for inside in sorted(room, key=lambda i: entries[i][1])[:_SWAP_TRIES]:
                    result = run(trial - {inside})
                    if candidates.fits(result) and result.step_s < step_s * 0.999:
                        trial = trial - {inside}
                        break
            if candidates.fits(result) and result.step_s < step_s * 0.999:
                kept, step_s, improved = trial, result.step_s, True
    return kept, step_s
