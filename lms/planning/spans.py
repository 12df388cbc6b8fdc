"""Where plans hold what they move, read from a trace: the ops over which an offloaded copy is
held, which copies go to disk, how far each save is from its use, and what the step's code holds
that a plan may empty."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from lms.core.devices import DeviceSpec
from lms.core.recipes import recipes
from lms.core.records import Trace

__all__ = [
    "emptiable",
    "entry_distances",
    "held_gaps",
    "host_spans",
    "place_spill",
    "replay_inputs",
]


def host_spans(trace: Trace, spec: DeviceSpec) -> list[tuple[int, int, int]]:
    """For each entry, the ops over which an offloaded copy of it is held: from its save to the
    op after which its storage is freed (the end of the step if never), and the host memory
    the copy takes on ``spec`` (`DeviceSpec.host_copy_bytes`)."""
    free_op = {record.id: record.free_op for record in trace.storages}
    end = len(trace.ops)
    spans = []
    for storage, nbytes, save_op in trace.entries():
        last = free_op.get(storage)
        held = spec.host_copy_bytes(nbytes)
        spans.append((save_op, end if last is None else min(last, end), held))
    return spans


def place_spill(
    spans: list[tuple[int, int, int]], offload: Iterable[int], limit_bytes: int, num_ops: int
) -> tuple[int, ...]:
    """Offloaded entries to send to disk so that the copies held in host memory never exceed
    ``limit_bytes``.

    Note: [Spill what backward needs last]
    Wherever host memory would overflow, the entry held there that was saved first goes to disk:
    backward reads it last, so its slower read has the most time to hide behind compute, and
    the entries saved last (read first, with the least time to come back) stay in host memory.
    """
    held = [0] * (num_ops + 1)
    chosen = sorted(set(offload))
    for ordinal in chosen:
        begin, end, nbytes = spans[ordinal]
        for op in range(begin, end + 1):
            held[op] += nbytes
    spilled: list[int] = []
    remaining = list(chosen)  # in save order: the first saved first
    while remaining:
        peak = max(range(len(held)), key=held.__getitem__)
        if held[peak] <= limit_bytes:
            break
        victim = next(i for i in remaining if spans[i][0] <= peak <= spans[i][1])
        remaining.remove(victim)
        spilled.append(victim)
        begin, end, nbytes = spans[victim]
        for op in range(begin, end + 1):
            held[op] -= nbytes
    return tuple(sorted(spilled))


def entry_distances(trace: Trace) -> list[float]:
    """For each entry, levels from its first save to its first use (infinite if never used)."""
    save_level: dict[int, int] = {}
    use_level: dict[int, int] = {}
    for event in trace.events:
        if not event.offloadable:
            continue
        if event.kind == "save":
            save_level.setdefault(event.storage, event.level)
        else:
            use_level.setdefault(event.storage, event.level)
    return [
        use_level[s] - save_level[s] if s in use_level else float("inf")
        for s, _, _ in trace.entries()
    ]


def emptiable(trace: Trace) -> dict[int, int]:
    """The entries that the step's code holds past forward's last read of them (an input, a
    block's input in a local, an output kept into backward), and for each the first saved-tensor
    event after that read: from there a plan may empty it (Note [Emptying what the code holds]).
    Not those a kept save holds: autograd reads them in place."""
    storages, event_ops = trace.storages, trace.event_ops
    saved = _forward_saves(trace)
    found = {}
    for ordinal, (storage, _, _) in enumerate(trace.entries()):
        record = storages[storage]
        if record.alloc_op >= trace.backward_start_op:
            continue  # made after forward: Note [What backward makes and saves]
        code_holds = (
            record.alloc_op < 0
            or storage in trace.held_by_code
            or record.last_forward_op > record.last_read_op
        )
        if not code_holds or storage in trace.held:
            continue
        after = bisect.bisect_right(event_ops, record.last_read_op)
        after = max(after, saved.get(storage, [-1])[-1] + 1)  # and past its last save
        if after < len(event_ops):
            found[ordinal] = trace.events[after].level
    return found


# Note: [A save in forward reads what it saves]
# A save is a read: the runtime holds what it saves as it is then, so a storage empty at its save
# stays empty for backward. Forward may save a storage again after its last read by an op, or
# between two reads: a custom autograd function saves its inputs as it returns, after the ops
# that read them (a norm over slabs saves each piece it normalized, as the op that reshapes its
# output ends). Neither emptying nor a gap may take in such a save.
def _forward_saves(trace: Trace) -> dict[int, list[int]]:
    """The saved-tensor events (their indices) at which forward saves each storage, in order
    (Note [A save in forward reads what it saves]); derived once per trace (Note [A trace
    derives once]), do not mutate it."""
    found: dict[int, list[int]] | None = trace.memo.get("forward_saves")
    if found is None:
        found = trace.memo["forward_saves"] = {}
        for index, event in enumerate(trace.events):
            if event.kind == "save" and event.op < trace.backward_start_op:
                found.setdefault(event.storage, []).append(index)
    return found


# Note: [Gaps in what the code holds]
# A U-Net's code holds each encoder output from its encoder block until its decoder block reads it
# again, a residual block its input from the block's first op to its add: the tensor is read,
# then nothing reads it over a long stretch of forward, then it is read again. Its copy out frees
# nothing while the code holds it, and `emptiable` empties it only after forward's last read, so
# it takes device memory over every stretch. A gap is one such stretch: from the first
# saved-tensor event after a forward read (``empty_at``) to the last event before the next one
# (``fill_at``), with an op between. At ``empty_at`` the runtime waits for the storage's copy out
# (made when autograd first saved it) and empties it, so that what the plan counts on is free
# whatever the link's or the disk's pace, and at ``fill_at`` it fills it again in place from that
# copy, waiting for the read; events of one op's inputs come before its kernel runs, so the
# storage is full again before the op that reads it. The copy stays for backward. The simulator
# counts the storage out of device memory between the two, and the step's wait for each read
# (`lms.analysis.clock.Clock`). Only plans made with ``free_held`` have gaps, where none fits
# without them: as there, the trace must
# have seen every read, and a step that departs from it may read a storage that is empty.
def held_gaps(trace: Trace) -> dict[int, tuple[tuple[int, int], ...]]:
    """For each entry, the gaps between forward's reads of it after its save, as ``(empty_at,
    fill_at)`` saved-tensor events, in order (Note [Gaps in what the code holds]); entries
    without a gap, and those a kept save holds (autograd reads them in place), are left out."""
    event_ops, events, entries = trace.event_ops, trace.events, trace.entries()
    held = {
        storage: ordinal
        for ordinal, (storage, _, _) in enumerate(entries)
        if storage not in trace.held
    }
    reads: dict[int, list[int]] = {}
    for op in trace.ops:
        if op.phase == "forward":
            for storage in held.keys() & set(op.inputs):
                reads.setdefault(storage, []).append(op.index)
    saved = _forward_saves(trace)
    found = {}
    for storage, ops in reads.items():
        ordinal = held[storage]
        gaps = []
        # from the save on: the copy out that a gap's emptying waits for starts there
        for read, next_read in itertools.pairwise(op for op in ops if op >= entries[ordinal][2]):
            empty = bisect.bisect_right(event_ops, read)
            fill = bisect.bisect_right(event_ops, next_read) - 1
            # filled again for each save between (Note [A save in forward reads what it saves])
            for save in saved.get(storage, ()):
                if empty <= save < fill:
                    if event_ops[empty] < event_ops[save]:
                        gaps.append((events[empty].level, events[save].level))
                    empty = save + 1
            if empty < fill and event_ops[empty] < event_ops[fill]:  # an op runs between
                gaps.append((events[empty].level, events[fill].level))
        if gaps:
            found[ordinal] = tuple(gaps)
    return found


def replay_inputs(trace: Trace, remade: set[int]) -> set[int]:
    """The entries that replays of ``remade`` read: those stay filled for the replay."""
    if not remade:
        return set()
    found = recipes(trace)
    return {i for ordinal in remade if ordinal in found for i in found[ordinal].inputs}
