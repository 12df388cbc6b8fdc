"""The default planner: the per-tensor plan and TFLMS's tuned set, whichever is predicted faster."""

from __future__ import annotations

from lms.analysis.devices import DeviceSpec
from lms.analysis.records import Trace
from lms.plan import Plan
from lms.planning.greedy import plan_greedy
from lms.planning.tflms import tune_tflms

__all__ = ["plan_auto"]


def plan_auto(trace: Trace, spec: DeviceSpec, budget_bytes: int, *, half: bool = False) -> Plan:
    """Both planners' plans fit; return the one with the lower predicted overhead.

    Where offloading everything alone does not fit, the per-tensor planner searches again with
    the other remedy tried first (reading back per use before relieving gradient junctions):
    which one leads to the faster plan depends on the model and the budget.

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    greedy = plan_greedy(trace, spec, budget_bytes, half=half)
    candidates = [greedy, tune_tflms(trace, spec, budget_bytes, half=half)]
    if greedy.stash:
        candidates.append(plan_greedy(trace, spec, budget_bytes, half=half, first="refetch"))
    return min(candidates, key=lambda plan: (plan.predicted_overhead, len(plan.offload)))
