"""Replay a traced step on a device spec: memory over time, copies on two channels, step time.

Pure: no torch.cuda, nothing allocated. Ops run one after another, each taking the longer of its
FLOPs at the device's peak rate and its bytes at the memory bandwidth. Copies out (device to host,
or to disk) and copies in run on one channel per direction, overlapping compute; an op that needs
a tensor still on its way in waits for it. Device memory counts every storage between the start of
the op that allocates it and the end of the op after which it is freed, rounded up by the
allocator's block size, plus the device's workspace margin; on a CPU, each op's scratch while it
runs, as estimated (Note [Convolution scratch on the CPU]) or as measured where that is more (Note
[An op's scratch, measured where it is timed]).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy
from torch.utils.weak import WeakIdKeyDictionary

from lms.analysis.clock import Clock, allowance
from lms.core import costs, policy
from lms.core.devices import MAPPED_ALONE_BYTES, DeviceSpec
from lms.core.plan import Plan
from lms.core.records import JunctionRecord, StorageRecord, Trace

__all__ = [
    "SimResult",
    "simulate",
    "runtime_plan",
    "Interval",
    "library_kept_bytes",
    "op_seconds",
    "share_of_peak",
]


class Interval(NamedTuple):
    """A storage resident on the device from ``start_s`` to ``end_s``.

    A named tuple, not a dataclass: a simulation makes one or more for each storage, and a
    planner simulates thousands of times.
    """

    storage: int
    """The storage's id; -1 for an op's scratch."""
    nbytes: int
    start_s: float
    end_s: float
    kind: str


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What the simulator predicts for one step."""

    peak_bytes: int
    """Device peak: rounded tensor bytes plus the workspace margin."""
    peak_tensor_bytes: int
    """Device peak of tensor bytes alone, unrounded (what `MemTracker` counts)."""
    peak_op: int
    """Index of the op running at the peak."""
    host_peak_bytes: int
    """Peak of host memory the offloaded copies take, each in its pool bucket
    (`DeviceSpec.host_copy_bytes`); for the "cpu" spec, of bytes in spill files."""
    offloaded_bytes: int
    offloaded_tensors: int
    step_s: float
    """Predicted step time with the plan."""
    base_step_s: float
    """Predicted step time without offload."""
    wait_s: float
    """Time ops waited for copies."""
    timeline_s: tuple[float, ...]
    """Times at which device memory changes."""
    device_bytes: tuple[int, ...]
    """Device bytes from each of those times on."""
    host_bytes: tuple[int, ...]
    """Offloaded bytes held on the host (or disk) from each of those times on."""
    recomputed_bytes: int = 0
    """Bytes of saved storages that backward recomputes instead of storing."""
    recompute_s: float = 0.0
    """Time spent recomputing them."""
    disk_peak_bytes: int = 0
    """Peak of bytes in spill files: the plan's ``spill`` entries, staged through host memory."""
    relieved_junctions: int = 0
    """Gradient junctions whose partials waited off the device (the plan's
    ``relieved_junctions``)."""
    relieved_bytes: int = 0
    """Bytes of those partials."""
    backward_start_s: float = 0.0
    """When the first backward op starts."""
    copy_compute_s: float = 0.0
    """Compute time lost to copies that take the cores compute runs on (Note [Copies on a CPU
    take its cores])."""
    residency: _Residency | None = dataclasses.field(default=None, repr=False, compare=False)

    @functools.cached_property
    def intervals(self) -> tuple[Interval, ...]:
        """When each storage is on the device, in the order of the trace's storages (made on
        first use: planners read only the totals)."""
        return self.residency.intervals() if self.residency is not None else ()

    def peak_after(self, time_s: float) -> tuple[int, int]:
        """Device bytes just before ``time_s`` and their peak from then on."""
        before = [b for t, b in zip(self.timeline_s, self.device_bytes, strict=True) if t < time_s]
        after = [b for t, b in zip(self.timeline_s, self.device_bytes, strict=True) if t >= time_s]
        return (before[-1] if before else 0), max(after, default=0)

    @property
    def overhead(self) -> float:
        """Predicted slowdown: step time over the no-offload step time, minus one.

        Never negative: waits and recomputation only add time, so a difference below zero is
        rounding in the two sums.
        """
        if self.base_step_s <= 0:
            return 0.0
        return max(0.0, self.step_s / self.base_step_s - 1.0)

    def fits(self, memory_bytes: int) -> bool:
        """Whether the peak fits in ``memory_bytes``."""
        return self.peak_bytes <= memory_bytes


def op_seconds(
    trace: Trace, spec: DeviceSpec, half: bool, *, write_log: bool = False
) -> list[float]:
    """Predicted seconds of each op of ``trace`` on ``spec``; with ``write_log``, under the
    runtime's write log, as while a plan recomputes (`DeviceSpec.write_log_op_s`)."""
    key = ("op_seconds", spec, half, write_log)
    known = trace.memo.get(key)
    if known is None:
        overhead = spec.op_overhead_s + (spec.write_log_op_s if write_log else 0.0)
        fresh = _fresh_seconds(trace, spec)
        timed = _timed_seconds(trace, spec)
        known = trace.memo[key] = tuple(
            overhead
            + (
                costs.compute_s(spec, flops=op.flops, working_set_bytes=op.moved_bytes, half=half)
                + fresh.get(i, 0.0)
                if seconds is None
                else seconds + (fresh.get(i, 0.0) if op.name in _UNWRITTEN else 0.0)
            )
            for (i, op), seconds in zip(enumerate(trace.ops), timed, strict=True)
        )
    return list(known)


# Note: [Memory made but not written is faulted in by its first writer]
# An op timed alone on the device faults in the pages of the outputs it makes, as in the step
# (Note [Fresh pages]), and runs on made-up inputs whose pages are in already. An `empty` makes
# memory it does not write: its time has none of those faults, and the op that fills it in
# place (a CPU dropout's `bernoulli_` on an `empty_like`) is timed on memory written before, so
# the step paid them where neither time did. A 64 MiB `bernoulli_` took 97 ms after an
# `empty` under the budget's threshold against 70 ms on memory written before. So an `empty`
# timed alone is priced with the faults of what it makes, as an op the rates price is.
_UNWRITTEN = frozenset(
    {
        "aten.empty.memory_format",
        "aten.empty_like.default",
        "aten.empty_strided.default",
        "aten.empty_permuted.default",
        "aten.new_empty.default",
        "aten.new_empty_strided.default",
    }
)
"""Ops that make memory and leave it unwritten."""


# Note: [Ops timed on the device]
# The rates price an op by its FLOPs or its bytes, whichever takes longer at the device's measured
# convolution and add, and many ops run far off both (batch norms and poolings with indices on a
# CPU, a GPU's convolutions faster than the one measured). Where a plan is made for the device it
# runs on, `lms.orchestration.timing.time_ops` runs each distinct call of the trace alone on real
# tensors of its shapes, and the simulator takes those times (plus the spec's per-op overhead, for
# the framework's own work around each op) in place of the rates, for that trace alone (the
# fingerprint must match). Ops not timed keep the rates. Replays are the same ops, so a plan prices
# its recomputation at what it costs too. Each time is the fastest of its runs, under the C
# allocator's threshold the step runs under (`DeviceSpec.page_mapped_bytes`, Note [Fresh pages]):
# with glibc's own, on a warm heap, since below `FRESH_PAGES_BYTES` a step's tensors mostly reuse
# memory; under a CPU budget's, each allocation of a MiB or more faults its pages in at every run,
# as in the step, a convolution's scratch as well as its output, which the rates cannot see. How
# far the rates and the times were off: benchmarks/results/README.md, "Ops timed on the device".
def _timed_seconds(trace: Trace, spec: DeviceSpec) -> list[float | None]:
    """The measured seconds of each op of ``trace`` on ``spec`` (Note [Ops timed on the
    device]): None for each op without a time, and for all where the spec's are another
    trace's."""
    seconds = _measured(trace, spec, "seconds")
    return [None] * len(trace.ops) if seconds is None else list(seconds)


def _measured(
    trace: Trace, spec: DeviceSpec, field: Literal["seconds", "scratch", "kept"]
) -> tuple[Any, ...] | None:
    """That ``field`` of ``spec``'s op timings, by op index, where they are ``trace``'s; None
    where the spec has none, they are another trace's, or that field was not measured."""
    timings = spec.op_timings
    if timings is None or timings.fingerprint != trace.fingerprint():
        return None
    values: tuple[Any, ...] = getattr(timings, field)
    return values if len(values) == len(trace.ops) else None


def _fresh_seconds(trace: Trace, spec: DeviceSpec) -> dict[int, float]:
    """Seconds each op spends first writing storages mapped anew for it (`costs.fresh_pages_s`),
    by op index; empty where the spec has no such cost."""
    if spec.fresh_memory_gbps is None:
        return {}
    seconds: dict[int, float] = {}
    for storage in trace.storages:
        added = costs.fresh_pages_s(spec, storage.nbytes) if storage.alloc_op >= 0 else 0.0
        if added:
            seconds[storage.alloc_op] = seconds.get(storage.alloc_op, 0.0) + added
    return seconds


def runtime_plan(trace: Trace, budget_bytes: int, *, swapin_ahead: int = 2) -> Plan:
    """The plan `lms.LMS(budget=...)` follows on its own from the second step on.

    It keeps the newest saved tensors and offloads the oldest while the saved bytes would exceed
    the budget less what was allocated before the first save and a reserve for the running op;
    storages that a save kept in place holds (`Trace.held`) and the step's inputs, which the
    caller holds, stay (the runtime finds both moved and still alive at the end of its first
    step).
    """
    entries = trace.entries()
    nbytes = [size for _, size, _ in entries]
    storages = trace.storages
    held = {
        i
        for i, (storage, _, _) in enumerate(entries)
        if storage in trace.held or storages[storage].alloc_op < 0
    }
    chosen = policy.budget_offloads(nbytes, allowance(trace, budget_bytes), held)
    return Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(sorted(chosen)),
        num_entries=len(entries),
        swapin_ahead=swapin_ahead,
        budget_bytes=budget_bytes,
    )


def share_of_peak(trace: Trace, spec: DeviceSpec, share: float, *, half: bool = False) -> int:
    """The budget that a share such as ``"60%"`` asks for: that share of the step's simulated
    peak of tensors without offload, with the workspace ``spec`` keeps free for libraries on top,
    whole. No plan lowers the workspace, so a share of it would only make a small step's budget
    impossible (60% of a 23 MiB step beside a 512 MiB workspace is under the workspace alone)."""
    tensors = simulate(trace, None, spec, half=half).peak_bytes - spec.workspace_bytes
    return int(share * tensors) + spec.workspace_bytes


def simulate(
    trace: Trace,
    plan: Plan | None,
    spec: DeviceSpec,
    *,
    half: bool = False,
) -> SimResult:
    """Predict device and host memory and the step time of ``trace`` under ``plan`` on ``spec``.

    Args:
        trace: from `lms.analysis.trace.trace_step`.
        plan: which saved storages to offload; None for none.
        spec: the device and its link.
        half: price matmuls and convolutions at the fp16/bf16 rate (autocast runs).
    """
    seconds = op_seconds(trace, spec, half, write_log=plan is not None and bool(plan.recompute))
    clock = Clock(trace, plan, spec, seconds)
    held = _Residency(clock)
    times, device, host, peak_tensor = _sweep(
        held.columns(), held.host_spans, spec, held.graph_columns()
    )
    peak_rounded = max(device, default=0)
    peak_time = times[device.index(peak_rounded)] if device else 0.0
    peak_op = max(bisect.bisect_right(clock.start, peak_time, hi=len(trace.ops)) - 1, 0)
    entries = clock.entries
    return SimResult(
        peak_bytes=peak_rounded + spec.workspace_bytes,
        peak_tensor_bytes=peak_tensor,
        peak_op=peak_op,
        host_peak_bytes=max(host, default=0),
        offloaded_bytes=sum(entries[i][1] for i in clock.offload),
        offloaded_tensors=len(clock.offload),
        step_s=clock.end_s,
        base_step_s=sum(op_seconds(trace, spec, half)),
        wait_s=clock.wait_s,
        timeline_s=tuple(times),
        device_bytes=tuple(device),
        host_bytes=tuple(host),
        recomputed_bytes=sum(entries[i][1] for i in clock.recompute),
        recompute_s=clock.recompute_s,
        disk_peak_bytes=max(_sweep(None, held.disk_spans, spec)[2], default=0),
        relieved_junctions=len(clock.relieved),
        relieved_bytes=sum(j.nbytes for j in clock.relieved.values()),
        backward_start_s=clock.start[min(trace.backward_start_op, len(trace.ops))],
        copy_compute_s=clock.copy_compute_s,
        residency=held,
    )


_Span = tuple[float, float, int]  # held from, held to, bytes


class _Residency:
    """When each storage of a clocked step is on the device (`intervals`), and when each
    offloaded copy is in host memory (``host_spans``) or in a spill file (``disk_spans``).

    Storages the plan leaves alone, and ops' scratch, are held as columns (Note [Residency in
    columns]); what the plan moves, recomputes or relieves, interval by interval.
    """

    def __init__(self, clock: Clock):
        self.clock = clock
        self.scratch = _scratch_ops(clock.trace, clock.spec)
        self.special: list[Interval] = []
        self.positions: list[int] = []  # of each special interval, in the storages' order
        self.position = -1
        self.host_spans: list[_Span] = []
        self.disk_spans: list[_Span] = []
        entries = clock.entries
        moved = {clock.storage_of[i]: i for i in clock.offload}
        remade = {entries[i][0]: i for i in clock.recompute}
        roles = _junction_roles(clock.relieved)
        self.last_reads = _LAST_READS.get(clock.trace)
        if self.last_reads is None:
            self.last_reads = _LAST_READS[clock.trace] = {}
        for ordinal, junction in clock.relieved.items():
            for k, size in enumerate(junction.sizes[: junction.taken]):
                span = (clock.taken[ordinal, k][0], clock.rejoined[ordinal][1])
                self.host_spans.append((*span, clock.spec.host_copy_bytes(size)))
            if junction.taken > 1:  # the sum so far and the next partial, while copied in
                loading = (junction.merged, junction.sizes[0], *clock.rejoined[ordinal])
                self._put(Interval(*loading, "reloaded"))
        storages = clock.trace.storages
        touched = sorted({*roles, *remade, *moved})
        for sid in touched:
            self.position = sid
            if sid in roles:
                self._junction(storages[sid], roles[sid])
            elif sid in remade:
                self._remade(storages[sid], remade[sid])
            else:
                self._moved(storages[sid], moved[sid])
        # On the device from its allocation to its free (clock.op_end, by index).
        columns = _storage_columns(clock.trace)
        self.plain = numpy.ones(len(storages), dtype=bool)
        self.plain[touched] = False
        self.starts = numpy.array(clock.start)
        self.ends = numpy.array([*clock.done_at, clock.end_s])
        alloc = columns.alloc[self.plain]
        self.plain_begin = numpy.where(alloc < 0, 0.0, self.starts[numpy.maximum(alloc, 0)])
        self.plain_end = self.ends[columns.free[self.plain]]
        self.scratch_ops = numpy.fromiter(self.scratch, numpy.int64, len(self.scratch))
        self.graph_bytes = clock.spec.graph_bytes_per_op
        graph: tuple[numpy.ndarray, int] = (
            _graph_ops(clock.trace) if self.graph_bytes else (numpy.zeros(0, numpy.int64), -1)
        )
        self.graph_ops, last = graph
        self.graph_end = float(self.ends[last]) if last >= 0 else clock.end_s

    # Note: [Residency in columns]
    # A planner simulates thousands of times, and most storages stay where the step puts them
    # whatever the plan: their intervals come from the op clock by indexing, a few numpy calls a
    # simulation rather than a Python object a storage. The sweep over device bytes reads the
    # columns; `intervals` makes the named tuples only when a report asks for them.

    def _put(self, interval: Interval) -> None:
        self.special.append(interval)
        self.positions.append(self.position)

    def columns(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Bytes, start and end of every interval (storages left alone, moved ones, scratch)."""
        columns = _storage_columns(self.clock.trace)
        special = self.special
        scratch_bytes = numpy.fromiter(self.scratch.values(), numpy.int64, len(self.scratch))
        nbytes = numpy.concatenate(
            [
                columns.nbytes[self.plain],
                numpy.fromiter((i.nbytes for i in special), numpy.int64, len(special)),
                scratch_bytes,
            ]
        )
        begin = numpy.concatenate(
            [
                self.plain_begin,
                numpy.fromiter((i.start_s for i in special), numpy.float64, len(special)),
                self.starts[self.scratch_ops],
            ]
        )
        end = numpy.concatenate(
            [
                self.plain_end,
                numpy.fromiter((i.end_s for i in special), numpy.float64, len(special)),
                self.ends[self.scratch_ops],
            ]
        )
        return nbytes, begin, end

    def graph_columns(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray] | None:
        """Bytes, start and end of the autograd graph's share of each forward op, held to
        backward's end (Note [The autograd graph on a CPU's heap]); None where the spec counts
        none."""
        if not self.graph_bytes:
            return None
        count = len(self.graph_ops)
        end = numpy.full(count, self.graph_end)
        return numpy.full(count, self.graph_bytes, numpy.int64), self.starts[self.graph_ops], end

    def intervals(self) -> tuple[Interval, ...]:
        """Every interval: by storage (what happened before the storages first), then each op's
        scratch (Note [Convolution scratch on the CPU]), then the graph's share of each forward
        op."""
        storages = self.clock.trace.storages
        ids = numpy.flatnonzero(self.plain).tolist()
        plain = [
            Interval(sid, storages[sid].nbytes, begin, end, storages[sid].kind)
            for sid, begin, end in zip(
                ids, self.plain_begin.tolist(), self.plain_end.tolist(), strict=True
            )
        ]
        placed = sorted(
            [*zip(ids, plain, strict=True), *zip(self.positions, self.special, strict=True)],
            key=lambda item: item[0],
        )
        start, done_at = self.clock.start, self.clock.done_at
        scratch = [
            Interval(-1, nbytes, start[index], done_at[index], "scratch")
            for index, nbytes in self.scratch.items()
        ]
        graph = [
            Interval(-1, self.graph_bytes, start[index], self.graph_end, "graph")
            for index in self.graph_ops.tolist()
        ]
        return tuple(interval for _, interval in placed) + tuple(scratch) + tuple(graph)

    def _begin(self, record: StorageRecord) -> float:
        return 0.0 if record.alloc_op < 0 else self.clock.start[record.alloc_op]

    def _add(self, record: StorageRecord, begin: float, end: float, kind: str = "") -> None:
        self._put(Interval(record.id, record.nbytes, begin, end, kind or record.kind))

    def _hold(self, ordinal: int, finish: float, nbytes: int) -> None:
        """Where the offloaded copy of ``ordinal`` is kept, from its copy out to ``finish``."""
        begin = self.clock.out_start[ordinal]
        if ordinal in self.clock.spill:  # its staging copy, freed once written, is not counted
            self.disk_spans.append((begin, finish, nbytes))
        else:
            self.host_spans.append((begin, finish, self.clock.spec.host_copy_bytes(nbytes)))

    def _junction(self, record: StorageRecord, roles: list[tuple[int, int]]) -> None:
        clock = self.clock
        begin, finish = self._begin(record), clock.op_end(record.free_op)
        for ordinal, k in roles:
            junction = clock.relieved[ordinal]
            if k == _MERGED:  # the sum is made in the copy brought back
                self._add(record, clock.rejoined[ordinal][0], finish, "reloaded")
            elif k >= junction.taken:  # the last waits where the engine sums
                self._add(record, begin, max(clock.rejoined[ordinal][1], finish))
            elif k >= 0:  # on the device until copied out and read
                read = clock.op_end(_last_read(clock.trace, self.last_reads, junction, k))
                self._add(record, begin, max(clock.taken[ordinal, k][1], read))

    def _remade(self, record: StorageRecord, ordinal: int) -> None:
        """Freed after forward; made again, with its scratch storages, before backward's use."""
        clock = self.clock
        last = record.free_op if record.id in clock.trace.held else record.let_go_op
        self._add(record, self._begin(record), clock.op_end(last))
        if ordinal not in clock.recompute_start:
            return
        start, end = clock.recompute_start[ordinal], clock.recompute_end[ordinal]
        self._add(record, start, clock.op_end(record.free_op), "recomputed")
        for scratch in clock.chosen[ordinal].scratch:  # made on the way, freed at its end
            nbytes = clock.trace.storages[scratch].nbytes
            self._put(Interval(scratch, nbytes, start, end, "recomputed"))
        most = max((self.scratch.get(i, 0) for i in clock.chosen[ordinal].all_ops), default=0)
        if most:  # the largest replayed op's, while the replay runs
            self._put(Interval(-1, most, start, end, "scratch"))

    def _emptied(self, record: StorageRecord, ordinal: int, into_backward: bool) -> float | None:
        """When the runtime empties ``ordinal`` while the code holds it (``into_backward``: for
        the whole of forward): at the first saved-tensor event from its plan's, once its copy out
        is done, before backward reads it and before the code lets go of it; None when that
        never comes (Note [Emptying what the code holds])."""
        clock = self.clock
        event_ops, first_use_level = clock.trace.event_ops, clock.trace.first_use_levels
        after_copy = bisect.bisect_left(clock.start, clock.out_done[ordinal])
        event = max(clock.free_held[ordinal] - 1, bisect.bisect_left(event_ops, after_copy))
        if event >= min(len(event_ops), first_use_level.get(record.id, len(event_ops) + 1) - 1):
            return None
        emptied = clock.start[event_ops[event]]
        if not into_backward and emptied >= clock.op_end(record.last_forward_op):
            return None  # the code let go first: the copy out frees it
        return emptied

    def _moved(self, record: StorageRecord, ordinal: int) -> None:
        """On the device until copied out, and again from each load to the use it serves."""
        clock = self.clock
        begin, finish = self._begin(record), clock.op_end(record.free_op)
        # Note [Gaps in what the code holds]: off the device between each gap's two ends
        for emptied_s, filled_s in clock.gap_spans.get(ordinal, ()):
            self._add(record, begin, emptied_s)
            begin = filled_s
        if ordinal in clock.free_held:
            into_backward = record.alloc_op < 0 or record.id in clock.trace.held_by_code
            emptied = self._emptied(record, ordinal, into_backward)
            if emptied is not None:  # filled again in place by its copy in
                self._add(record, begin, emptied)
                self._add(record, clock.in_issue.get(ordinal, finish), finish, "reloaded")
                self._hold(ordinal, finish, record.nbytes)
                return
            if into_backward:
                self._add(record, begin, finish)  # backward reads it where it stayed
                self._hold(ordinal, finish, record.nbytes)
                return
        if record.alloc_op < 0 or record.id in clock.trace.held:
            # Held outside autograd since before the step (an input), or by a save that stays:
            # the copy frees nothing, and what comes back is another copy.
            self._add(record, begin, finish)
        else:
            out = max(clock.out_done[ordinal], clock.op_end(record.let_go_op))
            self._add(record, begin, out)
        if ordinal in clock.in_issue:
            # Per use when read back per use: held from each load to the end of that use.
            uses = clock.later_uses.get(ordinal, [])
            starts = [clock.in_issue[ordinal], *clock.reload_start.get(ordinal, [])]
            served = [clock.first_use[record.id], *uses][: len(uses)]
            read_ends = clock.trace.read_ends
            ends = [*(clock.op_end(read_ends[record.id, op]) for op in served), finish]
            for load_s, end_s in zip(starts, ends, strict=True):
                self._add(record, load_s, end_s, "reloaded")
        self._hold(ordinal, finish, record.nbytes)


class _StorageColumns(NamedTuple):
    nbytes: numpy.ndarray
    alloc: numpy.ndarray
    """The op that allocates each storage; -1 before the step."""
    free: numpy.ndarray
    """The op after which each is freed; the op count when it outlives the step."""


def _storage_columns(trace: Trace) -> _StorageColumns:
    """The trace's storages as columns, by id (Note [A trace derives once])."""
    found = trace.memo.get("storage_columns")
    if found is None:
        num_ops = len(trace.ops)
        records = trace.storages
        found = trace.memo["storage_columns"] = _StorageColumns(
            numpy.fromiter((r.nbytes for r in records), numpy.int64, len(records)),
            numpy.fromiter((r.alloc_op for r in records), numpy.int64, len(records)),
            numpy.fromiter(
                (num_ops if r.free_op is None else min(r.free_op, num_ops) for r in records),
                numpy.int64,
                len(records),
            ),
        )
    return found  # type: ignore[no-any-return]


def _graph_ops(trace: Trace) -> tuple[numpy.ndarray, int]:
    """Indices of the trace's forward ops, and of its last backward op (-1 if none), where the
    autograd graph is gone (Note [A trace derives once])."""
    found = trace.memo.get("graph_ops")
    if found is None:
        phases = [op.phase for op in trace.ops]
        last = max((i for i, phase in enumerate(phases) if phase == "backward"), default=-1)
        forward = [i for i, phase in enumerate(phases) if phase == "forward"]
        found = trace.memo["graph_ops"] = (numpy.array(forward, dtype=numpy.int64), last)
    return found  # type: ignore[no-any-return]


# Note: [A measured scratch has room for the step's]
# An op that takes scratch of its own can take more of it in a step than where it was timed,
# alone, after runs that left the heap its pages: AttentionUnet's pointwise convolution backward
# at 64^3 took 32.05 MiB of scratch alone, the same over eight runs, and in the step peaked 0.7
# to 1.2 MiB over its simulation, past a budget its plan had packed to within 0.1%. So a
# scratch measured at a MiB or more counts 1/`_SCRATCH_PAD` more: a budget within that of such
# an op's peak is refused rather than passed in the step. Measured: benchmarks/results/README.md,
# "Traces in slabs".
_SCRATCH_PAD = 32


def _scratch_ops(trace: Trace, spec: DeviceSpec) -> dict[int, int]:
    """The ops that take CPU scratch on ``spec``, and its bytes: the larger of the trace's
    estimate and what the spec's op timings measured (Note [An op's scratch, measured where it
    is timed] in `lms.orchestration.timing`), with room for the step's (Note [A measured scratch
    has room for the step's]); none where the spec takes no CPU scratch (Note [A trace derives
    once])."""
    if not spec.cpu_scratch:
        return {}
    estimated = trace.memo.get("cpu_scratch")
    if estimated is None:
        estimated = trace.memo["cpu_scratch"] = {
            op.index: op.cpu_scratch_bytes for op in trace.ops if op.cpu_scratch_bytes
        }
    measured = _measured(trace, spec, "scratch")
    if measured is None:
        return estimated  # type: ignore[no-any-return]
    key = ("cpu_scratch", spec.op_timings)  # compared by identity
    found = trace.memo.get(key)
    if found is None:
        found = dict(estimated)
        for index, nbytes in enumerate(measured):
            if nbytes is not None and nbytes >= MAPPED_ALONE_BYTES:  # below, pages the heap had
                found[index] = max(found.get(index, 0), nbytes + nbytes // _SCRATCH_PAD)
        trace.memo[key] = found
    return found  # type: ignore[no-any-return]


def library_kept_bytes(trace: Trace, spec: DeviceSpec) -> int:
    """Bytes the libraries ``trace``'s ops call keep from their first run on, as the spec's op
    timings measured them (Note [Buffers a library keeps] in `lms.orchestration.timing`): a
    plan leaves them in the budget beside the step's peak. 0 where the spec takes no CPU
    scratch (a card's workspace margin stands for them) or its timings are of another step."""
    kept = _measured(trace, spec, "kept") if spec.cpu_scratch else None
    if kept is None:
        return 0
    return sum(nbytes for nbytes in kept if nbytes is not None and nbytes >= _PAGE_BYTES)


_PAGE_BYTES = 4096
"""Less than this left after a call is the heap's own jitter, not a library's buffer."""


_MERGED = -1  # role of the sum's storage
_GONE = -2  # role of a sum the engine made on the way, which a relieved junction never makes


def _junction_roles(relieved: dict[int, JunctionRecord]) -> dict[int, list[tuple[int, int]]]:
    """For each storage of a relieved junction, its roles: ``(ordinal, k)`` for the k-th partial,
    ``(ordinal, _MERGED)`` for the sum, ``(ordinal, _GONE)`` for a sum on the way."""
    roles: dict[int, list[tuple[int, int]]] = {}
    for ordinal, junction in relieved.items():
        for k, grad in enumerate(junction.grads):
            roles.setdefault(grad, []).append((ordinal, k))
        for made in junction.accumulated:
            if made not in junction.grads and made != junction.merged:
                roles.setdefault(made, []).append((ordinal, _GONE))
        roles.setdefault(junction.merged, []).append((ordinal, _MERGED))
    return roles


_LAST_READS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Per trace, `_last_read` of each partial it was asked for: a scan of the ops between the
partial and its sum, which every simulation of a plan that relieves the junction asks for again
(a recurrent scan's gradients are summed over thousands of ops)."""


def _last_read(
    trace: Trace, known: dict[tuple[int, int, int], int], junction: JunctionRecord, k: int
) -> int:
    """The last op before the sum that reads the k-th partial, other than the engine's sums (the
    op that made it if none); ``known``: those found in ``trace`` before (`_LAST_READS`)."""
    key = (junction.join_op, junction.arrive_ops[k], junction.grads[k])
    last = known.get(key)
    if last is None:
        first = junction.arrive_ops[k]
        last = first - 1
        summing = set(junction.arrive_ops[1:])
        grad = junction.grads[k]
        for index in range(first, junction.join_op):
            if index not in summing and grad in trace.ops[index].inputs:
                last = index
        known[key] = last
    return last


_PAGE = 4096


# Note: [A mapped storage's own page]
# glibc maps an allocation of `FRESH_PAGES_BYTES` or more on pages of its own (Note [Fresh pages]),
# and its header takes a page more. The "cpu" spec counts each storage of that size at its pages,
# where blocks are otherwise rounded to 512 bytes. Measured: benchmarks/results/README.md, "A mapped
# storage's own page".


# Note: [The autograd graph on a CPU's heap]
# On a CPU the budget counts the C heap in use (Note [The C heap in use, not the resident set,
# measures a CPU step]), and the heap holds more than tensors: autograd's nodes, their saved
# variables' books and the engine's state, from the op that records each node until backward frees
# it. That share grows with the number of ops, not with the tensors' sizes. The "cpu" spec counts it
# per forward op (`DeviceSpec.graph_bytes_per_op`) from the op's start to backward's end, in the
# device bytes a plan must fit, not in the tensors' peak (`SimResult.peak_tensor_bytes`). On a GPU
# the graph is in host memory, outside the card's budget. Measured per model:
# benchmarks/results/README.md, "The autograd graph on a CPU's heap".
def _sweep(
    intervals: tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray] | None,
    host_spans: Sequence[tuple[float, float, int]],
    spec: DeviceSpec,
    graph: tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray] | None = None,
) -> tuple[list[float], list[int], list[int], int]:
    """Piecewise-constant device and host bytes; frees before allocations at equal times.

    ``intervals`` are the bytes, start and end of each (`_Residency.columns`); ``graph``, likewise,
    bytes the device counts that are not tensors (`_Residency.graph_columns`). Returns the times
    at which they change, the device bytes (tensors' rounded by the allocator's block) and host
    bytes from each on, and the peak of tensor bytes unrounded. The order of the intervals
    changes nothing.
    """
    # numpy, not torch: a planner sweeps thousands of times, and these arrays are small enough
    # that each call's overhead outweighs its work.
    raw, starts, ends = intervals if intervals is not None else (numpy.zeros(0, numpy.int64),) * 3
    if not len(raw) and not host_spans:
        return [], [], [], 0
    block = spec.alloc_round_bytes
    rounded = -(-raw // block) * block
    if spec.page_mapped_bytes is not None:  # Note [A mapped storage's own page]
        rounded = numpy.where(raw >= spec.page_mapped_bytes, (raw // _PAGE + 1) * _PAGE, rounded)
    if graph is not None:  # Note [The autograd graph on a CPU's heap]
        rounded = numpy.concatenate([rounded, graph[0]])
        raw = numpy.concatenate([raw, numpy.zeros_like(graph[0])])
        starts, ends = numpy.concatenate([starts, graph[1]]), numpy.concatenate([ends, graph[2]])
    kept = numpy.fromiter((span[2] for span in host_spans), numpy.int64, len(host_spans))
    none, no_spans = numpy.zeros_like(raw), numpy.zeros_like(kept)
    times = numpy.concatenate(
        [
            starts,
            ends,
            numpy.fromiter((span[0] for span in host_spans), numpy.float64, len(host_spans)),
            numpy.fromiter((span[1] for span in host_spans), numpy.float64, len(host_spans)),
        ]
    )
    device = numpy.concatenate([rounded, -rounded, no_spans, no_spans])
    unrounded = numpy.concatenate([raw, -raw, no_spans, no_spans])
    host = numpy.concatenate([none, none, kept, -kept])
    allocations = numpy.concatenate(  # frees first at equal times
        [numpy.ones(len(raw), numpy.int8), numpy.zeros(len(raw), numpy.int8)]
        + [numpy.ones(len(kept), numpy.int8), numpy.zeros(len(kept), numpy.int8)]
    )
    by_time = numpy.argsort(allocations, kind="stable")
    by_time = by_time[numpy.argsort(times[by_time], kind="stable")]
    times = times[by_time]
    last = numpy.append(times[1:] != times[:-1], True)  # after each time's changes
    # Within one time, frees and then allocations: the running peak of the unrounded bytes
    # is where the allocations have all been made, whatever their order.
    peak = int(numpy.cumsum(unrounded[by_time]).max())
    return (
        times[last].tolist(),
        numpy.cumsum(device[by_time])[last].tolist(),
        numpy.cumsum(host[by_time])[last].tolist(),
        max(peak, 0),
    )
