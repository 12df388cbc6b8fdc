"""The default planner: the per-tensor plan and TFLMS's tuned set, whichever is predicted faster."""

from __future__ import annotations

from lms.analysis.devices import DeviceSpec
from lms.analysis.records import Trace
from lms.plan import Plan
from lms.planning.greedy import plan_greedy
from lms.planning.tflms import tune_tflms

__all__ = ["plan_auto"]


def plan_auto(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    free_held: bool = False,
) -> Plan:
    """Both planners' plans fit; return the one with the lower predicted overhead.

    Where offloading everything alone does not fit, the per-tensor planner searches again with
    the other remedy tried first (reading back per use before relieving gradient junctions):
    which one leads to the faster plan depends on the model and the budget.

    ``free_held``: plans may empty what the step's code holds (Note [Emptying what the code
    holds]).

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    greedy = plan_greedy(trace, spec, budget_bytes, half=half, free_held=free_held)
    candidates = [greedy, tune_tflms(trace, spec, budget_bytes, half=half, free_held=free_held)]
    if greedy.stash:
        candidates.append(
            plan_greedy(trace, spec, budget_bytes, half=half, first="refetch", free_held=free_held)
        )
    return min(candidates, key=lambda plan: (plan.predicted_overhead, len(plan.offload)))
