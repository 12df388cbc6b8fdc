"""The per-tensor planner: keep what costs least to keep, offload the rest, within the budget.

Start from the smallest-memory plan (every saved tensor out). Entries are ranked by how long they
would sit on the device between their save and their first use in backward, times their bytes:
those that cost least device memory per transfer avoided come first. A binary search finds the
longest run of that ranking that can stay on the device, a greedy pass tries the rest one by one,
and the prefetch distance is chosen for the shortest predicted step. That search runs from three
starting sets of storages recomputed instead of moved (`lms.analysis.recompute`): replays cheaper
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

import itertools
import logging
from collections.abc import Callable, Sequence

from lms.analysis.devices import DeviceSpec
from lms.analysis.recompute import Recipe, recipes
from lms.analysis.records import Trace
from lms.analysis.simulate import SimResult, op_seconds
from lms.plan import Plan
from lms.planning.common import Checker

__all__ = ["plan_greedy"]

log = logging.getLogger("lms.planning")
_SWAP_TRIES = 4
"""Kept entries tried in place of each offloaded one (the smallest that cover the excess)."""
_COMBINED = 8
"""Offloaded tensors (the largest) whose pairs and triples are tried recomputed together."""
_RECOMPUTE_ROUNDS = 3
"""Rounds of the recompute pass, each after the prefetch distance is chosen again."""
_RUNNERS_UP = 2
"""Searches refined after each starting set's fastest: its next fastest with other kept sets."""
_RESTARTS = 4
"""Storages of the plan found that the search is run again keeping, one at a time."""
_Searched = tuple[float, set[int], int, int]
"""A search's predicted step time, kept entries, swapin_ahead and sync_mode."""
VARIANTS = ((1, 0), (2, 0), (4, 0), (8, 0), (1, 1), (2, 1), (1, 2), (1, 3))
"""(swapin_ahead, sync_mode) pairs the planner searches."""


def plan_greedy(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    max_simulations: int = 20000,
    first: str = "stash",
    free_held: bool = False,
) -> Plan:
    """The plan with the shortest predicted step that fits ``budget_bytes``.

    The search stops refining after ``max_simulations`` simulations (a count, not a time, so the
    same step gives the same plan on any machine, however loaded). 20000 take up to 40 s on one
    core for ResNet50, GoogLeNet or a 3D U-Net under 32 GiB; at seven of the sweeps' hardest
    points twice as many found plans faster by 0.3 points of overhead at most. ``first`` is the
    remedy tried first where offloading everything alone does not fit
    (`Checker.require_feasible`). ``free_held``: plans may empty what the step's code holds
    (Note [Emptying what the code holds]).

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
    """
    checker = Checker(trace, spec, budget_bytes, half, free_held=free_held)
    plain = checker.run(None)
    if checker.fits(plain):
        return checker.finish(checker.plan((), source="planner"), plain)
    minimum_plan, minimum = checker.require_feasible(first)
    entries = trace.entries()
    first_use = trace.first_use_op()
    horizon = len(trace.ops)
    everything = range(len(entries))

    def pressure(ordinal: int) -> float:
        storage, nbytes, save_op = entries[ordinal]
        return nbytes * (first_use.get(storage, horizon) - save_op)

    def spent() -> bool:
        return checker.simulations >= max_simulations

    def best() -> tuple[float, Plan] | None:
        """The fastest plan the search, refinement and polish find, keeping what is pinned."""
        ranking = sorted(set(everything) - checker.pinned, key=pressure)  # pinned entries stay

        # What to recompute rather than move, where that is cheaper than its copy: three starting
        # sets, each searched. With chains (as checkpointing replays a block); each from stored
        # inputs only; and only replays bound by memory traffic, which leave the convolutions'
        # outputs to be moved and their inputs free to be recomputed.
        starts = _distinct(
            set(),
            _cheaper_to_recompute(checker, half, chains=True),
            _cheaper_to_recompute(checker, half, chains=False),
            _cheaper_to_recompute(checker, half, chains=False, convolutions=False),
        )

        remake = set[int]()

        def evaluate(kept: set[int], ahead: int, sync_mode: int) -> float | None:
            """Predicted step time keeping ``kept`` on the device, or None if it does not fit."""
            result = _keeping(checker, kept, ahead, sync_mode, remake)
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
                if spent():
                    break
                if evaluate(kept | {ordinal}, ahead, sync_mode) is not None:
                    kept.add(ordinal)
            step_s = evaluate(kept, ahead, sync_mode)
            return (kept, step_s) if step_s is not None else None

        # Each variant is searched from each starting set. The best search of each start is refined
        # first (a greedy refinement can overtake from behind), then each start's runners-up; the
        # fastest refined plan is polished.
        searched: dict[int, list[_Searched]] = {}
        for ahead, sync_mode in VARIANTS:
            for number, choice in enumerate(starts):
                remake = choice
                found = search(ahead, sync_mode)
                if found is not None:
                    searched.setdefault(number, []).append((found[1], found[0], ahead, sync_mode))
        if not searched:
            return None
        fastest: list[tuple[int, _Searched]] = []
        runners_up: list[tuple[int, _Searched]] = []
        for number, searches in searched.items():
            ranked = _other_kept_sets(sorted(searches, key=lambda item: item[0]))
            fastest.append((number, ranked[0]))
            runners_up.extend((number, item) for item in ranked[1 : 1 + _RUNNERS_UP])
        refined = [
            _refine(checker, starts[number], *found, spent, pressure)
            for number, found in [
                *sorted(fastest, key=lambda item: item[1][0]),
                *sorted(runners_up, key=lambda item: item[1][0]),
            ]
        ]
        step_s, plan, _ = min(refined, key=lambda item: item[0])
        plan = _polish(checker, plan, step_s, spent)
        return checker.run(plan).step_s, plan

    found = best()
    if found is None:
        return checker.finish(minimum_plan, minimum)
    step_s, plan = found
    # Note: [Restarts from the plan found]
    # The search is greedy: one storage it chose to move can steer every later choice, and a plan
    # that keeps it may be much faster (a 3D U-Net at 304^3 on the H100 spec: 0.49 s a step, and
    # 0.25 s with one storage of the 0.49 s plan kept from the start). A choice made for one
    # storage is made alike for the others of its kind, since a network repeats its layers and
    # the ranking sees them alike: GoogLeNet at 11000 px on the V100 spec moves eight max
    # poolings' indices, and keeping any one of them leaves the search where it was, keeping
    # all eight takes it to a plan that recomputes more and moves less (43.1% to 40.9%). With
    # simulations left, the search runs again keeping each of the two largest storages the
    # plan moves, then the largest kind of them (those made by the same operation's same
    # output), the next two storages, the other kinds, and all it moves; the fastest plan of
    # all stands.
    pinned = checker.pinned
    moved = sorted(plan.offload, key=lambda i: -entries[i][1])
    single = [{i} for i in moved[:_RESTARTS]]
    kinds = _kinds(trace, moved)
    restarts = [*single[:2], *kinds[:1], *single[2:], *kinds[1:]]
    restarts += [set(moved)] if len(moved) > 1 else []
    for forced in restarts:
        if spent():
            break
        checker.pinned = pinned | forced
        again = best()
        checker.pinned = pinned
        if again is not None and again[0] < step_s * 0.999:
            step_s, plan = again
    kept = set(range(len(entries))) - set(plan.offload) - set(plan.recompute)
    result = checker.run(plan)
    log.info(
        "[LMS] [Planner] keep %d, offload %d, recompute %d of %d saved storages%s; "
        "swapin_ahead %d, sync_mode %d; %d simulations",
        len(kept),
        len(plan.offload),
        len(plan.recompute),
        len(entries),
        f", empty {len(plan.free_held)} held" if plan.free_held else "",
        plan.swapin_ahead,
        plan.sync_mode,
        checker.simulations,
    )
    return checker.finish(plan, result)


def _refine(
    checker: Checker,
    remake: set[int],
    step_s: float,
    kept: set[int],
    ahead: int,
    sync_mode: int,
    spent: Callable[[], bool],
    pressure: Callable[[int], float],
) -> tuple[float, Plan, set[int]]:
    """Trade kept and offloaded entries, recompute more (choosing the prefetch distance and
    sync mode again after each round that changed anything), then keep what that freed room
    for."""
    kept, step_s = _trade(checker, kept, step_s, ahead, sync_mode, remake, spent)
    offload = [i for i in range(checker.num_entries) if i not in kept]
    remade = remake.intersection(offload)
    for _ in range(_RECOMPUTE_ROUNDS):
        more, step_s = _recompute_pass(checker, offload, ahead, sync_mode, step_s, spent, remade)
        if more == remade:
            break
        remade = more
        faster = _fastest_variant(checker, offload, remade, VARIANTS, step_s, spent)
        if faster is not None:
            step_s, ahead, sync_mode = faster
    remade, ahead, sync_mode, step_s = _combine(
        checker, offload, remade, ahead, sync_mode, step_s, spent
    )
    for ordinal in sorted(set(offload) - remade, key=pressure):
        if spent():
            break
        fewer = [i for i in offload if i != ordinal]
        result = checker.run(
            checker.plan(
                fewer, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
            )
        )
        if checker.fits(result) and result.step_s < step_s * 0.999:
            offload, step_s = fewer, result.step_s
            kept.add(ordinal)
    plan = checker.plan(
        offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
    )
    return step_s, plan, kept


def _polish(checker: Checker, plan: Plan, step_s: float, spent: Callable[[], bool]) -> Plan:
    """Move single tensors, largest first, between kept, offloaded and recomputed wherever that
    fits and shortens the predicted step, in passes until none does; the prefetch distance and
    sync mode are chosen again after each pass that moved one. The refinement moves tensors one
    way only (kept ones out, offloaded ones in or recomputed); a plan it leaves may still gain
    from putting back a tensor it chose to recompute, or recomputing one it kept."""
    found = recipes(checker.trace)
    entries = checker.trace.entries()
    offload, remade = set(plan.offload) | set(plan.recompute), set(plan.recompute)
    ahead, sync_mode = plan.swapin_ahead, plan.sync_mode
    order = sorted(set(range(len(entries))) - checker.pinned, key=lambda i: -entries[i][1])

    def moves(ordinal: int) -> list[tuple[set[int], set[int]]]:
        """(offload, remade) with ``ordinal`` kept, offloaded or recomputed, other than now."""
        kept, out = offload - {ordinal}, offload | {ordinal}
        recomputable = ordinal in found and _chains(found, remade - {ordinal}, ordinal, chains=True)
        options = [
            (kept, remade - {ordinal}),
            (out, remade - {ordinal}),
            *([(out, remade | {ordinal})] if recomputable else []),
        ]
        return [option for option in options if option != (offload, remade)]

    moved = True
    while moved and not spent():
        moved = False
        for ordinal in order:
            for trial_offload, trial_remade in moves(ordinal):
                if spent():
                    break
                trial = checker.plan(
                    trial_offload,
                    ahead=ahead,
                    sync_mode=sync_mode,
                    source="planner",
                    recompute=trial_remade,
                )
                result = checker.run(trial)
                if checker.fits(result) and result.step_s < step_s * 0.999:
                    offload, remade, step_s = trial_offload, trial_remade, result.step_s
                    moved = True
                    break
        if moved:
            faster = _fastest_variant(checker, list(offload), remade, VARIANTS, step_s, spent)
            if faster is not None:
                step_s, ahead, sync_mode = faster
    return checker.plan(
        offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
    )


def _other_kept_sets(ranked: list[_Searched]) -> list[_Searched]:
    """``ranked`` without the searches that kept the same set as a faster one."""
    return [item for i, item in enumerate(ranked) if all(item[1] != o[1] for o in ranked[:i])]


def _keeping(
    checker: Checker, kept: set[int], ahead: int, sync_mode: int, remake: set[int]
) -> SimResult:
    """Simulate keeping ``kept`` on the device, recomputing ``remake`` and offloading the rest."""
    offload = [i for i in range(checker.num_entries) if i not in kept]
    plan = checker.plan(
        offload,
        ahead=ahead,
        sync_mode=sync_mode,
        source="planner",
        recompute=remake.difference(kept),
    )
    return checker.run(plan)


def _trade(
    checker: Checker,
    kept: set[int],
    step_s: float,
    ahead: int,
    sync_mode: int,
    remake: set[int],
    spent: Callable[[], bool],
) -> tuple[set[int], float]:
    """Keep offloaded entries, largest first, while that shortens the step; where one no longer
    fits, offload in its place a kept entry resident at the new peak and large enough to cover
    the excess (the smallest few of those are tried). Rounds repeat while one improves."""
    trace = checker.trace
    entries = trace.entries()
    everything = range(len(entries))
    uses = trace.use_ops()
    horizon = len(trace.ops)
    resident = {  # from its save to its last read in backward, while kept
        i: (save_op, (uses.get(storage) or [horizon])[-1])
        for i, (storage, _, save_op) in enumerate(entries)
    }

    def run(keep: set[int]) -> SimResult:
        return _keeping(checker, keep, ahead, sync_mode, remake)

    improved = True
    while improved and not spent():
        improved = False
        for outside in sorted(set(everything) - kept, key=lambda i: -entries[i][1]):
            if spent():
                break
            trial = kept | {outside}
            result = run(trial)
            if not checker.fits(result):
                excess, peak = result.peak_bytes - checker.budget_bytes, result.peak_op
                room = [
                    i
                    for i in kept
                    if entries[i][1] >= excess and resident[i][0] <= peak <= resident[i][1]
                ]
                for inside in sorted(room, key=lambda i: entries[i][1])[:_SWAP_TRIES]:
                    result = run(trial - {inside})
                    if checker.fits(result) and result.step_s < step_s * 0.999:
                        trial = trial - {inside}
                        break
            if checker.fits(result) and result.step_s < step_s * 0.999:
                kept, step_s, improved = trial, result.step_s, True
    return kept, step_s


def _recompute_pass(
    checker: Checker,
    offload: list[int],
    ahead: int,
    sync_mode: int,
    step_s: float,
    spent: Callable[[], bool],
    remade: set[int],
) -> tuple[set[int], float]:
    """Starting from ``remade``, recompute instead of moving, largest first, each offloaded
    tensor that has a recipe where that still fits and shortens the predicted step, or leaves
    it as it was and holds less offloaded data (host memory and spill files: one such change
    alone may not shorten a step that waits on a disk, several together do)."""
    found = recipes(checker.trace)
    entries = checker.trace.entries()
    plan = checker.plan(
        offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
    )
    held = _held_bytes(checker.run(plan))
    candidates = [i for i in offload if i in found]
    # Recipes that make unsaved storages on the way come last: taken first, they may crowd out
    # chains that fit better.
    for ordinal in sorted(candidates, key=lambda i: (bool(found[i].scratch), -entries[i][1])):
        if spent():
            break
        if ordinal in remade or not _chains(found, remade, ordinal, chains=True):
            continue
        trial = remade | {ordinal}
        plan = checker.plan(
            offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=trial
        )
        result = checker.run(plan)
        if not checker.fits(result):
            continue
        faster = result.step_s < step_s * 0.999
        if faster or (result.step_s <= step_s and _held_bytes(result) < held):
            remade, step_s, held = trial, min(step_s, result.step_s), _held_bytes(result)
    return remade, step_s


def _combine(
    checker: Checker,
    offload: list[int],
    remade: set[int],
    ahead: int,
    sync_mode: int,
    step_s: float,
    spent: Callable[[], bool],
) -> tuple[set[int], int, int, float]:
    """Recompute two or three more offloaded tensors at once, with each prefetch distance,
    where that is faster: one alone may not fit or not pay (recomputing a block's output
    needs memory in backward that recomputing its neighbours frees). The largest
    `_COMBINED` candidates are tried; the fastest combination wins."""
    found = recipes(checker.trace)
    entries = checker.trace.entries()
    candidates = sorted(
        (i for i in offload if i in found and i not in remade), key=lambda i: -entries[i][1]
    )[:_COMBINED]
    variants = [(a, sync_mode) for a in sorted({ahead, *(a for a, s in VARIANTS if s == 0)})]
    best = remade
    for size in (2, 3):
        for combination in itertools.combinations(candidates, size):
            if spent():
                return best, ahead, sync_mode, step_s
            chosen = set(remade)  # each combination beside what was recomputed before
            for ordinal in combination:
                if not _chains(found, chosen, ordinal, chains=True):
                    break
                chosen.add(ordinal)
            else:
                faster = _fastest_variant(checker, offload, chosen, variants, step_s, spent)
                if faster is not None:
                    (step_s, ahead, _), best = faster, chosen
    return best, ahead, sync_mode, step_s


def _fastest_variant(
    checker: Checker,
    offload: list[int],
    remade: set[int],
    variants: Sequence[tuple[int, int]],
    step_s: float,
    spent: Callable[[], bool],
) -> tuple[float, int, int] | None:
    """The fastest of ``variants`` ((swapin_ahead, sync_mode) pairs) for offloading
    ``offload`` and recomputing ``remade`` that fits and beats ``step_s``: its step time and
    pair; None where none does."""
    best = None
    for ahead, sync_mode in variants:
        if spent():
            break
        plan = checker.plan(
            offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=remade
        )
        result = checker.run(plan)
        if checker.fits(result) and result.step_s < step_s * 0.999:
            best, step_s = (result.step_s, ahead, sync_mode), result.step_s
    return best


def _kinds(trace: Trace, moved: Sequence[int]) -> list[set[int]]:
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


def _distinct(*choices: set[int]) -> list[set[int]]:
    return [c for i, c in enumerate(choices) if c not in choices[:i]]


def _held_bytes(result: SimResult) -> int:
    return result.host_peak_bytes + result.disk_peak_bytes


def _chains(found: dict[int, Recipe], chosen: set[int], ordinal: int, *, chains: bool) -> bool:
    """Whether ``ordinal`` may be recomputed beside ``chosen``: with ``chains``, where each
    recomputed input of one is one backward reads no earlier; without, where none is."""
    recipe = found[ordinal]
    if not chains:
        return not set(recipe.inputs) & chosen and not any(
            ordinal in found[other].inputs for other in chosen
        )
    return all(source in recipe.chainable for source in set(recipe.inputs) & chosen) and all(
        ordinal in found[other].chainable for other in chosen if ordinal in found[other].inputs
    )


def _cheaper_to_recompute(
    checker: Checker, half: bool, *, chains: bool, convolutions: bool = True
) -> set[int]:
    """Tensors with a recipe that runs faster than their copy over the link, those that save
    the most time first, recomputed from one another only where ``chains`` allows (`_chains`);
    without ``convolutions``, only recipes bound by memory traffic (no FLOPs counted: norms,
    activations, elementwise arithmetic). Recipes that make unsaved storages on the way are
    left to the refinement, which prices their scratch memory: chosen here, where the copy
    time saved is all that counts, they crowd out chains that fit better."""
    found = recipes(checker.trace)
    seconds = op_seconds(checker.trace, checker.spec, half)
    entries = checker.trace.entries()
    ops = checker.trace.ops
    link = min(checker.spec.d2h_gbps, checker.spec.h2d_gbps) * 1e9
    saved = {
        i: entries[i][1] / link - sum(seconds[k] for k in recipe.ops)
        for i, recipe in found.items()
        if not recipe.scratch and (convolutions or not any(ops[k].flops for k in recipe.ops))
    }
    chosen: set[int] = set()
    for ordinal in sorted(saved, key=lambda i: -saved[i]):  # the most copy time saved first
        if saved[ordinal] > 0 and _chains(found, chosen, ordinal, chains=chains):
            chosen.add(ordinal)
    return chosen
