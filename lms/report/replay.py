"""`lms replay`: a recorded step (`lms.core.steprecord`) simulated again, set against itself.

Note: [A replay prices each op at its recorded time]
A replay asks one question: given what each op really took, do the simulator's copies, waits,
recomputations and memory match what the runtime did? So it prices each of the trace's ops at
the time the record gives it (matched by name, in order, to the ops the step ran) and keeps the
device spec's link and disk rates. An op's time runs from the end of the op before it to its own
end, less the waits and recomputations between them, which the simulator adds itself: so the
framework's time between ops counts, as it does in the step. The spec's per-op overhead is
taken off (the simulator adds it back), and copies no longer take compute's cores, since the
recorded times already ran beside them. What the tuner itself believed (its op times or its
rates) is the plan's own prediction, printed beside it: the gap between the two is the kernels',
the gap between the replay and the step is the offload model's.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from lms.analysis.clock import Clock
from lms.analysis.recorder import SKIPPED_OPS
from lms.analysis.simulate import op_seconds, simulate
from lms.core import costs
from lms.core.devices import DeviceSpec, OpTimings
from lms.core.steprecord import OpTime, StepRecord, StepTimes
from lms.core.units import format_bytes
from lms.report.timeparts import (
    BETWEEN_OPS,
    OpKind,
    TimePart,
    merged_spans,
    op_kinds,
    time_parts,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["OpGap", "Release", "Replay", "replay", "format_replay", "plot_replay"]

SLOW_SHARE = 0.10
"""How far apart an op's priced and measured times must be to be listed (`Replay.off_ops`)."""


@dataclasses.dataclass(frozen=True)
class OpGap:
    """One op whose time the plan priced far from what the step measured."""

    index: int
    name: str
    module: str
    planned_s: float
    measured_s: float


@dataclasses.dataclass(frozen=True)
class Release:
    """An op during which the CUDA caching allocator gave back memory it had cached.

    Note: [The allocator gives memory back]
    Under a cap (a budget, `torch.cuda.set_per_process_memory_fraction`) the caching allocator
    that cannot fit a request in the blocks it has cached, nor reserve more, frees every cached
    block it can and tries again: the card synchronizes, and the memory is unmapped and mapped
    anew, which takes milliseconds a gigabyte. The op that asked runs that long on the step's
    clock. The simulator counts tensors, not the allocator's blocks, so a replay names these ops
    apart from the ops priced far off."""

    position: int
    """The op's place among the step's ops (`lms.core.steprecord.StepTimes.ops`)."""
    name: str
    released_bytes: int
    took_s: float


@dataclasses.dataclass(frozen=True)
class Replay:
    """Prediction against measurement for one recorded step."""

    step: int
    clock: str
    measured_step_s: float
    predicted_step_s: float
    """The replay: the plan simulated at the step's own op times (Note [A replay prices each op
    at its recorded time])."""
    planned_step_s: float
    """What the tuner predicted: the plan at the spec's op times or rates."""
    base_step_s: float
    """The no-offload step the plan was priced against (the spec's op times or rates)."""
    floor_s: float
    """The larger of the plan's bytes over the link's rate (each direction on its own) and the
    step's kernels at the spec's op times: no plan with these moves runs faster."""
    measured_forward_s: float
    predicted_forward_s: float
    measured_backward_s: float
    predicted_backward_s: float
    measured_copy_s: float
    predicted_copy_s: float
    measured_overlap: float
    """Share of the copies' time that ran while an op ran."""
    predicted_overlap: float
    measured_wait_s: float
    predicted_wait_s: float
    measured_idle_s: float
    """Time in the step when none of the model's ops nor a recomputation ran and the step waited
    for no copy (the runtime's own ops left out: on a card they run on copy streams): on a card,
    the compute stream stood idle because the host queued ops slower than the card ran them (the
    framework's, the hooks' and a recorder's own time per op); on a CPU, that host time itself."""
    measured_peak_bytes: int
    """What the step started with (the trace's weights, buffers and batch) plus the most it
    added: on a card, to its allocation; on a CPU, to the C heap in use."""
    predicted_peak_bytes: int
    matched_ops: int
    """Ops of the trace matched, by name and order, to ops the step ran."""
    trace_ops: int
    off_ops: tuple[OpGap, ...]
    """The first ops (in order) whose priced time is more than `SLOW_SHARE` off the measured one,
    among those that take at least a thousandth of the step."""
    releases: tuple[Release, ...] = ()
    """The ops during which the allocator gave back cached memory (Note [The allocator gives
    memory back]); none on a CPU."""
    parts: tuple[TimePart, ...] = ()
    """The step's time in parts beside the plan's own prices for them (Note [A step's time in
    parts])."""
    op_kinds: tuple[OpKind, ...] = ()
    """The kinds of op whose kernels took furthest from their prices, largest gap first."""
    measured_recorder_s: float = 0.0
    """The recorder's own host time in the step (`lms.core.steprecord.StepTimes.recorder_s`),
    part of ``measured_idle_s`` where the host set the pace."""
    measured_recorder_reads_s: float = 0.0
    """Of that, its reads of the memory in use."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return dataclasses.asdict(self)


def replay(record: StepRecord, *, step: int | None = None) -> Replay:
    """Simulate ``record``'s plan again at its step's own op times, beside what it measured.

    Args:
        step: the recorded step's number (default: the last recorded, past any first step).

    Raises:
        ValueError: ``step`` was not recorded.
    """
    steps = {s.number: s for s in record.steps}
    if step is None:
        step = record.steps[-1].number
    if step not in steps:
        raise ValueError(f"lms: step {step} was not recorded; the record has steps {sorted(steps)}")
    times = steps[step]
    trace, plan, spec, half = record.trace, record.plan, record.spec, record.half
    pairs = _matched(record, times)
    measured, matched = _op_times(times, pairs, len(trace.ops)), len(pairs)
    replayed, clock = _replayed(record, measured)
    predicted = simulate(trace, plan, replayed, half=half)
    planned = simulate(trace, plan, spec, half=half)
    step_ops = [op for op in times.ops if op.section != "runtime"]
    first_back = next((op.start_s for op in step_ops if op.backward), times.step_s)
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    cuda = times.clock == "cuda-events"
    predicted_peak = (
        predicted.peak_bytes - spec.workspace_bytes if cuda else (predicted.peak_tensor_bytes)
    )
    compute = [(op.start_s, op.end_s) for op in step_ops]
    copies = [(c.start_s, c.end_s) for c in times.copies]
    sim_copies = _simulated_copies(clock)
    sim_compute = [(clock.start[i], clock.done_at[i]) for i in range(len(trace.ops))]
    write_log, overhead = _write_log(record)
    parts = time_parts(times, planned, ops=len(trace.ops), overhead_s=overhead)
    return Replay(
        step=step,
        clock=times.clock,
        measured_step_s=times.step_s,
        predicted_step_s=predicted.step_s,
        planned_step_s=planned.step_s,
        base_step_s=planned.base_step_s,
        floor_s=costs.floor_s(spec, planned.offloaded_bytes, planned.base_step_s),
        measured_forward_s=first_back,
        predicted_forward_s=predicted.backward_start_s,
        measured_backward_s=times.step_s - first_back,
        predicted_backward_s=predicted.step_s - predicted.backward_start_s,
        measured_copy_s=_total(copies),
        predicted_copy_s=_total(sim_copies),
        measured_overlap=_overlap(copies, compute),
        predicted_overlap=_overlap(sim_copies, sim_compute),
        measured_wait_s=sum(w.end_s - w.start_s for w in times.waits),
        predicted_wait_s=predicted.wait_s,
        measured_idle_s=parts[BETWEEN_OPS].measured_s or 0.0,
        measured_peak_bytes=before + times.growth_bytes,
        predicted_peak_bytes=predicted_peak,
        matched_ops=matched,
        trace_ops=len(trace.ops),
        off_ops=_off_ops(record, measured, op_seconds(trace, spec, half), times.step_s),
        releases=_releases(times) if cuda else (),
        parts=parts,
        op_kinds=op_kinds(
            trace, pairs, op_seconds(trace, spec, half, write_log=write_log), overhead_s=overhead
        ),
        measured_recorder_s=times.recorder_s,
        measured_recorder_reads_s=times.recorder_reads_s,
    )


def _releases(times: StepTimes) -> tuple[Release, ...]:
    """The ops after which the allocator had reserved less than before them."""
    found = []
    before = times.ops[0].reserved_bytes if times.ops else 0
    for position, op in enumerate(times.ops):
        if op.reserved_bytes < before:
            found.append(
                Release(position, op.name, before - op.reserved_bytes, op.end_s - op.start_s)
            )
        before = op.reserved_bytes
    return tuple(found)


def _replayed(record: StepRecord, measured: list[float | None]) -> tuple[DeviceSpec, Clock]:
    """The spec the replay prices at (the recorded op times, copies beside compute: Note [A
    replay prices each op at its recorded time]) and the clock it runs the plan on."""
    trace, plan, spec, half = record.trace, record.plan, record.spec, record.half
    write_log, overhead = _write_log(record)
    tuned = spec.op_timings  # its scratch and kept buffers measured where the tune timed its ops
    timings = OpTimings(
        trace.fingerprint(),
        tuple(None if s is None else max(s - overhead, 0.0) for s in measured),
        scratch=tuned.scratch if tuned is not None else (),
        kept=tuned.kept if tuned is not None else (),
    )
    replayed = dataclasses.replace(spec, copies_take_compute=False).with_op_timings(timings)
    clock = Clock(trace, plan, replayed, op_seconds(trace, replayed, half, write_log=write_log))
    return replayed, clock


def _write_log(record: StepRecord) -> tuple[bool, float]:
    """Whether the record's plan ran under the write log (it replays), and the host's time the
    spec prices each op at beside its kernel, the write log's included."""
    write_log = record.plan is not None and bool(record.plan.recompute)
    spec = record.spec
    return write_log, spec.op_overhead_s + (spec.write_log_op_s if write_log else 0.0)


def _matched(record: StepRecord, times: StepTimes) -> list[tuple[int, OpTime]]:
    """The trace's ops matched by name, in order (the longest common runs first), to the
    model's ops the step ran: each trace op's index and its recorded op. Autograd runs some of
    the model's views inside the runtime's hooks; those stay unmatched."""
    ran = [op for op in times.ops if op.section == "step" and op.name not in SKIPPED_OPS]
    names = [op.name for op in record.trace.ops]
    matcher = difflib.SequenceMatcher(None, names, [op.name for op in ran], autojunk=False)
    return [
        (block.a + k, ran[block.b + k])
        for block in matcher.get_matching_blocks()
        for k in range(block.size)
    ]


def _op_times(
    times: StepTimes, pairs: Sequence[tuple[int, OpTime]], ops: int
) -> list[float | None]:
    """Each of the trace's ``ops``' recorded time (Note [A replay prices each op at its
    recorded time]), from the ``pairs`` `_matched` found; None where no op of the step matched
    it, which the rates price, its time counting towards the next matched op."""
    waits = sorted(_waits(times))
    replays = [(op.start_s, op.end_s) for op in times.ops if op.section == "replay"]
    measured: list[float | None] = [None] * ops
    previous = 0.0
    for index, op in pairs:
        between = _within(waits, previous, op.start_s) + _within(replays, previous, op.start_s)
        measured[index] = max(op.end_s - previous - between, op.end_s - op.start_s)
        previous = op.end_s
    return measured


def _within(spans: Sequence[tuple[float, float]], begin: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, begin)) for a, b in spans)


def _total(spans: Iterable[tuple[float, float]]) -> float:
    return sum(max(0.0, b - a) for a, b in spans)


def _overlap(
    copies: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]]
) -> float:
    """Share of the copies' time during which some op ran."""
    total = _total(copies)
    if total <= 0:
        return 0.0
    spans = merged_spans(compute)
    return sum(_within(spans, a, b) for a, b in copies) / total


def _waits(times: StepTimes) -> list[tuple[float, float]]:
    return [(w.start_s, w.end_s) for w in times.waits]


def _simulated_copies(clock: Clock) -> list[tuple[float, float]]:
    """The simulated copies' spans (`Clock.copy_spans`)."""
    return [(start, end) for _, _, start, end in clock.copy_spans()]


def _off_ops(
    record: StepRecord, measured: list[float | None], planned_seconds: list[float], step_s: float
) -> tuple[OpGap, ...]:
    found = []
    floor = step_s / 1000
    for index, (got, priced) in enumerate(zip(measured, planned_seconds, strict=True)):
        if got is None or max(got, priced) < floor:
            continue
        if abs(priced - got) > SLOW_SHARE * got:
            op = record.trace.ops[index]
            found.append(OpGap(index, op.name, op.module, priced, got))
            if len(found) == 10:
                break
    return tuple(found)


def format_replay(result: Replay) -> str:
    """The replay as a side-by-side table, and the ops priced far off."""

    def row(name: str, measured: float, predicted: float, unit: str = "s") -> str:
        off = (predicted / measured - 1) * 100 if measured else 0.0
        if unit == "bytes":
            return (
                f"  {name:<22} {format_bytes(int(measured)):>12} "
                f"{format_bytes(int(predicted)):>12} {off:+7.1f}%"
            )
        return f"  {name:<22} {measured:>12.4f} {predicted:>12.4f} {off:+7.1f}%"

    lines = [
        f"[LMS] Step {result.step} ({result.clock}): {result.matched_ops} of {result.trace_ops} "
        "traced ops matched to the step's",
        f"  {'':<22} {'measured':>12} {'replayed':>12} {'off':>8}",
        row("step (s)", result.measured_step_s, result.predicted_step_s),
        row("forward (s)", result.measured_forward_s, result.predicted_forward_s),
        row("backward (s)", result.measured_backward_s, result.predicted_backward_s),
        row("copies (s)", result.measured_copy_s, result.predicted_copy_s),
        row("waits (s)", result.measured_wait_s, result.predicted_wait_s),
        row("peak", result.measured_peak_bytes, result.predicted_peak_bytes, "bytes"),
        f"  copies overlapping ops: {100 * result.measured_overlap:.0f}% measured, "
        f"{100 * result.predicted_overlap:.0f}% replayed",
        f"  between ops: {result.measured_idle_s:.4f} s "
        f"({100 * result.measured_idle_s / result.measured_step_s:.0f}% of the step), "
        + (
            "the card idle while the host queued the next op"
            if result.clock == "cuda-events"
            else "the host's own time between ops"
        )
        if result.measured_step_s > 0
        else "",
        f"  the recorder's own host time: {result.measured_recorder_s:.4f} s "
        f"({result.measured_recorder_s / result.matched_ops * 1e6:.1f} us a matched op, "
        f"{result.measured_recorder_reads_s:.4f} s of it reading memory in use), "
        + (
            "the host's; the card idles for it where the host sets the pace"
            if result.clock == "cuda-events"
            else "in the step's time between ops"
        )
        if result.measured_recorder_s > 0 and result.matched_ops
        else "",
        f"[LMS] The plan predicted {result.planned_step_s:.4f} s against a no-offload step of "
        f"{result.base_step_s:.4f} s; floor {result.floor_s:.4f} s (the larger of the link's time "
        "for the bytes it moves and the kernels'); measured "
        f"{result.measured_step_s / result.floor_s:.2f}x the floor"
        if result.floor_s > 0
        else "",
    ]
    lines += _format_parts(result)
    if result.releases:
        lines.append(
            f"[LMS] The allocator gave back cached memory {len(result.releases)} times "
            f"({format_bytes(sum(r.released_bytes for r in result.releases))}), in ops that took "
            f"{sum(r.took_s for r in result.releases):.4f} s, unmapping and mapping it again:"
        )
        for release in result.releases[:10]:
            lines.append(
                f"  op {release.position:>5} of the step {release.name:<40} gave back "
                f"{format_bytes(release.released_bytes):>10}, took {release.took_s * 1e3:9.3f} ms"
            )
    if result.off_ops:
        lines.append(f"[LMS] First ops priced more than {SLOW_SHARE:.0%} off what they took:")
        for gap in result.off_ops:
            lines.append(
                f"  op {gap.index:>5} {gap.name:<40} {gap.module:<28} priced "
                f"{gap.planned_s * 1e3:9.3f} ms, took {gap.measured_s * 1e3:9.3f} ms"
            )
    return "\n".join(line for line in lines if line)


def _format_parts(result: Replay) -> list[str]:
    """The step's time in parts beside the plan's own prices, then the kinds of op furthest
    from theirs (Note [A step's time in parts])."""
    if not result.parts:
        return []
    lines = [
        "[LMS] Where the step's time went, beside the plan's own prices:",
        f"  {'':<22} {'measured':>12} {'planned':>12} {'off (s)':>9}",
    ]
    for part in result.parts:
        measured = "-" if part.measured_s is None else f"{part.measured_s:.4f}"
        off = "" if part.measured_s is None else f"{part.measured_s - part.planned_s:+9.4f}"
        name = f"{part.part} (s)"
        lines.append(f"  {name:<22} {measured:>12} {part.planned_s:>12.4f} {off:>9}".rstrip())
    lines.append(
        f"  {'step (s)':<22} {result.measured_step_s:>12.4f} {result.planned_step_s:>12.4f} "
        f"{result.measured_step_s - result.planned_step_s:+9.4f}"
    )
    if result.clock == "wall":
        lines.append(
            "  on a CPU, between ops holds the frees of storages with pages of their own, which "
            "the plan prices in the ops that made them"
        )
    if result.op_kinds:
        lines.append("[LMS] Kinds of op whose kernels took furthest from their prices:")
        for kind in result.op_kinds:
            phase = "backward" if kind.backward else "forward"
            lines.append(
                f"  {kind.name:<48} {phase:<8} {kind.ops:>5} ops: took {kind.measured_s:.4f} s, "
                f"priced {kind.planned_s:.4f} s ({kind.measured_s - kind.planned_s:+.4f} s)"
            )
    return lines


def plot_replay(path: str | os.PathLike[str], record: StepRecord, result: Replay) -> Figure:
    """Write a PNG of the step's timeline as measured (top) and as replayed (bottom): ops,
    copies out and in, waits; the figure too (no pyplot state, no backend set)."""
    from matplotlib.figure import Figure

    times = next(s for s in record.steps if s.number == result.step)
    _, clock = _replayed(record, _op_times(times, _matched(record, times), len(record.trace.ops)))
    spans = clock.copy_spans()
    figure = Figure(figsize=(11, 4.5))
    top, bottom = figure.subplots(2, 1, sharex=True)
    lanes = {"ops": 3, "out": 2, "in": 1, "waits": 0}

    def draw(axes: Any, spans: dict[str, list[tuple[float, float]]], title: str) -> None:
        colors = {"ops": "tab:blue", "out": "tab:orange", "in": "tab:green", "waits": "tab:red"}
        for lane, rows in spans.items():
            axes.broken_barh(
                [(a * 1e3, max(b - a, 0.0) * 1e3) for a, b in rows],
                (lanes[lane] - 0.4, 0.8),
                color=colors[lane],
            )
        axes.set_yticks(list(lanes.values()), list(lanes))
        axes.set_title(title, fontsize=10)

    draw(
        top,
        {
            "ops": [(op.start_s, op.end_s) for op in times.ops if op.section != "runtime"],
            "out": [(c.start_s, c.end_s) for c in times.copies if c.direction == "out"],
            "in": [(c.start_s, c.end_s) for c in times.copies if c.direction == "in"],
            "waits": [(w.start_s, w.end_s) for w in times.waits],
        },
        f"measured: {result.measured_step_s:.4f} s",
    )
    draw(
        bottom,
        {
            "ops": [(clock.start[i], clock.done_at[i]) for i in range(len(record.trace.ops))],
            "out": [(a, b) for way, _, a, b in spans if way == "out"],
            "in": [(a, b) for way, _, a, b in spans if way == "in"],
            "waits": [],
        },
        f"replayed: {result.predicted_step_s:.4f} s",
    )
    bottom.set_xlabel("ms from the step's start")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return figure
