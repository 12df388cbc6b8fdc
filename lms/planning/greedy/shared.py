"""What the greedy planner's passes share: the prefetch variants it tries, a plan that keeps
a set, the fastest variant of a plan, and which replays may run beside which."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lms.analysis.simulate import SimResult
from lms.core.recipes import Recipe
from lms.planning.candidates import Candidates

__all__ = ["VARIANTS", "chains_with", "fastest_variant", "held_bytes", "keeping"]

VARIANTS = ((1, 0), (2, 0), (4, 0), (8, 0), (1, 1), (2, 1), (1, 2), (1, 3))
"""(swapin_ahead, sync_mode) pairs the planner searches."""


def keeping(
    candidates: Candidates, kept: set[int], ahead: int, sync_mode: int, remake: set[int]
) -> SimResult:
    """Simulate keeping ``kept`` on the device, recomputing ``remake`` and offloading the rest."""
    offload = [i for i in range(candidates.num_entries) if i not in kept]
    plan = candidates.plan(
        offload,
        ahead=ahead,
        sync_mode=sync_mode,
        source="planner",
        recompute=remake.difference(kept),
    )
    return candidates.run(plan)


def fastest_variant(
    candidates: Candidates,
    offload: list[int],
    remade: set[int],
    variants: Sequence[tuple[int, int]],
    step_s: float,
    spent: Callable[[], bool],
) -> tuple[float, int, int] | None:
    """The fastest of ``variants`` ((swapin_ahead, sync_mode) pairs) for offloading
    ``offload`` and recomputing ``remade`` that fits and beats ``step_s``: its step time and
    pair; None where none does."""
    best = None
    for ahead, sync_mode in variants:
        if spent():
            break
        plan = candidates.plan(
            offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
        )
        result = candidates.run(plan)
        if candidates.fits(result) and result.step_s < step_s * 0.999:
            best, step_s = (result.step_s, ahead, sync_mode), result.step_s
    return best


def held_bytes(result: SimResult) -> int:
    return result.host_peak_bytes + result.disk_peak_bytes


def chains_with(found: dict[int, Recipe], chosen: set[int], ordinal: int, *, chains: bool) -> bool:
    """Whether ``ordinal`` may be recomputed beside ``chosen``: with ``chains``, where each
    recomputed input of one is one backward reads no earlier; without, where none is."""
    recipe = found[ordinal]
    if not chains:
        return not set(recipe.inputs) & chosen and not any(
            ordinal in found[other].inputs for other in chosen
        )
    return all(source in recipe.chainable for source in set(recipe.inputs) & chosen) and all(
        ordinal in found[other].chainable for other in chosen if ordinal in found[other].inputs
    )
