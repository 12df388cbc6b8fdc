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

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    candidates = [
        plan_greedy(trace, spec, budget_bytes, half=half),
        tune_tflms(trace, spec, budget_bytes, half=half),
    ]
    return min(candidates, key=lambda plan: (plan.predicted_overhead, len(plan.offload)))
