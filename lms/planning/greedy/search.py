"""The search: for each prefetch variant and starting set, the longest run of the ranking that
can stay on the device, then, for the variants fastest there, the rest one by one; the best
searches refined and polished."""

from __future__ import annotations

from lms.core.plan import Plan
from lms.planning.candidates import Candidates
from lms.planning.greedy.polish import polish
from lms.planning.greedy.refine import refine
from lms.planning.greedy.shared import VARIANTS, keeping
from lms.planning.greedy.starts import cheaper_to_recompute, distinct

__all__ = ["Search"]

# Note: [A search stops at the step without offload]
# `max_simulations` bounds a search on any machine, but a search that has found a plan predicted
# within 0.1% of the step without offload has nothing left to win (each move must be faster by
# 0.1%): DenseNet-121 (247 saved storages, 384 px, batch 4, 60% of its peak on the V100 spec) found
# one at simulation 460 and searched on. It stops there; a count, as the cap is, so the same step
# still gets the same plan on any machine.
_RUNNERS_UP = 2
"""Searches refined after each starting set's fastest: its next fastest with other kept sets."""
EXTENDED = 1 + _RUNNERS_UP
"""Variants of each starting set whose longest kept prefix is extended one storage at a time:
those fastest at their prefix (Note [Extend the fastest prefixes only]): as many as a start
has searches refined."""
BEHIND = 2.0
"""Searches predicted slower than this times the fastest search are not refined (Note [Refine
the searches near the fastest])."""
_Searched = tuple[float, set[int], int, int]
"""A search's predicted step time, kept entries, swapin_ahead and sync_mode."""


class Search:
    """The greedy search over one set of candidates, within ``max_simulations`` simulations."""

    def __init__(self, candidates: Candidates, *, half: bool, max_simulations: int):
        self.candidates = candidates
        self.half = half
        self.max_simulations = max_simulations
        trace = candidates.trace
        self.entries = trace.entries()
        self._first_use = trace.first_use_op()
        self._horizon = len(trace.ops)
        self.plain_s = candidates.run(None).step_s

    def spent(self) -> bool:
        """Whether the search has run all the simulations it may, or has found a plan as fast as
        the step without offload (Note [A search stops at the step without offload])."""
        if self.candidates.simulations >= self.max_simulations:
            return True
        return self.candidates.fastest_s <= self.plain_s * 1.001

    def pressure(self, ordinal: int) -> float:
        """Device memory an entry holds kept: its bytes times the ops from its save to its
        first use in backward."""
        storage, nbytes, save_op = self.entries[ordinal]
        return nbytes * (self._first_use.get(storage, self._horizon) - save_op)

    def best(self) -> tuple[float, Plan] | None:
        """The fastest plan the search, refinement and polish find, keeping what is pinned;
        None where no search fits."""
        candidates = self.candidates
        ranking = sorted(set(range(len(self.entries))) - candidates.pinned, key=self.pressure)
        # What to recompute rather than move, where that is cheaper than its copy: three starting
        # sets, each searched. With chains (as checkpointing replays a block); each from stored
        # inputs only; and only replays bound by memory traffic, which leave the convolutions'
        # outputs to be moved and their inputs free to be recomputed.
        starts = distinct(
            set(),
            cheaper_to_recompute(candidates, self.half, chains=True),
            cheaper_to_recompute(candidates, self.half, chains=False),
            cheaper_to_recompute(candidates, self.half, chains=False, flops=False),
        )
        # Each variant is searched from each starting set. The best search of each start is refined
        # first (a greedy refinement can overtake from behind), then each start's runners-up; the
        # fastest refined plan is polished.
        prefixes: dict[int, list[tuple[float, int, int, int]]] = {}
        for ahead, sync_mode in VARIANTS:
            for number, remake in enumerate(starts):
                found = self._prefix(ranking, remake, ahead, sync_mode)
                if found is not None:
                    prefixes.setdefault(number, []).append((found[1], found[0], ahead, sync_mode))
        # Note: [Extend the fastest prefixes only]
        # After its binary search, a variant's kept set grows one storage at a time over the
        # rest of the ranking: a simulation for each storage left, for each of up to 32
        # variants and starting sets, where only each start's fastest three searches go on to
        # be refined. The variants of a start that are fastest with their longest prefix kept
        # are extended; the rest stop at their prefix. On 16 cases of nine CNNs the plans were
        # predicted as fast as with every variant extended, or faster (one), in up to a third
        # fewer simulations: benchmarks/results/README.md, "Extending the fastest prefixes".
        searched: dict[int, list[_Searched]] = {}
        for number, variants in prefixes.items():
            for _, length, ahead, sync_mode in sorted(variants)[:EXTENDED]:
                extended = self._extend(ranking, length, starts[number], ahead, sync_mode)
                if extended is not None:
                    kept, step_s = extended
                    searched.setdefault(number, []).append((step_s, kept, ahead, sync_mode))
        if not searched:
            return None
        fastest: list[tuple[int, _Searched]] = []
        runners_up: list[tuple[int, _Searched]] = []
        # Note: [Refine the searches near the fastest]
        # Each starting set's fastest searches are refined, but a start can search far behind
        # the others: DenseNet-201 (407 saved storages, 512 px, batch 32, 12 GiB on the H100
        # spec) searched 0.18 s from one start and 0.40 to 0.91 s from the rest, and refining
        # those eleven took 12,000 of its 15,219 simulations to end no nearer than 0.36 s. A
        # search predicted at more than `BEHIND` times the fastest is not refined; the
        # simulations it would have taken go to the restarts, which there found +27.3% where
        # the plan had been +45.4%. On the other cases measured, where no search lies that far
        # behind, the plans are the same (benchmarks/results/README.md, "Extending the fastest
        # prefixes").
        quickest = min(item[0] for searches in searched.values() for item in searches)
        for number, searches in searched.items():
            ranked = _other_kept_sets(sorted(searches, key=lambda item: item[0]))
            ranked = [item for item in ranked if item[0] <= quickest * BEHIND]
            if not ranked:
                continue
            fastest.append((number, ranked[0]))
            runners_up.extend((number, item) for item in ranked[1 : 1 + _RUNNERS_UP])
        refined = [
            refine(candidates, starts[number], *found, self.spent, self.pressure)
            for number, found in [
                *sorted(fastest, key=lambda item: item[1][0]),
                *sorted(runners_up, key=lambda item: item[1][0]),
            ]
        ]
        step_s, plan, _ = min(refined, key=lambda item: item[0])
        plan = polish(candidates, plan, step_s, self.spent)
        return candidates.run(plan).step_s, plan

    def _evaluate(
        self, kept: set[int], ahead: int, sync_mode: int, remake: set[int]
    ) -> float | None:
        """Predicted step time keeping ``kept`` on the device, or None if it does not fit."""
        result = keeping(self.candidates, kept, ahead, sync_mode, remake)
        return result.step_s if self.candidates.fits(result) else None

    def _prefix(
        self, ranking: list[int], remake: set[int], ahead: int, sync_mode: int
    ) -> tuple[int, float] | None:
        """The length of the longest prefix of ``ranking`` that fits kept, for one variant and
        starting set (a binary search), with its step time; None where nothing kept fits."""
        if self._evaluate(set(), ahead, sync_mode, remake) is None:
            return None
        low, high = 0, len(ranking)
        while low < high:
            middle = (low + high + 1) // 2
            if self._evaluate(set(ranking[:middle]), ahead, sync_mode, remake) is not None:
                low = middle
            else:
                high = middle - 1
        step_s = self._evaluate(set(ranking[:low]), ahead, sync_mode, remake)
        return (low, step_s) if step_s is not None else None

    def _extend(
        self, ranking: list[int], length: int, remake: set[int], ahead: int, sync_mode: int
    ) -> tuple[set[int], float] | None:
        """The first ``length`` of ``ranking`` kept, then each of the rest that still fits, one
        by one; with its step time."""
        kept = set(ranking[:length])
        for ordinal in ranking[length:]:
            if self.spent():
                break
            if self._evaluate(kept | {ordinal}, ahead, sync_mode, remake) is not None:
                kept.add(ordinal)
        step_s = self._evaluate(kept, ahead, sync_mode, remake)
        return (kept, step_s) if step_s is not None else None


def _other_kept_sets(ranked: list[_Searched]) -> list[_Searched]:
    """``ranked`` without the searches that kept the same set as a faster one."""
    return [item for i, item in enumerate(ranked) if all(item[1] != o[1] for o in ranked[:i])]
