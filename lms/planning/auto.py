"""The default planner: the per-tensor plan (or, for a deep stack of repeated blocks, the
per-role plan, and the mixed-integer plan where that one is predicted slow) and TFLMS's tuned
set, whichever is predicted faster."""

from __future__ import annotations

import functools
import logging

from lms.core.devices import DeviceSpec
from lms.core.errors import PlanInfeasibleError
from lms.core.extras import installed
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.planning.blocks import plan_blocks, repeats
from lms.planning.greedy import plan_greedy
from lms.planning.milp import plan_milp
from lms.planning.tflms import tune_tflms

__all__ = ["plan_auto"]

log = logging.getLogger("lms.planning")


def plan_auto(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    free_held: bool = False,
    max_simulations: int = 20000,
) -> Plan:
    """Both planners' plans fit; return the one with the lower predicted overhead.

    Where offloading everything alone does not fit, the per-tensor planner searches again with
    the other remedy tried first (reading back per use before relieving gradient junctions):
    which one leads to the faster plan depends on the model and the budget.

    ``free_held``: plans may empty what the step's code holds (Note [Emptying what the code
    holds]); where none fits so, also over the gaps between forward's reads of what they offload
    (Note [Gaps in what the code holds]). Where a plan that empties nothing also fits, it is
    searched too and stands unless the emptying plan is predicted faster by more than 0.1%:
    emptying costs a copy in for each storage, and asks the step's code to leave it alone.
    ``max_simulations`` bounds each per-tensor search (`lms.planning.greedy.plan_greedy`).

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    try:
        fastest = _fastest(trace, spec, budget_bytes, half, free_held, max_simulations)
    except PlanInfeasibleError:
        if not free_held:
            raise
        log.info(
            "[LMS] free_held: no plan fits emptying what the code holds after forward's last "
            "read of it; searching plans that also empty it between forward's reads"
        )
        return plan_greedy(
            trace,
            spec,
            budget_bytes,
            half=half,
            free_held=True,
            gaps=True,
            max_simulations=max_simulations,
        )
    if not fastest.free_held:
        return fastest
    emptying = f"the plan that empties {len(fastest.free_held)} held storages"
    log.info(
        "[LMS] free_held: %s is predicted at %+.1f%%; searching one that empties none",
        emptying,
        100 * fastest.predicted_overhead,
    )
    try:
        filled = _fastest(trace, spec, budget_bytes, half, False, max_simulations)
    except PlanInfeasibleError:
        log.info("[LMS] free_held: none fits without emptying; %s stands", emptying)
        return fastest
    faster = fastest.predicted_overhead < filled.predicted_overhead - 1e-3
    log.info(
        "[LMS] free_held: the plan that empties none is predicted at %+.1f%%; %s",
        100 * filled.predicted_overhead,
        f"{emptying} stands, faster by over 0.1%" if faster else "it stands",
    )
    return fastest if faster else filled


DEEP_STACK_REPEATS = 8
"""Saved tensors per role (`lms.planning.blocks.repeats`) from which a step counts as a deep
stack of repeated blocks, planned one role at a time (Note [Plan one block, apply it to all])."""


_DEPTHS = (1, 4)
"""Runs of consecutive layers the per-role planner chooses apart: one (every layer alike), then
four, from that plan (early layers may go where late ones stay; Note [Coarse roles first])."""


WIDER_SEARCH_OVERHEAD = 0.5
"""Predicted overhead of the per-role plan above which the finer runs of layers are also searched
from scratch: a budget that tight leaves the greedy search's start more say in where it lands,
and a step that costs half as much again pays for the extra second or two of planning
(`benchmarks/results/README.md`, "Planning time for language models")."""


# Note: [A tight budget asks the solver too]
# The per-role search moves one role at a time from a few starts. Near a stack's floor, where most
# of each layer must be replayed and the rest moved, the plan that fits lies far from those starts,
# and the search stops at plans that wait on the link for several times the step (GPT-2 medium at
# half its peak: +267%). There the mixed-integer program (`lms.planning.milp`), which weighs every
# storage's choice at once, lands much nearer (+64%) in a few seconds more. It is asked only where
# the per-role plan is predicted past `WIDER_SEARCH_OVERHEAD`, where scipy is installed (the
# `solver` extra), and not for plans that empty what the code holds, which it does not model;
# the simulator judges its plan as any other. Measured: benchmarks/results/README.md, "Planning
# time for language models".


def _fastest(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    half: bool,
    free_held: bool,
    max_simulations: int,
) -> Plan:
    if repeats(trace) >= DEEP_STACK_REPEATS:
        # A transformer's layers: the per-tensor search would spend thousands of simulations of a
        # long trace on choices that come out alike in every layer.
        by_role = plan_blocks(
            trace, spec, budget_bytes, half=half, free_held=free_held, depths=_DEPTHS
        )
        candidates = [
            by_role,
            tune_tflms(trace, spec, budget_bytes, half=half, free_held=free_held),
        ]
        if by_role.predicted_overhead > WIDER_SEARCH_OVERHEAD:
            wider = max(_DEPTHS)
            log.info(
                "[LMS] [Planner] predicted %+.1f%%: searching %d runs of layers from scratch too",
                100 * by_role.predicted_overhead,
                wider,
            )
            candidates.append(
                plan_blocks(trace, spec, budget_bytes, half=half, free_held=free_held, depths=wider)
            )
        fastest = min(candidates, key=lambda plan: (plan.predicted_overhead, len(plan.offload)))
        slow = fastest.predicted_overhead > WIDER_SEARCH_OVERHEAD
        if slow and not free_held and installed("scipy"):
            # Note [A tight budget asks the solver too]
            log.info(
                "[LMS] [Planner] predicted %+.1f%%: solving the choice as a mixed-integer "
                "program too",
                100 * fastest.predicted_overhead,
            )
            candidates.append(plan_milp(trace, spec, budget_bytes, half=half))
        return min(candidates, key=lambda plan: (plan.predicted_overhead, len(plan.offload)))
    searched = functools.partial(
        plan_greedy,
        trace,
        spec,
        budget_bytes,
        half=half,
        free_held=free_held,
        max_simulations=max_simulations,
    )
    greedy = searched()
    candidates = [greedy, tune_tflms(trace, spec, budget_bytes, half=half, free_held=free_held)]
    if greedy.relieved_junctions:
        candidates.append(searched(first="refetch"))
    return min(candidates, key=lambda plan: (plan.predicted_overhead, len(plan.offload)))
