"""Planners: TFLMS-compatible auto-tuning, the per-tensor planner and the mixed-integer one.
Pure: simulation only."""

from lms.planning.auto import plan_auto
from lms.planning.blocks import plan_blocks
from lms.planning.greedy import plan_greedy
from lms.planning.milp import plan_milp
from lms.planning.spans import entry_distances
from lms.planning.tflms import tune_tflms

__all__ = [
    "plan_auto",
    "plan_blocks",
    "plan_greedy",
    "plan_milp",
    "tune_tflms",
    "entry_distances",
]
