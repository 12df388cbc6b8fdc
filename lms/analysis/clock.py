"""The clock of a simulated step: when each op runs, when each copy moves, what the step waits for.

Pure, like the simulator that reads it. Ops run one after another. Copies out (device to host,
or to disk through host memory) and copies in run on one channel per direction, overlapping
compute; an op that needs a tensor still on its way in waits for it, and a recomputed storage is
made again, its inputs first, just before its first use in backward.
"""

from __future__ import annotations

import collections
import itertools

from lms.core import costs, policy
from lms.core.devices import DeviceSpec
from lms.core.plan import Plan
from lms.core.recipes import Recipe, recipes
from lms.core.records import JunctionRecord, Trace
from lms.core.sync import SyncMode

__all__ = ["Clock", "allowance", "relieved_junctions"]


def allowance(trace: Trace, budget_bytes: int) -> int:
    """The runtime's allowance for saved bytes: see `lms.LMS`."""
    known = trace.memo.get("allowance")
    if known is None:
        first_save = min((e.op for e in trace.events if e.offloadable), default=0)
        baseline = sum(
            s.nbytes
            for s in trace.storages
            if s.alloc_op < first_save and (s.free_op is None or s.free_op >= first_save)
        )
        largest = max((size for _, size, _ in trace.entries()), default=0)
        known = trace.memo["allowance"] = (baseline, policy.reserve_bytes(largest))
    return budget_bytes - known[0] - known[1]


def relieved_junctions(trace: Trace, plan: Plan | None) -> dict[int, JunctionRecord]:
    """The plan's relieved junctions that the trace saw as the plan counts them, by ordinal;
    each storage in one only."""
    if plan is None or not plan.relieved_junctions:
        return {}
    known = trace.junction_ordinals()
    counts = plan.junction_partials()
    chosen: dict[int, JunctionRecord] = {}
    used: set[int] = set()
    for ordinal in sorted(plan.relieved_junctions):
        junction = known.get(ordinal)
        if junction is None or junction.partials != counts[ordinal] or junction.sums & used:
            continue
        used |= junction.sums
        chosen[ordinal] = junction
    return chosen


def _uses(trace: Trace) -> tuple[dict[int, int], dict[int, list[int]]]:
    """The trace's first use and uses of each saved storage (Note [A trace derives once]), not
    copied: a clock only reads them."""
    found = trace.memo.get("uses")
    if found is None:
        found = trace.memo["uses"] = (trace.first_use_op(), trace.use_ops())
    return found  # type: ignore[no-any-return]


def _by_op(pairs: list[tuple[int, int]]) -> dict[int, list[int]]:
    """``(op, ordinal)`` pairs grouped by op, each group in the pairs' order."""
    grouped: dict[int, list[int]] = {}
    for op, ordinal in pairs:
        grouped.setdefault(op, []).append(ordinal)
    return grouped


class Clock:
    """One pass over the ops of ``trace`` under ``plan`` on ``spec``, each op taking ``seconds``.

    Its attributes are the pass's times, in seconds from the step's start: ``start`` and
    ``done_at`` of each op; ``out_start``/``out_done`` of each copy out, ``in_issue``/``in_done``
    of each copy in, ``reload_start`` of each read per use, ``recompute_start``/``recompute_end``
    of each replay, ``taken``/``rejoined`` of relieved partial gradients; ``end_s``, ``wait_s``
    and ``recompute_s`` of the step.
    """

    def __init__(self, trace: Trace, plan: Plan | None, spec: DeviceSpec, seconds: list[float]):
        self.trace = trace
        self.spec = spec
        self.seconds = seconds
        self.entries = entries = trace.entries()
        self.offload = set(plan.offload) if plan is not None else set()
        self.sync_out = plan is not None and SyncMode(plan.sync_mode).waits_out
        # Spilled entries go through host memory to disk and back, as the runtime moves them: a
        # blocking copy to the host, a background write; a background read, a blocking copy in.
        self.spill = set(plan.spill) if plan is not None else set()
        self.storage_of = {i: entries[i][0] for i in self.offload}
        self.first_use, use_ops = _uses(trace)  # read only
        # Entries read back per use: each later use loads the copy again, on demand.
        self.later_uses = {
            i: use_ops[self.storage_of[i]][1:]
            for i in (plan.refetch if plan is not None else ())
            if len(use_ops.get(self.storage_of[i], ())) > 1
        }
        self.reload_start: dict[int, list[float]] = {i: [] for i in self.later_uses}
        self.reloaded_early: set[tuple[int, int]] = set()
        """(entry, op) of later uses whose read back a replay made (Note [A replay reads back
        what it needs])."""
        self.at_op = 0  # the op the pass is at
        self.recompute = set(plan.recompute) if plan is not None else set()
        self.chosen: dict[int, Recipe] = recipes(trace) if self.recompute else {}
        self.relieved = relieved_junctions(trace, plan)
        self.free_held = plan.free_held_events() if plan is not None else {}
        """Entries emptied while the code holds them, and the event from which (`Plan`)."""
        self.gaps = (
            {o: g for o, g in plan.gaps_of().items() if o in self.offload}
            if plan is not None and plan.held_gaps
            else {}
        )
        """Their gaps in forward, ``(empty_at, fill_at)`` events (`Plan.held_gaps`)."""
        self.gap_spans: dict[int, list[tuple[float, float]]] = {}
        """For each, when each gap emptied it and when its fill began (gaps that emptied it)."""
        self.fills: list[tuple[int, float, float]] = []
        """Each fill's copy in: ordinal, start, end."""
        self.allowance = (
            allowance(trace, plan.budget_bytes)
            if plan is not None and plan.budget_bytes is not None
            else None
        )
        self.start = [0.0] * (len(trace.ops) + 1)
        self.done_at = [0.0] * len(trace.ops)
        self.out_start: dict[int, float] = {}
        self.out_done: dict[int, float] = {}
        self.in_issue: dict[int, float] = {}
        self.in_done: dict[int, float] = {}
        self.written: dict[int, float] = {}  # when a spill file's write ends
        self.recompute_start: dict[int, float] = {}
        self.recompute_end: dict[int, float] = {}
        self.taken: dict[tuple[int, int], tuple[float, float]] = {}  # copy out: start, done
        self.rejoined: dict[int, tuple[float, float]] = {}  # copies in: start, done
        self.d2h_free = self.h2d_free = self.disk_free = 0.0
        self._in_flight: collections.deque[tuple[float, int]] = collections.deque()
        self._in_flight_bytes = 0
        self.now = self.wait_s = self.recompute_s = self.copy_compute_s = 0.0
        self._run(plan.swapin_ahead if plan is not None else 2, plan)
        self.end_s = self.now

    def _schedule(self, ahead: int, sync_in: bool) -> None:
        """When each offloaded entry goes out, starts back (``ahead`` uses early) and is needed;
        when each recomputed entry is made again."""
        entries, first_use, storage_of = self.entries, self.first_use, self.storage_of
        self.reloads_at = _by_op(
            [(op, ordinal) for ordinal, ops in self.later_uses.items() for op in ops]
        )
        unknown = sorted(self.recompute - set(self.chosen))
        if unknown or self.recompute & self.offload:
            raise ValueError(
                f"lms: plan recomputes ordinals {unknown or sorted(self.recompute & self.offload)}"
                " that have no recipe or are also offloaded"
            )
        remakes: list[tuple[int, int]] = []
        for ordinal in self.recompute:
            recipe = self.chosen[ordinal]
            if any(i in self.recompute and i not in recipe.chainable for i in recipe.inputs):
                raise ValueError(
                    f"lms: plan recomputes ordinal {ordinal} from a recomputed one that backward "
                    "reads before it"
                )
            use_op = first_use.get(entries[ordinal][0])
            if use_op is not None:
                remakes.append((use_op, ordinal))
        self.recompute_at = _by_op(remakes)
        self.takes_at: dict[int, list[tuple[int, int]]] = {}
        for ordinal, junction in self.relieved.items():
            for k, arrive_op in enumerate(junction.arrive_ops[: junction.taken]):
                self.takes_at.setdefault(arrive_op, []).append((ordinal, k))
        self.joins_at = _by_op([(j.join_op, ordinal) for ordinal, j in self.relieved.items()])
        # Prefetch triggers: the use of the offloaded entry `ahead` places earlier in use order,
        # the order of the trace's reads (as the runtime's queue: `Plan.use_order`).
        used = [
            (first_use[storage_of[i]], i)
            for i in self.trace.use_order
            if i in self.offload and storage_of[i] in first_use
        ]
        first_backward_use = min(first_use.values(), default=self.trace.backward_start_op)
        issue_op: dict[int, int] = {}
        for rank, (use_op, ordinal) in enumerate(used):
            if sync_in:
                issue_op[ordinal] = use_op
            elif rank >= ahead:
                issue_op[ordinal] = used[rank - ahead][0]
            else:
                issue_op[ordinal] = first_backward_use
        saves, issues, needs = [], [], []
        for ordinal in self.offload:
            saves.append((entries[ordinal][2], ordinal))
            if ordinal in issue_op:
                issues.append((issue_op[ordinal], ordinal))
                needs.append((first_use[storage_of[ordinal]], ordinal))
        self.saves_at, self.issues_at, self.needs_at = _by_op(saves), _by_op(issues), _by_op(needs)
        event_ops = self.trace.event_ops
        empties, fills = [], []
        for ordinal, gaps in self.gaps.items():
            for empty_at, fill_at in gaps:
                empties.append((event_ops[empty_at - 1], ordinal))
                fills.append((event_ops[fill_at - 1], ordinal))
        self.empties_at, self.fills_at = _by_op(empties), _by_op(fills)

    def _run(self, ahead: int, plan: Plan | None) -> None:
        self._schedule(ahead, plan is not None and SyncMode(plan.sync_mode).on_demand)
        kept_at: dict[int, int] = {}
        for ordinal, (_, size, save_op) in enumerate(self.entries):
            if ordinal not in self.offload and ordinal not in self.recompute:
                kept_at[save_op] = kept_at.get(save_op, 0) + size
        kept = 0
        busy = {
            *kept_at,
            *self.saves_at,
            *self.takes_at,
            *self.issues_at,
            *self.recompute_at,
            *self.needs_at,
            *self.reloads_at,
            *self.joins_at,
            *self.empties_at,
            *self.fills_at,
        }
        num_ops = len(self.trace.ops)
        waiting = 0  # the first op not run yet
        for index in sorted(i for i in busy if 0 <= i <= num_ops):
            self._run_ops(waiting, index)  # up to this op; its copies and replays start first
            waiting = self.at_op = index
            if index < self.trace.backward_start_op:
                kept += kept_at.get(index, 0)
            for ordinal in self.saves_at.get(index, ()):
                self._save(ordinal, kept)
            for ordinal in self.empties_at.get(index, ()):
                self._empty(ordinal)
            for ordinal in self.fills_at.get(index, ()):
                self._fill(ordinal)
            for ordinal, k in self.takes_at.get(index, ()):
                self._take(ordinal, k)
            for ordinal in self.issues_at.get(index, ()):
                if ordinal not in self.in_done:
                    self._load(ordinal)
            for ordinal in self.recompute_at.get(index, ()):
                self._remake(ordinal)
            for ordinal in self.needs_at.get(index, ()):
                self._arrive(ordinal)
            for ordinal in self.reloads_at.get(index, ()):
                if (ordinal, index) not in self.reloaded_early:
                    self._reload(ordinal)
            for ordinal in self.joins_at.get(index, ()):
                self._join(ordinal)
        self._run_ops(waiting, num_ops + 1)

    def _run_ops(self, first: int, stop: int) -> None:
        """Run ops ``first..stop-1`` back to back from now (index ``len(ops)`` only starts: the
        step's end): ``now += seconds`` one op after another, in one call."""
        ops = min(stop, len(self.seconds))
        if first < ops:
            times = list(itertools.accumulate(self.seconds[first:ops], initial=self.now))
            self.start[first:ops] = times[:-1]
            self.done_at[first:ops] = times[1:]
            self.now = times[-1]
        if stop > len(self.seconds) >= first:
            self.start[len(self.seconds)] = self.now

    def _wait_until(self, time_s: float) -> None:
        if time_s > self.now:
            self.wait_s += time_s - self.now
            self.now = time_s

    def _block(self, seconds: float) -> None:
        """A copy the step waits for from now on."""
        self.wait_s += seconds
        self.now += seconds

    # Note: [Copies on a CPU take its cores]
    # On a GPU, copy engines move offloaded data while the cores compute. On a CPU, the spill
    # store's thread copies it, and while PyTorch's threads fill every core that thread takes one of
    # them: an op of two threads runs at the pace of the one that shares its core. Where the spec
    # says so (`DeviceSpec.copies_take_compute`) a copy that compute does not wait for costs it the
    # copy's time all the same, and one that it waits for costs that wait alone; that is the most it
    # costs, so plans priced so lean to recomputing where the copies would take compute's time.
    # Measured steps and plans: benchmarks/results/README.md, "Copies on a CPU".
    def _taken_from_compute(self, seconds: float) -> None:
        """A copy's ``seconds`` that compute loses to it (Note [Copies on a CPU take its
        cores])."""
        if self.spec.copies_take_compute:
            self.copy_compute_s += seconds
            self.now += seconds

    def _save(self, ordinal: int, kept: int) -> None:
        """Copy ``ordinal`` out as it is saved (Note [Copies out in flight])."""
        size = self.entries[ordinal][1]
        self.out_start[ordinal] = self.now
        out_s = costs.copy_out_s(self.spec, size)
        if ordinal in self.spill:
            self._block(out_s)
            self.out_done[ordinal] = self.now
            finish = max(self.now, self.disk_free) + costs.spill_write_s(self.spec, size)
            self.disk_free = self.written[ordinal] = finish
            return
        self.out_start[ordinal] = max(self.now, self.d2h_free)
        self.d2h_free = self.out_done[ordinal] = self.out_start[ordinal] + out_s
        pending = self._in_flight
        pending.append((self.d2h_free, size))
        self._in_flight_bytes += size
        self._taken_from_compute(out_s)
        if self.sync_out:
            self._wait_until(self.d2h_free)
        while pending and pending[0][0] <= self.now:  # finished
            self._in_flight_bytes -= pending.popleft()[1]
        # The runtime waits for copies out while they would hold the step over its budget.
        while (
            self.allowance is not None and pending and kept + self._in_flight_bytes > self.allowance
        ):
            done, nbytes = pending.popleft()
            self._in_flight_bytes -= nbytes
            self._wait_until(done)

    # Note: [Copies out in flight]
    # Copies out run one after another on one channel, so they finish in the order they started:
    # the copies still running are a queue whose head finishes first. The clock keeps that queue
    # and its bytes as it goes, so that each save costs the copies it retires, not a pass over
    # every copy still in flight (a long step saves thousands of tensors).

    def _empty(self, ordinal: int) -> None:
        """A gap of ``ordinal`` begins: wait for its copy out (a spilled one's write), then it is
        out of device memory (Note [Gaps in what the code holds])."""
        self._wait_until(self.written.get(ordinal, self.out_done[ordinal]))
        self.gap_spans.setdefault(ordinal, []).append((self.now, self.now))

    def _fill(self, ordinal: int) -> None:
        """Its gap ends: fill it again from its copy before forward reads it next, waiting."""
        size = self.entries[ordinal][1]
        emptied, _ = self.gap_spans[ordinal][-1]
        begin = self.now
        if ordinal in self.spill:
            start = max(self.now, self.disk_free)
            self.disk_free = start + costs.spill_read_s(self.spec, size)
            self._wait_until(self.disk_free + costs.copy_in_s(self.spec, size))
        else:
            start = max(self.now, self.h2d_free)
            self.h2d_free = start + costs.copy_in_s(self.spec, size)
            self._wait_until(self.h2d_free)
        self.fills.append((ordinal, start, self.now))
        self.gap_spans[ordinal][-1] = (emptied, begin)

    def _take(self, ordinal: int, k: int) -> None:
        """Copy the k-th partial gradient of a relieved junction out."""
        begin = max(self.now, self.d2h_free)
        self.d2h_free = begin + costs.copy_out_s(self.spec, self.relieved[ordinal].sizes[k])
        self.taken[ordinal, k] = (begin, self.d2h_free)
        self._taken_from_compute(self.d2h_free - begin)
        if self.sync_out:  # the runtime waits for every copy out, these too
            self._wait_until(self.d2h_free)

    def _load(self, ordinal: int) -> None:
        """Start bringing ``ordinal`` back now, after copies in already queued."""
        size = self.entries[ordinal][1]
        if ordinal in self.spill:
            begin = max(self.now, self.disk_free, self.written[ordinal])
            self.disk_free = self.in_done[ordinal] = begin + costs.spill_read_s(self.spec, size)
            return
        self.in_issue[ordinal] = self.now
        begin = max(self.now, self.h2d_free, self.out_done.get(ordinal, 0.0))
        seconds = costs.copy_in_s(self.spec, size)
        self.h2d_free = self.in_done[ordinal] = begin + seconds
        self._taken_from_compute(seconds)

    def _arrive(self, ordinal: int) -> None:
        """Wait until ``ordinal`` is back on the device (a spilled one: read, then copied in)."""
        self._wait_until(self.in_done[ordinal])
        if ordinal in self.spill and ordinal not in self.in_issue:
            self.in_issue[ordinal] = self.now
            self._block(costs.copy_in_s(self.spec, self.entries[ordinal][1]))
            self.in_done[ordinal] = self.now

    def _remake(self, ordinal: int) -> None:
        """Recompute ``ordinal`` now, unless a chain made it already. Its inputs must be on the
        device: offloaded ones are loaded now if not on their way, recomputed ones made first
        (and held until their own first use)."""
        if ordinal in self.recompute_start:
            return
        for source in self.chosen[ordinal].inputs:
            if source in self.recompute:
                self._remake(source)
            elif source in self.offload:
                if source not in self.in_done:
                    self._load(source)
                if not self._read_back_for_replay(source):
                    self._arrive(source)
        self.recompute_start[ordinal] = self.now
        cost = costs.replay_s(self.seconds, self.chosen[ordinal].all_ops)
        self.recompute_s += cost
        self.now += cost
        self.recompute_end[ordinal] = self.now

    # Note: [A replay reads back what it needs]
    # A replay that reads an offloaded entry read back per use, after backward's first use has
    # let that entry's copy go, has it read back again then, and the runtime holds that copy
    # for the entry's next read (`Replays`: sources are fetched with hold): the entry is on the
    # device from the replay to its next use, not only from just before that use. The read
    # back made here serves that use, which then reads nothing. Where no use is left to serve,
    # the read is counted in time alone.
    def _read_back_for_replay(self, source: int) -> bool:
        """Read ``source`` back now for a replay if its copy was let go (Note [A replay reads
        back what it needs]); False where its copy is on the device or on its way."""
        uses = self.later_uses.get(source)
        if uses is None or self.first_use[self.storage_of[source]] >= self.at_op:
            return False
        following = [op for op in uses if op >= self.at_op]
        if not following:
            self._block(costs.copy_in_s(self.spec, self.entries[source][1]))
        elif (source, following[0]) not in self.reloaded_early:  # else held since a replay
            self.reloaded_early.add((source, following[0]))
            self._reload(source)
        return True

    def _reload(self, ordinal: int) -> None:
        """Read ``ordinal`` back again for a later use, on demand."""
        size = self.entries[ordinal][1]
        if ordinal in self.spill:  # read again and copied in
            self.disk_free = max(self.now, self.disk_free) + costs.spill_read_s(self.spec, size)
            self.reload_start[ordinal].append(self.disk_free)
            self._wait_until(self.disk_free + costs.copy_in_s(self.spec, size))
            return
        begin = max(self.now, self.h2d_free)
        self.reload_start[ordinal].append(begin)
        self.h2d_free = begin + costs.copy_in_s(self.spec, size)
        self._wait_until(self.h2d_free)

    def _join(self, ordinal: int) -> None:
        """Bring a relieved junction's partials back to be summed."""
        junction = self.relieved[ordinal]
        copied = (self.taken[ordinal, k][1] for k in range(junction.taken))
        begin = max(self.now, self.h2d_free, *copied)
        self.h2d_free = begin + costs.copy_in_s(self.spec, junction.nbytes)
        self.rejoined[ordinal] = (self.now, self.h2d_free)
        self._wait_until(self.h2d_free)

    def op_end(self, index: int | None) -> float:
        """When the op's transient storages are freed: as soon as it finishes."""
        if index is None or index >= len(self.done_at):
            return self.end_s
        return self.done_at[index]

    def copy_spans(self) -> list[tuple[str, int, float, float]]:
        """The step's copies as ``(direction, ordinal, start_s, end_s)``: each copy out as the
        clock ran it, each copy in ending where the clock had it back (a spilled one read from
        its file), and each fill of a gap in forward (Note [Gaps in what the code holds])."""
        spans = [("out", o, self.out_start[o], done) for o, done in self.out_done.items()]
        for ordinal, done in self.in_done.items():
            size = self.entries[ordinal][1]
            took = (
                costs.spill_read_s(self.spec, size)
                if ordinal in self.spill
                else costs.copy_in_s(self.spec, size)
            )
            spans.append(("in", ordinal, done - took, done))
        spans.extend(("in", ordinal, start, end) for ordinal, start, end in self.fills)
        return spans
