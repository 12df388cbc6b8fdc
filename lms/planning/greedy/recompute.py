"""The recompute passes: offloaded storages recomputed instead, one at a time, then two or
three at once."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from lms.core.recipes import recipes
from lms.planning.candidates import Candidates
from lms.planning.greedy.shared import VARIANTS, chains_with, fastest_variant, held_bytes

__all__ = ["combine", "recompute_pass"]

_COMBINED = 8
"""Offloaded tensors (the largest) whose pairs and triples are tried recomputed together."""


def recompute_pass(
    candidates: Candidates,
    offload: list[int],
    ahead: int,
    sync_mode: int,
    step_s: float,
    spent: Callable[[], bool],
    remade: set[int],
) -> tuple[set[int], float]:
    """Starting from ``remade``, recompute instead of moving, largest first, each offloaded
    tensor that has a recipe where that still fits and shortens the predicted step, or leaves
    it as it was and holds less offloaded data (host memory and spill files: one such change
    alone may not shorten a step that waits on a disk, several together do)."""
    found = recipes(candidates.trace)
    entries = candidates.trace.entries()
    plan = candidates.plan(
        offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
    )
    held = held_bytes(candidates.run(plan))
    recomputable = [i for i in offload if i in found]
    # Recipes that make unsaved storages on the way come last: taken first, they may crowd out
    # chains that fit better.
    for ordinal in sorted(recomputable, key=lambda i: (bool(found[i].scratch), -entries[i][1])):
        if spent():
            break
        if ordinal in remade or not chains_with(found, remade, ordinal, chains=True):
            continue
        trial = remade | {ordinal}
        plan = candidates.plan(
            offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=trial
        )
        result = candidates.run(plan)
        if not candidates.fits(result):
            continue
        faster = result.step_s < step_s * 0.999
        if faster or (result.step_s <= step_s and held_bytes(result) < held):
            remade, step_s, held = trial, min(step_s, result.step_s), held_bytes(result)
    return remade, step_s


def combine(
    candidates: Candidates,
    offload: list[int],
    remade: set[int],
    ahead: int,
    sync_mode: int,
    step_s: float,
    spent: Callable[[], bool],
) -> tuple[set[int], int, int, float]:
    """Recompute two or three more offloaded tensors at once, with each prefetch distance,
    where that is faster: one alone may not fit or not pay (recomputing a block's output
    needs memory in backward that recomputing its neighbours frees). The largest
    `_COMBINED` candidates are tried; the fastest combination wins."""
    found = recipes(candidates.trace)
    entries = candidates.trace.entries()
    largest = sorted(
        (i for i in offload if i in found and i not in remade), key=lambda i: -entries[i][1]
    )[:_COMBINED]
    variants = [(a, sync_mode) for a in sorted({ahead, *(a for a, s in VARIANTS if s == 0)})]
    best = remade
    for size in (2, 3):
        for combination in itertools.combinations(largest, size):
            if spent():
                return best, ahead, sync_mode, step_s
            chosen = set(remade)  # each combination beside what was recomputed before
            for ordinal in combination:
                if not chains_with(found, chosen, ordinal, chains=True):
                    break
                chosen.add(ordinal)
            else:
                faster = fastest_variant(candidates, offload, chosen, variants, step_s, spent)
                if faster is not None:
                    (step_s, ahead, _), best = faster, chosen
    return best, ahead, sync_mode, step_s
