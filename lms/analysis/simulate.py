"""Replay a traced step on a device spec: memory over time, copies on two channels, step time.

Pure: no torch.cuda, nothing allocated. Ops run one after another, each taking the longer of its
FLOPs at the device's peak rate and its bytes at the memory bandwidth. Copies out (device to host,
or to disk) and copies in run on one channel per direction, overlapping compute; an op that needs
a tensor still on its way in waits for it. Device memory counts every storage between the start of
the op that allocates it and the end of the op after which it is freed, rounded up by the
allocator's block size, plus the device's workspace margin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lms.analysis.devices import DeviceSpec
from lms.analysis.recompute import recipes
from lms.analysis.records import JunctionRecord, Trace
from lms.plan import Plan
from lms.runtime import policy

__all__ = ["SimResult", "simulate", "runtime_plan", "Interval", "op_seconds"]


@dataclasses.dataclass(frozen=True)
class Interval:
    """A storage resident on the device from ``start_s`` to ``end_s``."""

    storage: int
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
    """Peak of offloaded bytes held in host memory (or on disk, for the "cpu" spec)."""
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
    intervals: tuple[Interval, ...]
    recomputed_bytes: int = 0
    """Bytes of saved storages that backward recomputes instead of storing."""
    recompute_s: float = 0.0
    """Time spent recomputing them."""
    disk_peak_bytes: int = 0
    """Peak of bytes in spill files: the plan's ``spill`` entries, staged through host memory."""
    relieved_junctions: int = 0
    """Gradient junctions whose partials waited off the device (the plan's ``stash``)."""
    relieved_bytes: int = 0
    """Bytes of those partials."""
    backward_start_s: float = 0.0
    """When the first backward op starts."""

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


def _round(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block if nbytes else 0


def op_seconds(trace: Trace, spec: DeviceSpec, half: bool) -> list[float]:
    """Predicted seconds of each op of ``trace`` on ``spec``."""
    rate = spec.peak_flops_half if half else spec.peak_flops
    bandwidth = spec.memory_bandwidth_gbps * 1e9
    return [
        spec.op_overhead_s + max(op.flops / rate, op.working_set_bytes / bandwidth)
        for op in trace.ops
    ]


def runtime_plan(trace: Trace, budget_bytes: int, *, swapin_ahead: int = 2) -> Plan:
    """The plan `lms.LMS(budget=...)` follows on its own from the second step on.

    It keeps the newest saved tensors and offloads the oldest while the saved bytes would exceed
    the budget less what was allocated before the first save and a reserve for the running op.
    """
    entries = trace.entries()
    nbytes = [size for _, size, _ in entries]
    chosen = policy.budget_offloads(nbytes, _allowance(trace, budget_bytes))
    return Plan(
        fingerprint=trace.fingerprint(),
        offload=tuple(sorted(chosen)),
        num_entries=len(entries),
        swapin_ahead=swapin_ahead,
        budget_bytes=budget_bytes,
    )


def _allowance(trace: Trace, budget_bytes: int) -> int:
    """The runtime's allowance for saved bytes: see `lms.LMS`."""
    first_save = min((e.op for e in trace.events if e.offloadable), default=0)
    baseline = sum(
        s.nbytes
        for s in trace.storages
        if s.alloc_op < first_save and (s.free_op is None or s.free_op >= first_save)
    )
    largest = max((size for _, size, _ in trace.entries()), default=0)
    return budget_bytes - baseline - policy.reserve_bytes(largest)


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
    seconds = op_seconds(trace, spec, half)
    base_step_s = sum(seconds)
    entries = trace.entries()
    offload = set(plan.offload) if plan is not None else set()
    ahead = plan.swapin_ahead if plan is not None else 2
    sync_out = plan is not None and plan.sync_mode in (1, 3)
    # Spilled entries go through host memory to disk and back, as the runtime moves them: a
    # blocking copy to the host, a background write; a background read, a blocking copy in.
    spill = set(plan.spill) if plan is not None else set()
    sync_in = plan is not None and plan.sync_mode in (2, 3)
    storage_of = {i: entries[i][0] for i in offload}
    first_use = trace.first_use_op()
    # Entries read back per use: each later use loads the copy again, on demand.
    use_ops = trace.use_ops()
    later_uses = {
        i: use_ops[storage_of[i]][1:]
        for i in (plan.refetch if plan is not None else ())
        if len(use_ops.get(storage_of[i], ())) > 1
    }
    reloads_at: dict[int, list[int]] = {}
    for ordinal, ops in later_uses.items():
        for op in ops:
            reloads_at.setdefault(op, []).append(ordinal)
    reload_start: dict[int, list[float]] = {i: [] for i in later_uses}
    # Entries recomputed from their recipes just before their first use.
    recompute = set(plan.recompute) if plan is not None else set()
    chosen = recipes(trace) if recompute else {}
    unknown = sorted(recompute - set(chosen))
    if unknown or recompute & offload:
        raise ValueError(
            f"lms: plan recomputes ordinals {unknown or sorted(recompute & offload)} that have no"
            " recipe or are also offloaded"
        )
    recompute_at: dict[int, list[int]] = {}
    for ordinal in recompute:
        recipe = chosen[ordinal]
        if any(i in recompute and i not in recipe.chainable for i in recipe.inputs):
            raise ValueError(
                f"lms: plan recomputes ordinal {ordinal} from a recomputed one that backward "
                "reads before it"
            )
        use_op = first_use.get(entries[ordinal][0])
        if use_op is not None:
            recompute_at.setdefault(use_op, []).append(ordinal)
    recompute_start: dict[int, float] = {}
    recompute_end: dict[int, float] = {}
    recompute_s = 0.0
    # Gradient junctions relieved: each partial but the last goes out when made, and all come
    # back to be summed before the producer's backward.
    relieved = _relieved(trace, plan)
    takes_at: dict[int, list[tuple[int, int]]] = {}
    joins_at: dict[int, list[int]] = {}
    for ordinal, junction in relieved.items():
        for k, arrive_op in enumerate(junction.arrive_ops[: junction.taken]):
            takes_at.setdefault(arrive_op, []).append((ordinal, k))
        joins_at.setdefault(junction.join_op, []).append(ordinal)
    taken: dict[tuple[int, int], tuple[float, float]] = {}  # copy out: start, done
    rejoined: dict[int, tuple[float, float]] = {}  # copies in: start, done

    # Prefetch triggers: the use of the offloaded entry `ahead` places earlier in use order.
    used = sorted((first_use[storage_of[i]], i) for i in offload if storage_of[i] in first_use)
    first_backward_use = min(first_use.values(), default=trace.backward_start_op)
    issue_op: dict[int, int] = {}
    for rank, (use_op, ordinal) in enumerate(used):
        if sync_in:
            issue_op[ordinal] = use_op
        elif rank >= ahead:
            issue_op[ordinal] = used[rank - ahead][0]
        else:
            issue_op[ordinal] = first_backward_use
    saves_at: dict[int, list[int]] = {}
    issues_at: dict[int, list[int]] = {}
    needs_at: dict[int, list[int]] = {}
    for ordinal in offload:
        saves_at.setdefault(entries[ordinal][2], []).append(ordinal)
        if ordinal in issue_op:
            issues_at.setdefault(issue_op[ordinal], []).append(ordinal)
            needs_at.setdefault(first_use[storage_of[ordinal]], []).append(ordinal)

    d2h_bw = spec.d2h_gbps * 1e9
    h2d_bw = spec.h2d_gbps * 1e9
    write_bw = spec.disk_write_gbps * 1e9
    read_bw = spec.disk_read_gbps * 1e9
    written: dict[int, float] = {}
    start = [0.0] * (len(trace.ops) + 1)
    done_at = [0.0] * len(trace.ops)
    out_done: dict[int, float] = {}
    out_start: dict[int, float] = {}
    in_issue: dict[int, float] = {}
    in_done: dict[int, float] = {}
    # The runtime waits for copies out while they would hold the step over its budget.
    allowance = (
        _allowance(trace, plan.budget_bytes)
        if plan is not None and plan.budget_bytes is not None
        else None
    )
    kept_at: dict[int, int] = {}
    for ordinal, (_, size, save_op) in enumerate(entries):
        if ordinal not in offload and ordinal not in recompute:
            kept_at[save_op] = kept_at.get(save_op, 0) + size
    kept = 0
    pending: list[tuple[float, int]] = []
    d2h_free = h2d_free = disk_free = 0.0
    now = wait = 0.0

    def load(ordinal: int) -> None:
        """Start bringing ``ordinal`` back now, after copies in already queued."""
        nonlocal h2d_free, disk_free
        if ordinal in spill:
            begin = max(now, disk_free, written[ordinal])
            disk_free = in_done[ordinal] = begin + entries[ordinal][1] / read_bw
            return
        in_issue[ordinal] = now
        begin = max(now, h2d_free, out_done.get(ordinal, 0.0))
        h2d_free = in_done[ordinal] = begin + entries[ordinal][1] / h2d_bw

    def arrive(ordinal: int) -> None:
        """Wait until ``ordinal`` is back on the device (a spilled one: read, then copied in)."""
        nonlocal now, wait
        if in_done[ordinal] > now:
            wait += in_done[ordinal] - now
            now = in_done[ordinal]
        if ordinal in spill and ordinal not in in_issue:
            in_issue[ordinal] = now
            copy = entries[ordinal][1] / h2d_bw
            wait += copy
            now = in_done[ordinal] = now + copy

    def remake(ordinal: int) -> None:
        """Recompute ``ordinal`` now, unless a chain made it already. Its inputs must be on the
        device: offloaded ones are loaded now if not on their way, recomputed ones made first
        (and held until their own first use)."""
        nonlocal now, recompute_s
        if ordinal in recompute_start:
            return
        for source in chosen[ordinal].inputs:
            if source in recompute:
                remake(source)
            elif source in offload:
                if source not in in_done:
                    load(source)
                arrive(source)
        recompute_start[ordinal] = now
        cost = sum(seconds[k] for k in chosen[ordinal].all_ops)
        recompute_s += cost
        now += cost
        recompute_end[ordinal] = now

    for index in range(len(trace.ops) + 1):
        if index < trace.backward_start_op:
            kept += kept_at.get(index, 0)
        for ordinal in saves_at.get(index, ()):
            if ordinal in spill:
                copy = entries[ordinal][1] / d2h_bw
                out_start[ordinal] = now
                wait += copy
                now = out_done[ordinal] = now + copy
                disk_free = written[ordinal] = max(now, disk_free) + entries[ordinal][1] / write_bw
                continue
            out_start[ordinal] = max(now, d2h_free)
            d2h_free = out_done[ordinal] = out_start[ordinal] + entries[ordinal][1] / d2h_bw
            pending.append((d2h_free, entries[ordinal][1]))
            if sync_out:
                wait += d2h_free - now
                now = d2h_free
            pending = [(done, size) for done, size in pending if done > now]
            while (
                allowance is not None
                and pending
                and (kept + sum(size for _, size in pending) > allowance)
            ):
                done, _ = pending.pop(0)
                wait += max(done - now, 0.0)
                now = max(now, done)
        for ordinal, k in takes_at.get(index, ()):
            begin = max(now, d2h_free)
            d2h_free = begin + relieved[ordinal].sizes[k] / d2h_bw
            taken[ordinal, k] = (begin, d2h_free)
            if sync_out:  # the runtime waits for every copy out, these too
                wait += d2h_free - now
                now = d2h_free
        for ordinal in issues_at.get(index, ()):
            if ordinal not in in_done:
                load(ordinal)
        for ordinal in recompute_at.get(index, ()):
            remake(ordinal)
        for ordinal in needs_at.get(index, ()):
            arrive(ordinal)
        for ordinal in reloads_at.get(index, ()):
            size = entries[ordinal][1]
            if ordinal in spill:  # read again and copied in, on demand
                begin = max(now, disk_free)
                disk_free = begin + size / read_bw
                reload_start[ordinal].append(disk_free)
                wait += disk_free + size / h2d_bw - now
                now = disk_free + size / h2d_bw
                continue
            begin = max(now, h2d_free)
            reload_start[ordinal].append(begin)
            h2d_free = begin + size / h2d_bw
            wait += h2d_free - now
            now = h2d_free
        for ordinal in joins_at.get(index, ()):
            copied = (taken[ordinal, k][1] for k in range(relieved[ordinal].taken))
            begin = max(now, h2d_free, *copied)
            h2d_free = begin + relieved[ordinal].nbytes / h2d_bw
            rejoined[ordinal] = (now, h2d_free)
            wait += h2d_free - now
            now = h2d_free
        start[index] = now
        if index < len(trace.ops):
            now += seconds[index]
            done_at[index] = now
    end_s = now

    def op_end(index: int | None) -> float:
        """When the op's transient storages are freed: as soon as it finishes."""
        if index is None or index >= len(done_at):
            return end_s
        return done_at[index]

    intervals: list[Interval] = []
    host_spans: list[tuple[float, float, int]] = []
    disk_spans: list[tuple[float, float, int]] = []

    def _hold(ordinal: int, finish: float, nbytes: int) -> None:
        """Where the offloaded copy of ``ordinal`` is kept, from its copy out to ``finish``."""
        if ordinal in spill:  # its staging copy, freed once written, is not counted
            disk_spans.append((out_start[ordinal], finish, nbytes))
        else:
            host_spans.append((out_start[ordinal], finish, nbytes))

    offloaded_storages = {storage_of[i]: i for i in offload}
    scratch_sizes = any(chosen[i].scratch for i in recompute)
    nbytes_of = {record.id: record.nbytes for record in trace.storages} if scratch_sizes else {}
    recomputed_storages = {entries[i][0]: i for i in recompute}
    roles = _junction_roles(relieved)
    for ordinal, junction in relieved.items():
        for k, size in enumerate(junction.sizes[: junction.taken]):
            host_spans.append((taken[ordinal, k][0], rejoined[ordinal][1], size))
        if junction.taken > 1:  # the sum so far and the next partial, while copied in
            loading = Interval(junction.merged, junction.sizes[0], *rejoined[ordinal], "reloaded")
            intervals.append(loading)
    for record in trace.storages:
        begin = 0.0 if record.alloc_op < 0 else start[record.alloc_op]
        finish = op_end(record.free_op)
        if record.id in roles:
            for ordinal, k in roles[record.id]:
                junction = relieved[ordinal]
                if k == _MERGED:  # the sum is made in the copy brought back
                    span = (rejoined[ordinal][0], finish)
                    intervals.append(Interval(record.id, record.nbytes, *span, "reloaded"))
                elif k >= junction.taken:  # the last waits where the engine sums
                    out = max(rejoined[ordinal][1], finish)
                    intervals.append(Interval(record.id, record.nbytes, begin, out, record.kind))
                elif k >= 0:  # on the device until copied out and read
                    out = max(taken[ordinal, k][1], op_end(_last_read(trace, junction, k)))
                    intervals.append(Interval(record.id, record.nbytes, begin, out, record.kind))
            continue
        remade = recomputed_storages.get(record.id)
        if remade is not None:
            intervals.append(
                Interval(
                    record.id, record.nbytes, begin, op_end(record.last_forward_op), record.kind
                )
            )
            if remade in recompute_start:
                intervals.append(
                    Interval(
                        record.id, record.nbytes, recompute_start[remade], finish, "recomputed"
                    )
                )
                span = (recompute_start[remade], recompute_end[remade])
                for scratch in chosen[remade].scratch:  # made on the way, freed at its end
                    nbytes = nbytes_of[scratch]
                    intervals.append(Interval(scratch, nbytes, *span, "recomputed"))
            continue
        moved = offloaded_storages.get(record.id)
        if moved is not None and record.alloc_op < 0:
            # Held outside autograd since before the step (an input): the copy frees nothing.
            _hold(moved, finish, record.nbytes)
            moved = None
        if moved is None:
            intervals.append(Interval(record.id, record.nbytes, begin, finish, record.kind))
            continue
        released = max(out_done[moved], op_end(record.last_forward_op))
        intervals.append(Interval(record.id, record.nbytes, begin, released, record.kind))
        if moved in in_issue:
            # Per use when read back per use: held from each load to the end of that use.
            uses = later_uses.get(moved, [])
            starts = [in_issue[moved], *reload_start.get(moved, [])]
            ends = [
                *(
                    op_end(first_use[record.id] if k == 0 else uses[k - 1])
                    for k in range(len(uses))
                ),
                finish,
            ]
            for begin_s, end_s_ in zip(starts, ends, strict=True):
                intervals.append(Interval(record.id, record.nbytes, begin_s, end_s_, "reloaded"))
        _hold(moved, finish, record.nbytes)

    times, device, host, peak_tensor, peak_at = _sweep(intervals, host_spans, spec)
    peak_rounded = max(device, default=0)
    peak_time = times[device.index(peak_rounded)] if device else 0.0
    peak_op = max((i for i, s in enumerate(start[:-1]) if s <= peak_time), default=0)
    del peak_at
    return SimResult(
        peak_bytes=peak_rounded + spec.workspace_bytes,
        peak_tensor_bytes=peak_tensor,
        peak_op=peak_op,
        host_peak_bytes=max(host, default=0),
        offloaded_bytes=sum(entries[i][1] for i in offload),
        offloaded_tensors=len(offload),
        step_s=end_s,
        base_step_s=base_step_s,
        wait_s=wait,
        timeline_s=tuple(times),
        device_bytes=tuple(device),
        host_bytes=tuple(host),
        intervals=tuple(intervals),
        recomputed_bytes=sum(entries[i][1] for i in recompute),
        recompute_s=recompute_s,
        disk_peak_bytes=max(_sweep((), disk_spans, spec)[2], default=0),
        relieved_junctions=len(relieved),
        relieved_bytes=sum(j.nbytes for j in relieved.values()),
        backward_start_s=start[min(trace.backward_start_op, len(trace.ops))],
    )


def _relieved(trace: Trace, plan: Plan | None) -> dict[int, JunctionRecord]:
    """The plan's relieved junctions that the trace saw as the plan counts them, by ordinal;
    each storage in one only."""
    if plan is None or not plan.stash:
        return {}
    known = trace.junction_ordinals()
    counts = plan.junction_partials()
    chosen: dict[int, JunctionRecord] = {}
    used: set[int] = set()
    for ordinal in sorted(plan.stash):
        junction = known.get(ordinal)
        if junction is None or junction.partials != counts[ordinal] or junction.sums & used:
            continue
        used |= junction.sums
        chosen[ordinal] = junction
    return chosen


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


def _last_read(trace: Trace, junction: JunctionRecord, k: int) -> int:
    """The last op before the sum that reads the k-th partial, other than the engine's sums (the
    op that made it if none)."""
    first = junction.arrive_ops[k]
    last = first - 1
    summing = set(junction.arrive_ops[1:])
    for index in range(first, junction.join_op):
        if index not in summing and junction.grads[k] in trace.ops[index].inputs:
            last = index
    return last


def _sweep(
    intervals: Iterable[Interval],
    host_spans: Iterable[tuple[float, float, int]],
    spec: DeviceSpec,
) -> tuple[list[float], list[int], list[int], int, float]:
    """Piecewise-constant device and host bytes; frees before allocations at equal times."""
    changes: list[tuple[float, int, int, int, int]] = []  # time, order, rounded, raw, host
    for span in intervals:
        rounded = _round(span.nbytes, spec.alloc_round_bytes)
        changes.append((span.start_s, 1, rounded, span.nbytes, 0))
        changes.append((span.end_s, 0, -rounded, -span.nbytes, 0))
    for begin, finish, nbytes in host_spans:
        changes.append((begin, 1, 0, 0, nbytes))
        changes.append((finish, 0, 0, 0, -nbytes))
    changes.sort(key=lambda c: (c[0], c[1]))
    times: list[float] = []
    device: list[int] = []
    host: list[int] = []
    rounded_total = raw_total = host_total = 0
    peak_raw, peak_at = 0, 0.0
    for time_s, _, rounded, raw, held in changes:
        rounded_total += rounded
        raw_total += raw
        host_total += held
        if raw_total > peak_raw:
            peak_raw, peak_at = raw_total, time_s
        if times and times[-1] == time_s:
            device[-1], host[-1] = rounded_total, host_total
            continue
        times.append(time_s)
        device.append(rounded_total)
        host.append(host_total)
    # Peaks inside a group of equal times that frees before it allocates are seen above.
    return times, device, host, peak_raw, peak_at
