"""The per-tensor planner: keep what costs least to keep, offload the rest, within the budget.

Start from the smallest-memory plan (every saved tensor out). Entries are ranked by how long they
would sit on the device between their save and their first use in backward, times their bytes:
those that cost least device memory per transfer avoided come first. A binary search finds the
longest run of that ranking that can stay on the device for each prefetch distance, and for the
distances fastest there a greedy pass tries the rest one by one. That search runs from three
starting sets of storages recomputed instead of moved (`lms.core.recipes`): replays cheaper
than their copy with chains allowed, without chains, and only those bound by memory traffic.
The best of each is refined, then the next best few with other kept sets (the fastest search is
not always the one that refines best): the largest offloaded tensors are traded for kept ones
resident at the peak they would cause, more offloaded tensors are recomputed wherever that is
predicted faster (or as fast, holding less off the device), and what that freed may stay. The
fastest refined plan is polished: single tensors move between kept, offloaded and recomputed
while any such move is faster. With simulations left, all of that runs again keeping each of the
largest storages the plan moves, each kind of storage it moves (made by the same operation), and
then all it moves (Note [Restarts from the plan found]).
Every step checks the candidate with the simulator, so the returned plan fits by construction.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from lms.core.devices import DeviceSpec
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.planning.candidates import Candidates
from lms.planning.greedy.restarts import restart
from lms.planning.greedy.search import Search
from lms.planning.greedy.shared import VARIANTS
from lms.planning.minimum import smallest_plan

__all__ = ["VARIANTS", "plan_greedy"]

log = logging.getLogger("lms.planning")


def plan_greedy(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    max_simulations: int = 20000,
    first: str = "relieve",
    free_held: bool = False,
    gaps: bool = False,
) -> Plan:
    """The plan with the shortest predicted step that fits ``budget_bytes``.

    The search stops refining after ``max_simulations`` simulations (a count, not a time, so the
    same step gives the same plan on any machine, however loaded). 20000 take up to 40 s on one
    core for ResNet50, GoogLeNet or a 3D U-Net under 32 GiB; at seven of the sweeps' hardest
    points twice as many found plans faster by 0.3 points of overhead at most. ``first`` is the
    remedy tried first where offloading everything alone does not fit
    (`lms.planning.minimum.smallest_plan`). ``free_held``: plans may empty what the step's code
    holds (Note [Emptying what the code holds]); ``gaps``: with it, also over the gaps between
    forward's reads of what they offload, those the plan fits without left out (Note [Gaps in
    what the code holds]).

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    candidates = Candidates(trace, spec, budget_bytes, half, free_held=free_held, gaps=gaps)
    plain = candidates.run(None)
    if candidates.fits(plain):
        return candidates.finish(candidates.plan((), source="planner"), plain)
    minimum_plan, minimum = smallest_plan(candidates, first)
    search = Search(candidates, half=half, max_simulations=max_simulations)
    # A search of a long trace can take a minute (EfficientNet-B7 at 600 px: 20000 simulations
    # of 2604 ops); the bar, on a terminal only, shows it under way against its cap.
    with tqdm(
        total=max_simulations, desc="planning", unit="sim", leave=False, disable=None
    ) as candidates.progress:
        candidates.progress.update(candidates.simulations)
        found = search.best()
        if found is not None:
            _, plan = restart(search, *found, plain.step_s)
    candidates.progress = None
    if found is None:
        return candidates.finish(*candidates.fewest_gaps(minimum_plan))
    plan = candidates.fewest_gaps(plan)[0]
    entries = trace.entries()
    kept = set(range(len(entries))) - set(plan.offload) - set(plan.recompute)
    result = candidates.run(plan)
    log.info(
        "[LMS] [Planner] keep %d, offload %d, recompute %d of %d saved storages%s%s; "
        "swapin_ahead %d, sync_mode %d; %d simulations",
        len(kept),
        len(plan.offload),
        len(plan.recompute),
        len(entries),
        f", empty {len(plan.free_held)} held" if plan.free_held else "",
        f" ({len(plan.held_gaps)} gaps in forward)" if plan.held_gaps else "",
        plan.swapin_ahead,
        plan.sync_mode,
        candidates.simulations,
    )
    return candidates.finish(plan, result)
