"""TFLMS v2's auto-tuning: binary searches over its four parameters, checked by the simulator."""

from __future__ import annotations

import logging

from lms.core.devices import DeviceSpec
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.planning.candidates import Candidates
from lms.planning.minimum import smallest_plan
from lms.planning.spans import entry_distances

__all__ = ["tune_tflms"]

log = logging.getLogger("lms.planning")


def _largest_passing(low: int, high: int, passes) -> int | None:  # type: ignore[no-untyped-def]
    """The largest value in [low, high] for which ``passes`` holds, assuming it is monotone."""
    if not passes(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if passes(middle):
            low = middle
        else:
            high = middle - 1
    return low


def tune_tflms(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    free_held: bool = False,
) -> Plan:
    """Find ``swapout_threshold``, ``swapin_ahead``, ``swapin_groupby`` and ``sync_mode`` as
    TFLMS v2 did: the largest threshold that fits (fewest tensors moved), then the largest
    prefetch distance and group that still fit, logging each passing set.

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    candidates = Candidates(trace, spec, budget_bytes, half, free_held=free_held)
    plain = candidates.run(None)
    if candidates.fits(plain):
        log.info("[LMS] [Simulator] LMS is not needed: the step fits in the budget")
        return candidates.finish(candidates.plan((), source="tflms"), plain)
    smallest_plan(candidates)
    distance = entry_distances(trace)
    max_level = int(max((d for d in distance if d != float("inf")), default=1))
    state = {"threshold": 1, "ahead": 1, "groupby": 0, "sync": 0}

    def candidate(threshold: int, ahead: int, groupby: int, sync: int) -> Plan:
        chosen = [i for i, d in enumerate(distance) if d >= threshold]
        return candidates.plan(chosen, ahead=ahead + groupby, sync_mode=sync, source="tflms")

    logged: list[dict[str, int]] = []

    def passes(**change: int) -> bool:
        trial = {**state, **change}
        result = candidates.run(
            candidate(trial["threshold"], trial["ahead"], trial["groupby"], trial["sync"])
        )
        if not candidates.fits(result):
            return False
        if trial not in logged:  # each set once, though a search may try it again
            logged.append(trial)
            log.info(
                "[LMS] [Simulator] Found a parameter set: swapout_threshold %d, swapin_ahead %d,"
                " swapin_groupby %d, sync_mode %d",
                trial["threshold"],
                trial["ahead"],
                trial["groupby"],
                trial["sync"],
            )
        return True

    for sync in (0, 1, 2, 3):
        state["sync"] = sync
        best = _largest_passing(1, max_level, lambda t: passes(threshold=t))
        if best is not None:
            state["threshold"] = best
            break
    else:
        plan, result = smallest_plan(candidates)
        return candidates.finish(plan, result)
    if state["sync"] in (0, 1):  # sync modes 2 and 3 bring tensors back on demand only
        ahead = _largest_passing(1, 16, lambda a: passes(ahead=a))
        state["ahead"] = ahead or 1
        groupby = _largest_passing(0, max_level, lambda g: passes(groupby=g))
        state["groupby"] = groupby or 0
    plan = candidate(state["threshold"], state["ahead"], state["groupby"], state["sync"])
    result = candidates.run(plan)
    log.info("[LMS] [Simulator] %d simulations", candidates.simulations)
    return candidates.finish(plan, result)
