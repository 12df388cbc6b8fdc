"""The planner for deep stacks of repeated blocks: one choice for each role a tensor plays in a
block, made alike in every block, each candidate checked by simulating the whole step.

Note: [Plan one block, apply it to all]
A transformer saves the same tensors in each of its layers (the attention's inputs, its softmax,
the MLP's activation, ...), and the per-tensor search spends its simulations choosing for each of
them alone: thousands of candidates over thousands of ops, for choices that come out alike layer
after layer. Here the saved tensors are grouped by their role, the operation that made them in a
module path with the layer's index left out, its output and its size (`roles`), and the search
chooses keep, offload or recompute for each role: a few dozen choices for any depth. Every
candidate is still the whole step simulated, so the plan fits by construction, as any planner's.
Tensors outside the repeated blocks (the embedding, the head, the loss) are roles of their own.

Note: [Coarse roles first]
A role may also be split into runs of consecutive layers (``depths``), so that early layers can
offload where late ones keep. Searched from scratch, four runs per role give the greedy search
four times the choices, and each of its sixteen starts (a prefetch variant, with or without
recompute, and its longest keepable prefix) then walks all of them one by one: most of the
planning time, for a search that often lands worse than the one with every layer alike. So
`lms.planning.auto` asks for ``depths=(1, 4)``: one run per role first, then that plan is the
finer search's only start, which keeps what it chose and moves single finer roles from there.
The refined plan is never predicted slower than its start (a start stands where nothing beats
it), and the finer search costs a fraction of the coarse one
(`benchmarks/results/tune_time_cpu.json`).

Note: [Each storage polished after its role]
A role's storages are alike in kind and size, not in where they fall: the first layer's input
waits longest for backward, the last layer's is read back almost at once, and a plan that
offloads the whole role may hide some of its copies and wait on others. From the roles' plan
the per-tensor planner's polish (`lms.planning.greedy.polish`) moves single storages between
kept, offloaded and recomputed while that is faster, within `POLISH_SIMULATIONS`; the polished
plan stands only where it is predicted faster. Measured: benchmarks/results/README.md, "Layers
numbered in their names".
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterable, Sequence

from lms.analysis.simulate import SimResult
from lms.core.devices import DeviceSpec
from lms.core.plan import Plan
from lms.core.recipes import recipes
from lms.core.records import Trace
from lms.planning.candidates import Candidates
from lms.planning.greedy.polish import polish
from lms.planning.greedy.shared import VARIANTS, chains_with
from lms.planning.greedy.starts import cheaper_to_recompute, distinct
from lms.planning.minimum import smallest_plan

__all__ = ["plan_blocks", "repeats", "roles"]

START_VARIANTS = ((1, 0), (4, 0), (1, 3))
"""The (swapin_ahead, sync_mode) pairs whose longest keepable prefixes are starts: the nearest
and a far prefetch, and the runtime's own pace. A variant moves a prefix by a prefetch or two,
and the search tries every variant (`VARIANTS`) for the plan it lands on, so these three found
the plans all eight found (GPT-2 medium at 12, 24 and 48 layers at 50% to 70% of its peak, the
Llama-3-8B shape at 70% and 80%) in a quarter less time (benchmarks/results/README.md,
"Planning time for language models")."""

POLISH_SIMULATIONS = 400
"""Simulations the per-storage polish of the roles' plan may spend (Note [Each storage polished
after its role])."""

log = logging.getLogger("lms.planning")

_Start = tuple[float, int, set[int], set[int], int, int]
"""A start of the role search: its predicted step, its place, the roles kept and recomputed, and
its prefetch variant (swapin_ahead, sync_mode)."""

_INDEX = re.compile(r"\.\d+(?=\.|$)")
"""A module path's index into a list of modules (``h.5``, ``layers.12``)."""

_NUMBERED = re.compile(r"^(.*?[^\d])(\d+)$")
"""A module's name that ends in a number after a stem (``encoder_layer_3``, ``block2``)."""


# Note: [Layers numbered in their names]
# Most stacks hold their layers in a ModuleList or a Sequential, whose children are named by
# their index (``layers.3``); some name each layer themselves, its number in the name
# (torchvision's ViT: ``encoder.layers.encoder_layer_3``; ``block1``, ``block2``). A number at
# the end of a name marks a layer of a stack only where its siblings share the stem and each of
# them holds modules of its own: a bottleneck's ``conv1``, ``conv2`` and ``conv3`` are leaves of
# one block, three roles, not one layer repeated. The numbered layers found so are a role's
# index as a list's are; each candidate is still the whole step simulated, so a grouping too
# coarse costs speed, never fit.
def _numbered_layers(modules: Sequence[str]) -> dict[str, str]:
    """Each module path whose last name numbers a layer of a stack (Note [Layers numbered in
    their names]), and that name with its number starred."""
    parents = {path.rpartition(".")[0] for path in modules}
    stems: dict[tuple[str, str], list[str]] = {}
    for path in modules:
        parent, _, name = path.rpartition(".")
        found = _NUMBERED.match(name)
        if parent and found and path in parents:
            stems.setdefault((parent, found.group(1)), []).append(path)
    return {
        path: f"{stem}*" for (_, stem), paths in stems.items() if len(paths) > 1 for path in paths
    }


def _generic(path: str, starred: dict[str, str]) -> str:
    """``path`` with the index of each layer of a stack on it starred, at any depth."""
    prefixes = itertools.accumulate(path.split("."), lambda head, name: f"{head}.{name}")
    names = [starred.get(head, head.rpartition(".")[2]) for head in prefixes]
    return _INDEX.sub(".*", ".".join(names))


def roles(trace: Trace) -> list[list[int]]:
    """The saved entries grouped by the role they play in a repeated block, in first-save order
    (Note [Plan one block, apply it to all])."""
    entries = trace.entries()
    starred = _numbered_layers(trace.modules)
    grouped: dict[tuple[object, ...], list[int]] = {}
    for ordinal, (storage, nbytes, _) in enumerate(entries):
        record = trace.storages[storage]
        if record.alloc_op < 0:
            key: tuple[object, ...] = ("input", ordinal)
        else:
            op = trace.ops[record.alloc_op]
            output = op.outputs.index(record.id) if record.id in op.outputs else -1
            key = (_generic(op.module, starred), op.name, output, nbytes)
        grouped.setdefault(key, []).append(ordinal)
    return list(grouped.values())


def repeats(trace: Trace) -> float:
    """How many entries a role holds on average: the depth of a stack of repeated blocks."""
    found = roles(trace)
    return len(trace.entries()) / max(len(found), 1)


def plan_blocks(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    free_held: bool = False,
    depths: int | Sequence[int] = 4,
    polished: bool = True,
) -> Plan:
    """The plan with the shortest predicted step that fits ``budget_bytes``, choosing alike for
    every tensor of one role in each of ``depths`` runs of consecutive layers (Note [Plan one
    block, apply it to all]), then, with ``polished``, moving single storages where that is
    faster (Note [Each storage polished after its role]).

    ``depths`` may be several counts, fewest first (``(1, 4)``): each search after the first
    starts from the plan before it (Note [Coarse roles first]); the fastest plan stands.

    Raises:
        PlanInfeasibleError: when not even offloading everything fits.
        ValueError: ``depths`` is empty or holds a count below one.
    """
    counts = (depths,) if isinstance(depths, int) else tuple(depths)
    if not counts or min(counts) < 1:
        raise ValueError(
            f"lms: depths must be counts of runs of layers of at least 1, not {depths!r}"
        )
    candidates = Candidates(trace, spec, budget_bytes, half, free_held=free_held)
    plain = candidates.run(None)
    if candidates.fits(plain):
        return candidates.finish(candidates.plan((), source="planner"), plain)
    best = smallest_plan(candidates)
    start: Plan | None = None
    for count in counts:
        search = _RoleSearch(candidates, depths=count)
        found = search.best(start)
        if found is not None:
            if start is None or found[1].step_s < best[1].step_s:
                best = found
            start = best[0]
        log.info(
            "[LMS] [Planner] %d roles (%d runs of layers) over %d saved storages: offload %d, "
            "recompute %d; swapin_ahead %d, sync_mode %d; %d simulations",
            len(search.roles),
            count,
            candidates.num_entries,
            len(best[0].offload),
            len(best[0].recompute),
            best[0].swapin_ahead,
            best[0].sync_mode,
            candidates.simulations,
        )
    if not polished:
        return candidates.finish(*best)
    # Note [Each storage polished after its role]
    before = candidates.simulations
    plan = polish(
        candidates,
        best[0],
        best[1].step_s,
        lambda: candidates.simulations >= before + POLISH_SIMULATIONS,
    )
    result = candidates.run(plan)
    if candidates.fits(result) and result.step_s < best[1].step_s:
        log.info(
            "[LMS] [Planner] single storages moved from the roles' plan: predicted %+.2f%% "
            "where it was %+.2f%%; %d simulations",
            100 * result.overhead,
            100 * best[1].overhead,
            candidates.simulations - before,
        )
        best = (plan, result)
    return candidates.finish(*best)


class _RoleSearch:
    """A greedy search over the roles' choices: keep the roles that cost least device memory
    per copy avoided, recompute where a replay is cheaper than the copy, then move single roles
    between keep, offload and recompute while that is faster."""

    def __init__(self, candidates: Candidates, *, depths: int = 4):
        self.candidates = candidates
        trace = candidates.trace
        self.entries = trace.entries()
        pinned = candidates.pinned
        self.roles = [
            part
            for role in roles(trace)
            for part in _by_depth([i for i in role if i not in pinned], depths)
            if part
        ]
        found = recipes(trace)
        self.recipes = found
        self._together: dict[frozenset[int], set[int]] = {}  # `_recomputable`'s answers
        first_use = trace.first_use_op()
        horizon = len(trace.ops)
        self.pressure = [
            sum(
                self.entries[i][1]
                * (first_use.get(self.entries[i][0], horizon) - self.entries[i][2])
                for i in members
            )
            for members in self.roles
        ]

    def _plan(self, kept: set[int], remade: set[int], ahead: int, sync_mode: int) -> Plan:
        members = self.roles
        keep = {i for r in kept for i in members[r]}
        recompute = self._recomputable({i for r in remade for i in members[r]} - keep)
        offload = [i for i in range(self.candidates.num_entries) if i not in keep]
        return self.candidates.plan(
            offload, ahead=ahead, sync_mode=sync_mode, source="planner", recompute=recompute
        )

    def _recomputable(self, wanted: Iterable[int]) -> set[int]:
        """Of ``wanted``, those that may be recomputed together (first saved first); the search
        asks again for the same sets, answered from memory."""
        key = frozenset(wanted)
        known = self._together.get(key)
        if known is None:
            known = set()
            for ordinal in sorted(key):
                if ordinal in self.recipes and chains_with(
                    self.recipes, known, ordinal, chains=True
                ):
                    known.add(ordinal)
            self._together[key] = known
        return set(known)

    def _run(self, kept: set[int], remade: set[int], ahead: int, sync: int) -> SimResult | None:
        result = self.candidates.run(self._plan(kept, remade, ahead, sync))
        return result if self.candidates.fits(result) else None

    def best(self, start: Plan | None = None) -> tuple[Plan, SimResult] | None:
        """The fastest plan found, with its simulation; None where no candidate fits."""
        count = len(self.roles)
        ranking = sorted(range(count), key=lambda r: self.pressure[r])
        everything = set(range(count))
        searched = self._starts(ranking, start)
        best: tuple[float, set[int], set[int], int, int] | None = None
        for _, _, kept, remade, ahead, sync in sorted(searched):
            for role in ranking:  # then one by one
                if role not in kept and self._run(kept | {role}, remade, ahead, sync):
                    kept = kept | {role}
            result = self._run(kept, remade, ahead, sync)
            if result is not None and (best is None or result.step_s < best[0]):
                best = (result.step_s, set(kept), set(remade - kept), ahead, sync)
        if best is None:
            return None
        step_s, kept, remade, ahead, sync = best
        step_s, ahead, sync = self._fastest_variant(kept, remade, step_s, ahead, sync)
        moved = True
        while moved:  # single roles between kept, offloaded and recomputed
            moved = False
            for role in sorted(everything, key=lambda r: -self.pressure[r]):
                for trial_kept, trial_remade in (
                    (kept - {role}, remade - {role}),
                    (kept | {role}, remade - {role}),
                    (kept - {role}, remade | {role}),
                ):
                    if (trial_kept, trial_remade) == (kept, remade):
                        continue
                    result = self._run(trial_kept, trial_remade, ahead, sync)
                    if result is not None and result.step_s < step_s * 0.999:
                        kept, remade, step_s, moved = trial_kept, trial_remade, result.step_s, True
                        break
            if moved:
                step_s, ahead, sync = self._fastest_variant(kept, remade, step_s, ahead, sync)
        if searched and min(searched)[0] < step_s:  # a start stands where nothing beat it
            step_s, _, kept, remade, ahead, sync = min(searched)
        plan = self._plan(kept, remade, ahead, sync)
        return plan, self.candidates.run(plan)

    def _starts(self, ranking: list[int], start: Plan | None) -> list[_Start]:
        """The starting points of the search, each with its predicted step: ``start``'s choices
        alone where given (Note [Coarse roles first]); otherwise, for each of `START_VARIANTS`,
        the longest keepable prefix of the ranking, with and without recomputing what may be,
        and, where some roles are recomputed, the longest keepable prefix of the roles left.

        Note: [A start keeps what recomputing frees room for]
        The ranking puts the roles that hold least memory for least time first, and those are
        often the ones cheapest to replay (a layer norm's output, an activation's input). A
        prefix of it keeps them, so recomputing them changes nothing, and a large role that
        would fit once they are replayed (the attention's softmax) is moved over the link. No
        single move leaves that plan: recomputing a small role alone only adds its replay, and
        keeping the large one alone does not fit. So each recomputed set also starts from the
        prefix of the roles it leaves: GPT-2 medium with 48 layers at 60% and 70% of its peak
        went from +18.9% and +17.7% predicted to +8.8% and +7.4%, the Llama-3-8B shape at 70%
        and 80% from +11.0% and +4.6% to +6.8% and +1.9%
        (`benchmarks/results/README.md`, "Planning time for language models")."""
        searched: list[_Start] = []
        if start is not None:
            kept, remade = self._choices(start)
            ahead, sync = start.swapin_ahead, start.sync_mode
            result = self._run(kept, remade, ahead, sync)
            if result is not None:
                searched.append((result.step_s, 0, kept, remade, ahead, sync))
            return searched
        recomputable = {
            r for r, members in enumerate(self.roles) if all(i in self.recipes for i in members)
        }
        # Recomputing every role that can be is a start where replays are cheap (norms and
        # activations); where matrix products can be replayed too, the roles whose replay costs
        # less than their copy are starts of their own (those bound by memory traffic alone, and
        # all), which the search may otherwise not reach by moving one role at a time.
        cheaper = [
            {r for r in recomputable if cheap.issuperset(self.roles[r])}
            for cheap in (
                cheaper_to_recompute(self.candidates, self.candidates.half, chains=True, flops=f)
                for f in (False, True)
            )
        ]
        lengths: dict[tuple[frozenset[int], int], int] = {}  # each start's prefix, as last found
        for ahead, sync in START_VARIANTS:
            for remade in distinct(set(), *cheaper, recomputable):
                # the prefix of every role, or of those left where what is recomputed is not kept
                left = [r for r in ranking if r not in remade]
                for order in [ranking, left] if len(left) < len(ranking) else [ranking]:
                    key = (frozenset(remade), len(order))
                    prefix = self._longest_prefix(order, remade, ahead, sync, lengths.get(key))
                    if prefix is not None:
                        lengths[key] = len(prefix)
                    result = None if prefix is None else self._run(prefix, remade, ahead, sync)
                    if prefix is not None and result is not None:
                        searched.append((result.step_s, len(searched), prefix, remade, ahead, sync))
        # Starts that keep and recompute alike differ only in their prefetch variant, which the
        # search tries again for what it lands on: the fastest of them stands for the others.
        fastest: dict[tuple[frozenset[int], frozenset[int]], _Start] = {}
        for found in sorted(searched):
            fastest.setdefault((frozenset(found[2]), frozenset(found[3])), found)
        return list(fastest.values())

    def _choices(self, plan: Plan) -> tuple[set[int], set[int]]:
        """The roles ``plan`` keeps (none of their tensors offloaded) and recomputes (any)."""
        recomputed = set(plan.recompute)
        moved = set(plan.offload) | recomputed
        kept = {r for r, members in enumerate(self.roles) if moved.isdisjoint(members)}
        remade = {r for r, members in enumerate(self.roles) if not recomputed.isdisjoint(members)}
        return kept, remade

    def _longest_prefix(
        self, ranking: list[int], remade: set[int], ahead: int, sync: int, guess: int | None = None
    ) -> set[int] | None:
        """The longest prefix of ``ranking`` that can stay on the device; None if none can.

        ``guess``: the length another prefetch variant found, where the search starts; a
        variant moves the peak by a prefetch or two, so it is most often the answer, found
        in two simulations instead of a bisection's six or more."""
        low, high = 0, len(ranking)
        if guess is not None and self._run(set(ranking[:guess]), remade, ahead, sync):
            if guess == high or not self._run(set(ranking[: guess + 1]), remade, ahead, sync):
                return set(ranking[:guess])
            low = guess + 1
        elif guess is not None:
            high = guess - 1
        if low == 0 and self._run(set(), remade, ahead, sync) is None:
            return None
        while low < high:
            middle = (low + high + 1) // 2
            if self._run(set(ranking[:middle]), remade, ahead, sync) is not None:
                low = middle
            else:
                high = middle - 1
        return set(ranking[:low])

    def _fastest_variant(
        self, kept: set[int], remade: set[int], step_s: float, ahead: int, sync: int
    ) -> tuple[float, int, int]:
        """The fastest prefetch distance and sync mode for the choices made."""
        for trial_ahead, trial_sync in VARIANTS:
            result = self._run(kept, remade, trial_ahead, trial_sync)
            if result is not None and result.step_s < step_s * 0.999:
                step_s, ahead, sync = result.step_s, trial_ahead, trial_sync
        return step_s, ahead, sync


def _by_depth(members: list[int], depths: int) -> list[list[int]]:
    """``members`` (in save order: layer by layer) in ``depths`` runs of consecutive layers."""
    count = len(members)
    parts = min(depths, count)
    return [members[count * k // parts : count * (k + 1) // parts] for k in range(parts)]
