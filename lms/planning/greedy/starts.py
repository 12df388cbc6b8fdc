"""The starting sets of the search: storages recomputed rather than moved where a replay is
cheaper than the copy."""

from __future__ import annotations

from lms.analysis.simulate import op_seconds
from lms.core import costs
from lms.core.recipes import recipes
from lms.planning.candidates import Candidates
from lms.planning.greedy.shared import chains_with

__all__ = ["cheaper_to_recompute", "distinct"]


def cheaper_to_recompute(
    candidates: Candidates, half: bool, *, chains: bool, flops: bool = True
) -> set[int]:
    """Tensors with a recipe that runs faster than their copy over the link, those that save
    the most time first, recomputed from one another only where ``chains`` allows (`chains_with`);
    without ``flops``, only recipes bound by memory traffic (no FLOPs counted: norms,
    activations, elementwise arithmetic; no convolutions or matrix products). Recipes that
    make unsaved storages on the way are left to the refinement, which prices their scratch
    memory: chosen here, where the copy time saved is all that counts, they crowd out chains
    that fit better."""
    found = recipes(candidates.trace)
    seconds = op_seconds(candidates.trace, candidates.spec, half)
    entries = candidates.trace.entries()
    ops = candidates.trace.ops
    saved = {
        i: costs.link_s(candidates.spec, entries[i][1]) - costs.replay_s(seconds, recipe.ops)
        for i, recipe in found.items()
        if not recipe.scratch and (flops or not any(ops[k].flops for k in recipe.ops))
    }
    chosen: set[int] = set()
    for ordinal in sorted(saved, key=lambda i: -saved[i]):  # the most copy time saved first
        if saved[ordinal] > 0 and chains_with(found, chosen, ordinal, chains=chains):
            chosen.add(ordinal)
    return chosen


def distinct(*choices: set[int]) -> list[set[int]]:
    """``choices`` without repeats, in order."""
    return [c for i, c in enumerate(choices) if c not in choices[:i]]
