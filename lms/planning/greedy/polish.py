"""The polish: single storages moved between kept, offloaded and recomputed while any move is
faster."""

from __future__ import annotations

from collections.abc import Callable

from lms.core.plan import Plan
from lms.core.recipes import recipes
from lms.planning.candidates import Candidates
from lms.planning.greedy.shared import VARIANTS, chains_with, fastest_variant

__all__ = ["polish"]


def polish(candidates: Candidates, plan: Plan, step_s: float, spent: Callable[[], bool]) -> Plan:
    """Move single tensors, largest first, between kept, offloaded and recomputed wherever that
    fits and shortens the predicted step, in passes until none does; the prefetch distance and
    sync mode are chosen again after each pass that moved one. The refinement moves tensors one
    way only (kept ones out, offloaded ones in or recomputed); a plan it leaves may still gain
    from putting back a tensor it chose to recompute, or recomputing one it kept."""
    found = recipes(candidates.trace)
    entries = candidates.trace.entries()
    offload, remade = set(plan.offload) | set(plan.recompute), set(plan.recompute)
    ahead, sync_mode = plan.swapin_ahead, plan.sync_mode
    order = sorted(set(range(len(entries))) - candidates.pinned, key=lambda i: -entries[i][1])

    def moves(ordinal: int) -> list[tuple[set[int], set[int]]]:
        """(offload, remade) with ``ordinal`` kept, offloaded or recomputed, other than now."""
        kept, out = offload - {ordinal}, offload | {ordinal}
        recomputable = ordinal in found and chains_with(
            found, remade - {ordinal}, ordinal, chains=True
        )
        options = [
            (kept, remade - {ordinal}),
            (out, remade - {ordinal}),
            *([(out, remade | {ordinal})] if recomputable else []),
        ]
        return [option for option in options if option != (offload, remade)]

    moved = True
    while moved and not spent():
        moved = False
        for ordinal in order:
            for trial_offload, trial_remade in moves(ordinal):
                if spent():
                    break
                trial = candidates.plan(
                    trial_offload,
                    ahead=ahead,
                    sync_mode=sync_mode,
                    source="planner",
                    recompute=trial_remade,
                )
                result = candidates.run(trial)
                if candidates.fits(result) and result.step_s < step_s * 0.999:
                    offload, remade, step_s = trial_offload, trial_remade, result.step_s
                    moved = True
                    break
        if moved:
            faster = fastest_variant(candidates, list(offload), remade, VARIANTS, step_s, spent)
            if faster is not None:
                step_s, ahead, sync_mode = faster
    return candidates.plan(
        offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
    )
