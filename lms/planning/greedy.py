"""The per-tensor planner: keep what costs least to keep, offload the rest, within the budget.

Start from the smallest-memory plan (every saved tensor out). Entries are ranked by how long they
would sit on the device between their save and their first use in backward, times their bytes:
those that cost least device memory per transfer avoided come first. A binary search finds the
longest run of that ranking that can stay on the device, a greedy pass tries the rest one by one,
and the prefetch distance is chosen last for the shortest predicted step. Every step checks the
candidate with the simulator, so the returned plan fits by construction.
"""

from __future__ import annotations

import logging
import time

from lms.analysis.devices import DeviceSpec
from lms.analysis.records import Trace
from lms.plan import Plan
from lms.planning.common import Checker

__all__ = ["plan_greedy"]

log = logging.getLogger("lms.planning")
VARIANTS = ((1, 0), (2, 0), (4, 0), (8, 0), (1, 1), (2, 1), (1, 2), (1, 3))
"""(swapin_ahead, sync_mode) pairs the planner searches."""


def plan_greedy(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    time_limit_s: float = 5.0,
) -> Plan:
    """The plan with the shortest predicted step that fits ``budget_bytes``.

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    checker = Checker(trace, spec, budget_bytes, half)
    plain = checker.run(None)
    if checker.fits(plain):
        return checker.finish(checker.plan((), source="planner"), plain)
    minimum_plan, minimum = checker.require_feasible()
    entries = trace.entries()
    first_use = trace.first_use_op()
    horizon = len(trace.ops)
    everything = range(len(entries))

    def pressure(ordinal: int) -> float:
        storage, nbytes, save_op = entries[ordinal]
        return nbytes * (first_use.get(storage, horizon) - save_op)

    ranking = sorted(everything, key=pressure)
    deadline = time.perf_counter() + time_limit_s

    def evaluate(kept: set[int], ahead: int, sync_mode: int) -> float | None:
        """Predicted step time keeping ``kept`` on the device, or None if it does not fit."""
        offload = [i for i in everything if i not in kept]
        plan = checker.plan(offload, ahead=ahead, sync_mode=sync_mode, source="planner")
        result = checker.run(plan)
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
            if time.perf_counter() > deadline:
                break
            if evaluate(kept | {ordinal}, ahead, sync_mode) is not None:
                kept.add(ordinal)
        step_s = evaluate(kept, ahead, sync_mode)
        return (kept, step_s) if step_s is not None else None

    best: tuple[float, set[int], int, int] | None = None
    for ahead, sync_mode in VARIANTS:
        found = search(ahead, sync_mode)
        if found is not None and (best is None or found[1] < best[0]):
            best = (found[1], found[0], ahead, sync_mode)
    if best is None:
        return checker.finish(minimum_plan, minimum)
    step_s, kept, ahead, sync_mode = best
    # Swap one kept entry for one offloaded entry while that shortens the step (time-bounded).
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for outside in sorted(set(everything) - kept, key=lambda i: -entries[i][1]):
            for inside in sorted(kept, key=pressure, reverse=True):
                if time.perf_counter() > deadline:
                    break
                trial = (kept - {inside}) | {outside}
                trial_s = evaluate(trial, ahead, sync_mode)
                if trial_s is not None and trial_s < step_s * 0.999:
                    kept, step_s, improved = trial, trial_s, True
                    break
            if improved:
                break
    offload = [i for i in everything if i not in kept]
    plan = checker.plan(offload, ahead=ahead, sync_mode=sync_mode, source="planner")
    result = checker.run(plan)
    log.info(
        "[LMS] [Planner] keep %d, offload %d of %d saved storages; swapin_ahead %d, "
        "sync_mode %d; %d simulations",
        len(kept),
        len(offload),
        len(entries),
        ahead,
        sync_mode,
        checker.simulations,
    )
    return checker.finish(plan, result)
