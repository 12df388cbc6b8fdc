"""The keep / offload / recompute choice as a mixed-integer program, solved by HiGHS through
`scipy.optimize.milp`, the simulator still the judge of what it returns.

Note: [The choice as a mixed-integer program]
Each saved storage takes one of three binary choices: keep it, offload it, or recompute it. The
program sees memory and time through two linear pictures of the step, both taken from the
simulator:

- Memory. The step without offload is simulated once. A storage a plan moves or remakes leaves
  the device once forward no longer reads it and is back by backward's first read of it, so the
  plain step's memory at each op, less every movable storage's bytes over that span, is what no
  choice can lower, and each kept storage adds its bytes back over its span. Between consecutive
  ends of those spans the set of kept storages that count is fixed, so one row per such
  segment, at that segment's highest base, bounds them all; rows that could not bind even with
  everything kept are left out.
- Time. A recomputed storage costs the forward ops of its replay, at the spec's op times. An
  offloaded one costs nothing while the link keeps up: for each of a number of windows of
  forward, what is saved from there on must leave over the link in the time forward has left,
  and for each run of windows of backward, what it reads back must arrive between the end of
  that run and `LOOKAHEAD` windows before its start (the runtime prefetches a few storages
  ahead, not from backward's start); what does not fit is time the step waits, one variable for
  each direction, added to the cost. Each copy is also charged a small share of its time
  (`MOVE_SHARE`), since copies hide only in part and the program would otherwise move all the
  link has room for.

A recomputed storage's inputs are not recomputed, unless its recipe may replay them in the same
chain. The simulator then runs the plan: where its peak passes the budget, the program is solved
again for a budget lowered by the excess, a few times at most, and the prefetch distance and
sync mode are chosen by simulation; then the per-tensor planner's polish moves single storages
while the simulator finds that faster, within a count of simulations. The pictures are coarse
(a copy's time in flight, the prefetch distance, a replay's own memory and the allocator's
rounding are the simulator's alone), which is why it judges.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy

from lms.analysis.clock import Clock
from lms.analysis.simulate import SimResult, op_seconds, simulate
from lms.core import costs
from lms.core.devices import DeviceSpec
from lms.core.extras import require
from lms.core.plan import Plan
from lms.core.recipes import recipes
from lms.core.records import StorageRecord, Trace
from lms.planning.candidates import Candidates
from lms.planning.greedy.polish import polish
from lms.planning.greedy.shared import VARIANTS
from lms.planning.minimum import smallest_plan

__all__ = ["plan_milp"]

log = logging.getLogger("lms.planning")

WINDOWS = 16
"""Windows of forward, and of backward, each with its own row for the link (Note [The choice as a
mixed-integer program])."""

LOOKAHEAD = 1
"""Windows of backward ahead of its reads that a copy in may start: the runtime prefetches a few
storages ahead, not from backward's start."""

ROUNDS = 5
"""Times the program is solved again for a lower budget where the simulator finds the plan over
the budget."""

MOVE_SHARE = 0.05
"""Share of a copy's time out and back charged to offloading a storage even where the link rows
say it hides: copies hide only in part (a wait at a window's edge, a read back that lands just
in time), and without a price the program moves whatever the link has room for."""


def plan_milp(
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    *,
    half: bool = False,
    time_limit_s: float = 20.0,
    polish_simulations: int = 300,
) -> Plan:
    """The plan a mixed-integer program chooses (Note [The choice as a mixed-integer program]),
    checked by the simulator.

    Args:
        time_limit_s: for each solve; HiGHS returns the best plan found by then.
        polish_simulations: simulations the per-tensor planner's polish may spend moving single
            storages of the program's plan while that is predicted faster (0: none).

    Raises:
        MissingExtraError: scipy is not installed (``large-model-support[solver]``).
        PlanInfeasibleError: when not even offloading everything fits. Where no solve gives a
            plan that fits, the smallest-memory plan is returned.
    """
    require("scipy", for_what="the mixed-integer planner")
    candidates = Candidates(trace, spec, budget_bytes, half)
    plain = simulate(trace, None, spec, half=half)  # its memory timeline too, for the program
    if candidates.fits(plain):
        return candidates.finish(candidates.plan((), source="milp"), plain)
    minimum_plan, _ = smallest_plan(candidates)
    program = _Program(candidates, half, plain)
    target = budget_bytes
    best: tuple[Plan, SimResult] | None = None
    for _ in range(ROUNDS):
        chosen = program.solve(target, time_limit_s)
        if chosen is None:
            break
        offload, recompute = chosen
        plan, result = _fastest_ahead(candidates, offload, recompute)
        if candidates.fits(result):
            best = plan, result
            break
        target -= result.peak_bytes - budget_bytes
    if best is None:
        log.info(
            "[LMS] [Planner] mixed-integer program: no solve in %d fitted the budget; the "
            "smallest-memory plan stands",
            ROUNDS,
        )
        best = minimum_plan, candidates.run(minimum_plan)
    plan, result = best
    if polish_simulations:
        limit = candidates.simulations + polish_simulations
        plan = dataclasses.replace(
            polish(candidates, plan, result.step_s, lambda: candidates.simulations >= limit),
            source="milp",
        )
        result = candidates.run(plan)
    log.info(
        "[LMS] [Planner] mixed-integer program: offload %d, recompute %d of %d saved storages; "
        "%d simulations",
        len(plan.offload),
        len(plan.recompute),
        candidates.num_entries,
        candidates.simulations,
    )
    return candidates.finish(plan, result)


def _fastest_ahead(
    candidates: Candidates, offload: list[int], recompute: list[int]
) -> tuple[Plan, SimResult]:
    """The plan with the prefetch distance and sync mode (the per-tensor planner's `VARIANTS`)
    whose simulated step is shortest among those that fit (the lowest peak where none does)."""
    tried = []
    for ahead, sync_mode in VARIANTS:
        plan = candidates.plan(
            offload, recompute=recompute, ahead=ahead, sync_mode=sync_mode, source="milp"
        )
        tried.append((plan, candidates.run(plan)))
    fitting = [pair for pair in tried if candidates.fits(pair[1])]
    if fitting:
        return min(fitting, key=lambda pair: pair[1].step_s)
    return min(tried, key=lambda pair: pair[1].peak_bytes)


@dataclasses.dataclass
class _Program:
    """The program's fixed parts for one trace and spec: spans, base memory, link rows."""

    candidates: Candidates
    half: bool
    plain: SimResult
    """The step without offload, simulated with its memory timeline."""

    def __post_init__(self) -> None:
        trace, spec = self.candidates.trace, self.candidates.spec
        entries = trace.entries()
        n = len(entries)
        self.n = n
        self.sizes = numpy.array([nbytes for _, nbytes, _ in entries], dtype=float)
        first_use: dict[int, int] = {}
        for event in trace.events:
            if event.kind == "use":
                first_use.setdefault(event.storage, event.op)
        end = len(trace.ops)
        storages = trace.storages
        # A storage moved or remade leaves once forward no longer reads it, and is back by
        # backward's first read of it.
        self.saved_at = numpy.array(
            [max(op, _let_go(storages[storage], end)) + 1 for storage, _, op in entries],
            dtype=numpy.int64,
        )
        self.used_at = numpy.maximum(
            numpy.array([first_use.get(storage, end) for storage, _, _ in entries]),
            self.saved_at,
        ).astype(numpy.int64)
        self.movable = numpy.array(
            [ordinal not in self.candidates.pinned for ordinal in range(n)], dtype=bool
        )
        seconds = op_seconds(trace, spec, self.half)
        self.starts = numpy.asarray(Clock(trace, None, spec, seconds).start, dtype=float)
        """When each op starts in the step without offload, and (last) when the step ends."""
        self.base = self._base_per_op()
        self.recompute_s = numpy.full(n, numpy.inf)
        self.recipes = recipes(trace)
        for ordinal, recipe in self.recipes.items():
            self.recompute_s[ordinal] = costs.replay_s(seconds, recipe.all_ops)
        self.backward_op = min(trace.backward_start_op, end)

    def _base_per_op(self) -> numpy.ndarray:
        """Device bytes at each op of the step without offload (the most seen while it runs),
        less what every movable storage holds where a plan could take it away: what no choice
        can lower."""
        times = numpy.asarray(self.plain.timeline_s, dtype=float)
        device = numpy.asarray(self.plain.device_bytes, dtype=float)
        ops = len(self.candidates.trace.ops)
        base = numpy.zeros(ops)
        if len(times):
            starts = self.starts[:ops]
            ends = numpy.append(starts[1:], numpy.inf)
            first = numpy.maximum(numpy.searchsorted(times, starts, side="right") - 1, 0)
            last = numpy.minimum(
                numpy.maximum(numpy.searchsorted(times, ends, side="left"), first + 1),
                len(device),
            )
            for op in range(ops):
                base[op] = device[first[op] : last[op]].max()
        for ordinal in numpy.nonzero(self.movable)[0]:
            base[self.saved_at[ordinal] : self.used_at[ordinal]] -= self.sizes[ordinal]
        return base

    def solve(self, budget_bytes: int, time_limit_s: float) -> tuple[list[int], list[int]] | None:
        """Offloaded and recomputed ordinals of the program's solution for ``budget_bytes``;
        None where HiGHS finds none."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array, csr_array

        candidates, n = self.candidates, self.n
        spec = candidates.spec
        cap = budget_bytes - spec.workspace_bytes
        keep, off, rec, out_wait, in_wait = 0, n, 2 * n, 3 * n, 3 * n + 1
        size = 3 * n + 2
        cost = numpy.zeros(size)
        cost[off:rec] = MOVE_SHARE * numpy.array(
            [costs.copy_out_s(spec, int(b)) + costs.copy_in_s(spec, int(b)) for b in self.sizes]
        )
        cost[rec : 3 * n] = numpy.where(numpy.isfinite(self.recompute_s), self.recompute_s, 0.0)
        cost[out_wait] = cost[in_wait] = 1.0
        lower, upper = numpy.zeros(size), numpy.ones(size)
        upper[out_wait] = upper[in_wait] = numpy.inf
        for ordinal in candidates.pinned:
            lower[keep + ordinal] = 1.0
        upper[rec : 3 * n][~numpy.isfinite(self.recompute_s)] = 0.0
        rows: list[tuple[dict[int, float], float, float]] = []
        for ordinal in range(n):  # one choice each
            rows.append(({keep + ordinal: 1.0, off + ordinal: 1.0, rec + ordinal: 1.0}, 1.0, 1.0))
        for ordinal, recipe in self.recipes.items():  # replays read what is there
            for source in set(recipe.inputs) - set(recipe.chainable):
                if source < n and source != ordinal:
                    rows.append(({rec + ordinal: 1.0, rec + source: 1.0}, 0.0, 1.0))
        rows.extend(self._memory_rows(keep, cap))
        rows.extend(self._link_rows(off, out_wait, in_wait))
        data, row_index, column = [], [], []
        low, high = [], []
        for r, (coefficients, lo, hi) in enumerate(rows):
            for c, value in coefficients.items():
                row_index.append(r)
                column.append(c)
                data.append(value)
            low.append(lo)
            high.append(hi)
        matrix = csr_array(coo_array((data, (row_index, column)), shape=(len(rows), size)))
        integrality = numpy.ones(size)
        integrality[out_wait] = integrality[in_wait] = 0
        solution = milp(
            cost,
            constraints=LinearConstraint(matrix, numpy.array(low), numpy.array(high)),
            integrality=integrality,
            bounds=Bounds(lower, upper),
            options={"time_limit": time_limit_s, "mip_rel_gap": 0.01},
        )
        if solution.x is None:
            log.info("[LMS] [Planner] mixed-integer program: %s", solution.message)
            return None
        x = numpy.round(solution.x)
        offload = [i for i in range(n) if x[off + i] > 0.5]
        recompute = [i for i in range(n) if x[rec + i] > 0.5]
        return offload, recompute

    def _memory_rows(self, keep: int, cap: float) -> list[tuple[dict[int, float], float, float]]:
        """One row per segment between consecutive span ends where keeping everything would
        not fit: the base there plus what is kept stays within ``cap``."""
        bounds = numpy.unique(numpy.concatenate([self.saved_at, self.used_at, [len(self.base)]]))
        rows = []
        for begin, stop in zip(bounds[:-1], bounds[1:], strict=True):
            if stop <= begin or begin >= len(self.base):
                continue
            base = float(self.base[begin:stop].max())
            live = numpy.nonzero(self.movable & (self.saved_at <= begin) & (self.used_at > begin))[
                0
            ]
            if base + self.sizes[live].sum() <= cap or not len(live):
                continue
            room = max(cap - base, 0.0)
            rows.append(({keep + int(i): float(self.sizes[i]) for i in live}, -numpy.inf, room))
        return rows

    def _link_rows(
        self, off: int, out_wait: int, in_wait: int
    ) -> list[tuple[dict[int, float], float, float]]:
        """Forward's copies out and backward's copies in, window by window, within the time
        the step gives them, the excess in the two wait variables."""
        spec = self.candidates.spec
        forward_end = float(self.starts[self.backward_op])
        rows = []
        for op in numpy.linspace(0, self.backward_op, WINDOWS, endpoint=False).astype(int):
            moved = numpy.nonzero(self.saved_at >= op)[0]
            if len(moved):
                row = {off + int(i): costs.copy_out_s(spec, int(self.sizes[i])) for i in moved}
                row[out_wait] = -1.0
                rows.append((row, -numpy.inf, forward_end - float(self.starts[op])))
        ops = len(self.base)
        edges = numpy.linspace(self.backward_op, ops, WINDOWS + 1).astype(int)
        for first in range(WINDOWS):  # the reads of windows first to last
            begin = float(self.starts[edges[max(first - LOOKAHEAD, 0)]])
            after = edges[first] if first else -1
            for last in range(first, WINDOWS):
                read = numpy.nonzero((self.used_at > after) & (self.used_at <= edges[last + 1]))[0]
                if len(read):
                    row = {off + int(i): costs.copy_in_s(spec, int(self.sizes[i])) for i in read}
                    row[in_wait] = -1.0
                    rows.append((row, -numpy.inf, float(self.starts[edges[last + 1]]) - begin))
        return rows


def _let_go(record: StorageRecord, end: int) -> int:
    """The op after which only autograd's saves hold ``record`` (`StorageRecord.let_go_op`),
    ``end`` for one that outlives the step."""
    let_go = record.let_go_op
    return end if let_go is None else let_go
