"""The refinement of one search's plan: trade, recompute more, then keep what that freed room
for."""

from __future__ import annotations

from collections.abc import Callable

from lms.core.plan import Plan
from lms.planning.candidates import Candidates
from lms.planning.greedy.recompute import combine, recompute_pass
from lms.planning.greedy.shared import VARIANTS, fastest_variant
from lms.planning.greedy.trade import trade

__all__ = ["refine"]

_RECOMPUTE_ROUNDS = 3
"""Rounds of the recompute pass, each after the prefetch distance is chosen again."""


def refine(
    candidates: Candidates,
    remake: set[int],
    step_s: float,
    kept: set[int],
    ahead: int,
    sync_mode: int,
    spent: Callable[[], bool],
    pressure: Callable[[int], float],
) -> tuple[float, Plan, set[int]]:
    """Trade kept and offloaded entries, recompute more (choosing the prefetch distance and
    sync mode again after each round that changed anything), then keep what that freed room
    for."""
    kept, step_s = trade(candidates, kept, step_s, ahead, sync_mode, remake, spent)
    offload = [i for i in range(candidates.num_entries) if i not in kept]
    remade = remake.intersection(offload)
    for _ in range(_RECOMPUTE_ROUNDS):
        more, step_s = recompute_pass(candidates, offload, ahead, sync_mode, step_s, spent, remade)
        if more == remade:
            break
        remade = more
        faster = fastest_variant(candidates, offload, remade, VARIANTS, step_s, spent)
        if faster is not None:
            step_s, ahead, sync_mode = faster
    remade, ahead, sync_mode, step_s = combine(
        candidates, offload, remade, ahead, sync_mode, step_s, spent
    )
    for ordinal in sorted(set(offload) - remade, key=pressure):
        if spent():
            break
        fewer = [i for i in offload if i != ordinal]
        result = candidates.run(
            candidates.plan(
                fewer, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
            )
        )
        if candidates.fits(result) and result.step_s < step_s * 0.999:
            offload, step_s = fewer, result.step_s
            kept.add(ordinal)
    plan = candidates.plan(
        offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
    )
    return step_s, plan, kept
