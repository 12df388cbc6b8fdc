"""Restarts: the search run again keeping storages the plan found moves (Note [Restarts from
the plan found])."""

from __future__ import annotations

from collections.abc import Sequence

from lms.core.plan import Plan
from lms.core.records import Trace
from lms.planning.greedy.search import Search

__all__ = ["RESTART_ABOVE", "kinds", "restart"]

_RESTARTS = 4
"""Storages of the plan found that the search is run again keeping, one at a time."""


def kinds(trace: Trace, moved: Sequence[int]) -> list[set[int]]:
    """``moved`` grouped by the operation and output that made each storage, the groups of
    more than one but not all of them, the most bytes first."""
    entries = trace.entries()
    groups: dict[tuple[str, int], set[int]] = {}
    for ordinal in moved:
        record = trace.storages[entries[ordinal][0]]
        if record.alloc_op >= 0:
            op = trace.ops[record.alloc_op]
            output = op.outputs.index(record.id) if record.id in op.outputs else -1
            groups.setdefault((op.name, output), set()).add(ordinal)
    found = [group for group in groups.values() if 1 < len(group) < len(moved)]
    return sorted(found, key=lambda group: -sum(entries[i][1] for i in group))


RESTART_ABOVE = 0.05
"""Predicted overhead over the step without offload above which the search restarts: below it,
what a restart could win is within the simulator's own error on a measured step (step records
replay within 5.4%: benchmarks/results/README.md, "Step records on the CPU"), and each restart
costs as many simulations as the search did (a small T5 on the CPU: eight restarts, 17,000
simulations and 35 s, each landing on the plan it started from)."""


# Note: [Restarts from the plan found]
# The search is greedy: one storage it chose to move can steer every later choice, and a plan that
# keeps it may be much faster. A choice made for one storage is made alike for the others of its
# kind, since a network repeats its layers and the ranking sees them alike, so keeping one of a kind
# can leave the search where it was while keeping all of them moves it. With simulations left, the
# search runs again keeping each of the two largest storages the plan moves, then the largest kind
# of them (those made by the same operation's same output), the next two storages, the other kinds,
# and all it moves; the fastest plan of all stands. Cases where restarts paid:
# benchmarks/results/README.md, "Restarts from the plan found".
def restart(search: Search, step_s: float, plan: Plan, plain_s: float) -> tuple[float, Plan]:
    """The fastest of ``plan`` and the plans found searching again keeping some of what it
    moves (Note [Restarts from the plan found]), with its step time; ``plan`` alone where it is
    predicted within `RESTART_ABOVE` of the step without offload (``plain_s``)."""
    if step_s <= plain_s * (1 + RESTART_ABOVE):
        return step_s, plan
    candidates = search.candidates
    entries = search.entries
    pinned = candidates.pinned
    moved = sorted(plan.offload, key=lambda i: -entries[i][1])
    single = [{i} for i in moved[:_RESTARTS]]
    grouped = kinds(candidates.trace, moved)
    restarts = [*single[:2], *grouped[:1], *single[2:], *grouped[1:]]
    restarts += [set(moved)] if len(moved) > 1 else []
    for forced in restarts:
        if search.spent():
            break
        candidates.pinned = pinned | forced
        again = search.best()
        candidates.pinned = pinned
        if again is not None and again[0] < step_s * 0.999:
            step_s, plan = again
    return step_s, plan
