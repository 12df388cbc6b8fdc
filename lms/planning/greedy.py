"""The per-tensor planner: keep what costs least to keep, offload the rest, within the budget.

Start from the smallest-memory plan (every saved tensor out). Entries are ranked by how long they
would sit on the device between their save and their first use in backward, times their bytes:
those that cost least device memory per transfer avoided come first. A binary search finds the
longest run of that ranking that can stay on the device, a greedy pass tries the rest one by one,
and the prefetch distance is chosen for the shortest predicted step. Then the largest offloaded
tensors are traded for kept ones resident at the peak they would cause. Last, offloaded tensors
that cheap ops made (BatchNorm, activations, elementwise arithmetic) are recomputed in backward
instead of moved wherever that is predicted faster. Every step checks the
candidate with the simulator, so the returned plan fits by construction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lms.analysis.devices import DeviceSpec
from lms.analysis.recompute import recipes
from lms.analysis.records import Trace
from lms.analysis.simulate import SimResult, op_seconds
from lms.plan import Plan
from lms.planning.common import Checker

__all__ = ["plan_greedy"]

log = logging.getLogger("lms.planning")
_SWAP_TRIES = 4
"""Kept entries tried in place of each offloaded one (the smallest that cover the excess)."""
VARIANTS = ((1, 0), (2, 0), (4, 0), (8, 0), (1, 1), (2, 1), (1, 2), (1, 3))
"""(swapin_ahead, sync_mode) pairs the planner searches."""


def plan_greedy(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    max_simulations: int = 3000,
    first: str = "stash",
) -> Plan:
    """The plan with the shortest predicted step that fits ``budget_bytes``.

    The search stops refining after ``max_simulations`` simulations (a count, not a time, so the
    same step gives the same plan on any machine, however loaded). ``first`` is the remedy tried
    first where offloading everything alone does not fit (`Checker.require_feasible`).

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    checker = Checker(trace, spec, budget_bytes, half)
    plain = checker.run(None)
    if checker.fits(plain):
        return checker.finish(checker.plan((), source="planner"), plain)
    minimum_plan, minimum = checker.require_feasible(first)
    entries = trace.entries()
    first_use = trace.first_use_op()
    horizon = len(trace.ops)
    everything = range(len(entries))

    def pressure(ordinal: int) -> float:
        storage, nbytes, save_op = entries[ordinal]
        return nbytes * (first_use.get(storage, horizon) - save_op)

    ranking = sorted(everything, key=pressure)

    def spent() -> bool:
        return checker.simulations >= max_simulations

    prefer = _cheaper_to_recompute(checker, half)

    remake = set[int]()

    def evaluate(kept: set[int], ahead: int, sync_mode: int) -> float | None:
        """Predicted step time keeping ``kept`` on the device, or None if it does not fit."""
        result = _keeping(checker, kept, ahead, sync_mode, remake)
        return result.step_s if checker.fits(result) else None

    def search(ahead: int, sync_mode: int) -> tuple[set[int], float] | None:
        if evaluate(set(), ahead, sync_mode) is None:
            return None
        low, high = 0, len(ranking)
        while low < high:  # the longest prefix of the ranking that can stay
            middle = (low + high + 1) // 2
            if evaluate(set(ranking[:middle]), ahead, sync_mode) is not None:
                low = middle
            else:
                high = middle - 1
        kept = set(ranking[:low])
        for ordinal in ranking[low:]:  # then one by one
            if spent():
                break
            if evaluate(kept | {ordinal}, ahead, sync_mode) is not None:
                kept.add(ordinal)
        step_s = evaluate(kept, ahead, sync_mode)
        return (kept, step_s) if step_s is not None else None

    # Each variant is searched moving everything that goes, and recomputing what is cheaper.
    best: tuple[float, set[int], int, int, set[int]] | None = None
    for ahead, sync_mode in VARIANTS:
        for choice in (set(), prefer) if prefer else (set(),):
            remake = choice
            found = search(ahead, sync_mode)
            if found is not None and (best is None or found[1] < best[0]):
                best = (found[1], found[0], ahead, sync_mode, choice)
    if best is None:
        return checker.finish(minimum_plan, minimum)
    step_s, kept, ahead, sync_mode, remake = best
    kept, step_s = _trade(checker, kept, step_s, ahead, sync_mode, remake, spent)
    offload = [i for i in everything if i not in kept]
    remade, step_s = _recompute_pass(
        checker, offload, ahead, sync_mode, step_s, spent, remake.intersection(offload)
    )
    # What recomputing freed may let more stay on the device.
    for ordinal in sorted(set(offload) - remade, key=pressure):
        if spent():
            break
        fewer = [i for i in offload if i != ordinal]
        result = checker.run(
            checker.plan(
                fewer, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
            )
        )
        if checker.fits(result) and result.step_s < step_s * 0.999:
            offload, step_s = fewer, result.step_s
            kept.add(ordinal)
    plan = checker.plan(
        offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
    )
    result = checker.run(plan)
    log.info(
        "[LMS] [Planner] keep %d, offload %d, recompute %d of %d saved storages; "
        "swapin_ahead %d, sync_mode %d; %d simulations",
        len(kept),
        len(plan.offload),
        len(remade),
        len(entries),
        ahead,
        sync_mode,
        checker.simulations,
    )
    return checker.finish(plan, result)


def _keeping(
    checker: Checker, kept: set[int], ahead: int, sync_mode: int, remake: set[int]
) -> SimResult:
    """Simulate keeping ``kept`` on the device, recomputing ``remake`` and offloading the rest."""
    offload = [i for i in range(checker.num_entries) if i not in kept]
    plan = checker.plan(
        offload,
        ahead=ahead,
        sync_mode=sync_mode,
        source="planner",
        recompute=remake.difference(kept),
    )
    return checker.run(plan)


def _trade(
    checker: Checker,
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
    trace = checker.trace
    entries = trace.entries()
    everything = range(len(entries))
    uses = trace.use_ops()
    horizon = len(trace.ops)
    resident = {  # from its save to its last read in backward, while kept
        i: (save_op, (uses.get(storage) or [horizon])[-1])
        for i, (storage, _, save_op) in enumerate(entries)
    }

    def run(keep: set[int]) -> SimResult:
        return _keeping(checker, keep, ahead, sync_mode, remake)

    improved = True
    while improved and not spent():
        improved = False
        for outside in sorted(set(everything) - kept, key=lambda i: -entries[i][1]):
            if spent():
                break
            trial = kept | {outside}
            result = run(trial)
            if not checker.fits(result):
                excess, peak = result.peak_bytes - checker.budget_bytes, result.peak_op
                room = [
                    i
                    for i in kept
                    if entries[i][1] >= excess and resident[i][0] <= peak <= resident[i][1]
                ]
                for inside in sorted(room, key=lambda i: entries[i][1])[:_SWAP_TRIES]:
                    result = run(trial - {inside})
                    if checker.fits(result) and result.step_s < step_s * 0.999:
                        trial = trial - {inside}
                        break
            if checker.fits(result) and result.step_s < step_s * 0.999:
                kept, step_s, improved = trial, result.step_s, True
    return kept, step_s


def _recompute_pass(
    checker: Checker,
    offload: list[int],
    ahead: int,
    sync_mode: int,
    step_s: float,
    spent: Callable[[], bool],
    remade: set[int],
) -> tuple[set[int], float]:
    """Starting from ``remade``, recompute instead of moving, largest first, each offloaded
    tensor that has a recipe where that shortens the predicted step and still fits."""
    found = recipes(checker.trace)
    entries = checker.trace.entries()
    sources = {source for ordinal in remade for source in found[ordinal].inputs}
    candidates = [i for i in offload if i in found]
    for ordinal in sorted(candidates, key=lambda i: -entries[i][1]):
        if spent():
            break
        inputs = set(found[ordinal].inputs)
        if ordinal in remade or ordinal in sources or inputs & remade:
            continue
        trial = remade | {ordinal}
        plan = checker.plan(
            offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=trial
        )
        result = checker.run(plan)
        if checker.fits(result) and result.step_s < step_s * 0.999:
            remade, step_s = trial, result.step_s
            sources |= inputs
    return remade, step_s


def _cheaper_to_recompute(checker: Checker, half: bool) -> set[int]:
    """Tensors with a recipe that runs faster than their copy over the link, largest first,
    none of them an input of another."""
    found = recipes(checker.trace)
    if not found:
        return set()
    seconds = op_seconds(checker.trace, checker.spec, half)
    entries = checker.trace.entries()
    link = min(checker.spec.d2h_gbps, checker.spec.h2d_gbps) * 1e9
    chosen: set[int] = set()
    sources: set[int] = set()
    for ordinal in sorted(found, key=lambda i: -entries[i][1]):
        recipe = found[ordinal]
        cost = sum(seconds[k] for k in recipe.ops)
        if cost >= entries[ordinal][1] / link:
            continue
        if ordinal in sources or set(recipe.inputs) & chosen:
            continue
        chosen.add(ordinal)
        sources.update(recipe.inputs)
    return chosen
