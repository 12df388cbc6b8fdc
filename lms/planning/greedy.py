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
AHEADS = (1, 2, 3, 4, 6, 8)


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
    ahead, sync_mode = minimum_plan.swapin_ahead, minimum_plan.sync_mode
    entries = trace.entries()
    first_use = trace.first_use_op()
    horizon = len(trace.ops)

    def pressure(ordinal: int) -> float:
        storage, nbytes, save_op = entries[ordinal]
        return nbytes * (first_use.get(storage, horizon) - save_op)

    ranking = sorted(range(len(entries)), key=pressure)

    def fits_keeping(kept: set[int], trial_ahead: int = ahead) -> tuple[bool, float]:
        offload = [i for i in range(len(entries)) if i not in kept]
        plan = checker.plan(offload, ahead=trial_ahead, sync_mode=sync_mode, source="planner")
        result = checker.run(plan)
        return checker.fits(result), result.step_s

    low, high = 0, len(ranking)
    while low < high:  # the longest prefix of the ranking that can stay
        middle = (low + high + 1) // 2
        if fits_keeping(set(ranking[:middle]))[0]:
            low = middle
        else:
            high = middle - 1
    kept = set(ranking[:low])
    deadline = time.perf_counter() + time_limit_s
    for ordinal in ranking[low:]:
        if time.perf_counter() > deadline:
            log.info("[LMS] planner stopped its greedy pass at the %.1f s limit", time_limit_s)
            break
        if fits_keeping(kept | {ordinal})[0]:
            kept.add(ordinal)
    best_ahead, best_time = ahead, float("inf")
    for trial in AHEADS:
        ok, step_s = fits_keeping(kept, trial)
        if ok and step_s < best_time:
            best_ahead, best_time = trial, step_s
    offload = [i for i in range(len(entries)) if i not in kept]
    plan = checker.plan(offload, ahead=best_ahead, sync_mode=sync_mode, source="planner")
    result = checker.run(plan)
    if not checker.fits(result):  # cannot happen unless every ahead failed; fall back
        plan, result = minimum_plan, minimum
    log.info(
        "[LMS] [Planner] keep %d, offload %d of %d saved storages; swapin_ahead %d; "
        "%d simulations",
        len(kept), len(offload), len(entries), plan.swapin_ahead, checker.simulations,
    )
    return checker.finish(plan, result)
