"""Where a recorded step's time went, part by part, beside what its plan priced for each part.

Note: [A step's time in parts]
A step that follows its plan runs on one compute clock: the traced ops one after another, the
recomputations the plan asks for, the waits for copies, and between them whatever the host did
(the framework, the runtime's hooks, a recorder's marks); on a card, that last part is the card
standing idle while the host queues the next op. The simulator prices the same parts: each op
at its timed kernel plus the spec's per-op overhead, the replays, the waits and, on a CPU, the
compute that copies take from its cores (`lms.analysis.clock.Clock`), and its parts add up to
its step exactly. So a record's step, cut the same way, says which part the plan got wrong:
kernels slower than timed alone, replays, waits, or the host's time between ops, which no
kernel timing sees. The measured parts come from the compute clock alone: the runtime's own
ops on a card run on copy streams beside it, and on a CPU they are the host's time between the
model's ops. On a CPU the time between ops also holds the frees of storages that have pages of
their own (`DeviceSpec.page_mapped_bytes`), which glibc unmaps when the step lets go of them;
an op timed alone frees its output inside its timed call, so there the plan prices that free in
the op's kernel (benchmarks/results/README.md, "Frees between ops on a CPU"). By kind, the
model's ops matched to the trace set each kernel's time beside its price, largest gaps first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from lms.analysis.simulate import SimResult
from lms.core.records import Trace
from lms.core.steprecord import OpTime, StepTimes

__all__ = [
    "BETWEEN_OPS",
    "KINDS_SHOWN",
    "OpKind",
    "TimePart",
    "merged_spans",
    "op_kinds",
    "time_parts",
]

KINDS_SHOWN = 6
"""How many kinds of op `op_kinds` returns, largest gaps first."""
BETWEEN_OPS = 3
"""The place of the host's time between ops among `time_parts`'s parts."""


@dataclasses.dataclass(frozen=True)
class TimePart:
    """One part of a step's time (Note [A step's time in parts])."""

    part: str
    """``kernels``, ``replays``, ``waits``, ``between ops``, or ``copies' compute`` (priced
    on a CPU alone: the recorded ops already ran beside the copies)."""
    measured_s: float | None
    """What the recorded step spent on it; None where the record cannot part it out."""
    planned_s: float
    """What the plan's own simulation priced it at."""


@dataclasses.dataclass(frozen=True)
class OpKind:
    """The model's ops of one name in forward or backward, matched to the trace: their kernels'
    time in the step beside their price."""

    name: str
    backward: bool
    ops: int
    measured_s: float
    planned_s: float


def merged_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` with those that overlap joined, in order."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _span(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by ``spans``, overlaps counted once."""
    return sum(b - a for a, b in merged_spans(spans))


def time_parts(
    times: StepTimes, planned: SimResult, *, ops: int, overhead_s: float
) -> tuple[TimePart, ...]:
    """The parts of the recorded step ``times`` beside those of ``planned``, the plan simulated
    at the prices it was tuned on (Note [A step's time in parts]).

    Args:
        ops: how many ops the trace has, each priced with ``overhead_s`` of the host's time.
        overhead_s: the spec's per-op overhead (with the write log's, where the plan replays).
    """
    model = [(op.start_s, op.end_s) for op in times.ops if op.section == "step"]
    replays = [(op.start_s, op.end_s) for op in times.ops if op.section == "replay"]
    waits = [(wait.start_s, wait.end_s) for wait in times.waits]
    busy = _span(model + replays + waits)
    between = ops * overhead_s
    priced_ops = planned.step_s - planned.recompute_s - planned.wait_s - planned.copy_compute_s
    parts = [
        TimePart("kernels", _span(model), priced_ops - between),
        TimePart("replays", _span(replays), planned.recompute_s),
        TimePart("waits", _span(waits), planned.wait_s),
        TimePart("between ops", max(times.step_s - busy, 0.0), between),
    ]
    if planned.copy_compute_s:
        parts.append(TimePart("copies' compute", None, planned.copy_compute_s))
    return tuple(parts)


def op_kinds(
    trace: Trace,
    pairs: Sequence[tuple[int, OpTime]],
    priced_s: Sequence[float],
    *,
    overhead_s: float,
) -> tuple[OpKind, ...]:
    """The kinds of the model's ops whose kernels took furthest from their prices, at most
    `KINDS_SHOWN`, largest gap first.

    Args:
        pairs: the trace's op index and the recorded op it was matched to.
        priced_s: each trace op's price, the per-op ``overhead_s`` included (taken off here).
    """
    totals: dict[tuple[str, bool], list[float]] = {}
    for index, op in pairs:
        total = totals.setdefault((trace.ops[index].name, op.backward), [0, 0.0, 0.0])
        total[0] += 1
        total[1] += op.end_s - op.start_s
        total[2] += max(priced_s[index] - overhead_s, 0.0)
    kinds = [
        OpKind(name, backward, int(count), measured, planned)
        for (name, backward), (count, measured, planned) in totals.items()
    ]
    kinds.sort(key=lambda kind: -abs(kind.measured_s - kind.planned_s))
    return tuple(kinds[:KINDS_SHOWN])
